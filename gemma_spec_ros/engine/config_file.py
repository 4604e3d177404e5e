"""EngineConfig from the node's ROS 2 params file (``/**: ros__parameters: engine: {...}``), and option files."""

import dataclasses
import os
from pathlib import Path

import yaml

from .types import REGISTRY, EngineConfig, parameter_name

REPO_ROOT = Path(__file__).resolve().parents[2]
MODEL_PATH_FIELDS = ('target_path',) + tuple(spec.path_field for spec in REGISTRY.values() if spec.path_field)


def read_constraint_files(json_schema: str | None, grammar: str | None) -> dict[str, str]:
    """
    Return request fields {'json_schema' / 'grammar': text} from the files of --json-schema / --grammar.

    ValueError naming the option when a file cannot be read; the engine checks the content.
    """
    fields = {}
    for field, path in (('json_schema', json_schema), ('grammar', grammar)):
        if path:
            try:
                fields[field] = Path(path).read_text(encoding='utf-8')
            except (OSError, UnicodeDecodeError) as error:
                raise ValueError('--{}: cannot read {}: {}'.format(field.replace('_', '-'), path, error)) from error
    return fields


def shipped_file_candidates(relative: str) -> list[Path]:
    """Return where a shipped file may be: the repository root (a checkout), then each $AMENT_PREFIX_PATH share."""
    candidates = [REPO_ROOT / relative]
    for prefix in filter(None, os.environ.get('AMENT_PREFIX_PATH', '').split(os.pathsep)):
        candidates.append(Path(prefix) / 'share' / 'gemma_spec_ros' / relative)
    return candidates


def resolve_model_path(path: str) -> str:
    """
    Absolute path for a model directory.

    Absolute paths stay; a relative path is tried against the working directory, then the repository root (dev
    checkout), then ``share/gemma_spec_ros/`` under each ``$AMENT_PREFIX_PATH`` entry. Unresolved paths are returned
    relative to the working directory so that loading reports them.
    """
    if not path or os.path.isabs(path):
        return path
    for candidate in [Path.cwd() / path, *shipped_file_candidates(path)]:
        if candidate.exists():
            return str(candidate.resolve())
    return str(Path.cwd() / path)


def _group(params: dict, group: str) -> dict:
    """One parameter group, nested (``engine: {drafter: mtp}``) or flattened (``engine.drafter: mtp``)."""
    nested = params.get(group, {})
    values = dict(nested) if isinstance(nested, dict) else {}
    values.update({key[len(group) + 1:]: value for key, value in params.items() if key.startswith(group + '.')})
    return values


def _config_params(document: dict, yaml_path: str) -> dict:
    """
    Return the EngineConfig values of the first node section with ros__parameters.

    That is the engine group plus the config fields of other groups (e.g. generation.max_prompt_chars).
    """
    for section in document.values():
        if isinstance(section, dict) and isinstance(section.get('ros__parameters'), dict):
            params = section['ros__parameters']
            values = _group(params, 'engine')
            for field in dataclasses.fields(EngineConfig):
                group = field.metadata['group']
                if group != 'engine' and field.name in _group(params, group):
                    values[field.name] = _group(params, group)[field.name]
            return values
    raise ValueError('{} has no "<node>: ros__parameters:" section'.format(yaml_path))


def load_engine_config(yaml_path: str | None, overrides: dict | None = None) -> EngineConfig:
    """Read the engine group of a params file, apply overrides (None values ignored), resolve model paths."""
    values: dict = {}
    if yaml_path:
        try:
            with open(yaml_path, encoding='utf-8') as stream:
                document = yaml.safe_load(stream) or {}
        except OSError as exc:
            raise ValueError('cannot read config file {}: {}'.format(yaml_path, exc)) from exc
        values = _config_params(document, yaml_path)
    values.update({key: value for key, value in (overrides or {}).items() if value is not None})
    known = {field.name: field for field in dataclasses.fields(EngineConfig)}
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ValueError('unknown engine parameter(s) {}; known: {}'.format(', '.join(unknown), ', '.join(known)))
    if not values.get('target_path'):
        raise ValueError('engine.target_path is not set (no --target and none in the config file)')
    for name in MODEL_PATH_FIELDS:
        if values.get(name):
            values[name] = resolve_model_path(str(values[name]))
    for name, value in values.items():
        expected = type(getattr(EngineConfig(target_path=''), name))
        if expected in (int, float) and isinstance(value, bool) or not isinstance(value, expected):
            if expected is float and isinstance(value, int):
                values[name] = float(value)
                continue
            raise ValueError('{} must be a {}, got {!r}'.format(parameter_name(name), expected.__name__, value))
    return EngineConfig(**values)
