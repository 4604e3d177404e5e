"""The prompt set: JSON lines with ``prompt`` and ``category`` (and an optional ``id``)."""

import json
from dataclasses import dataclass

from gemma_spec_ros.engine.config_file import shipped_file_candidates

DEFAULT_PROMPTS = 'bench/prompts.jsonl'


@dataclass(frozen=True)
class Prompt:
    id: str
    category: str
    text: str


def load_prompts(path: str) -> list[Prompt]:
    """Read a JSONL prompt file; raises ValueError on a malformed line or an empty file."""
    prompts = []
    with open(path, encoding='utf-8') as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError('{}:{}: not JSON: {}'.format(path, lineno, error)) from None
            if not isinstance(record, dict):
                raise ValueError('{}:{}: expected an object with "prompt" and "category"'.format(path, lineno))
            text, category = record.get('prompt'), record.get('category')
            if not isinstance(text, str) or not text:
                raise ValueError('{}:{}: "prompt" must be a non-empty string'.format(path, lineno))
            if not isinstance(category, str) or not category:
                raise ValueError('{}:{}: "category" must be a non-empty string'.format(path, lineno))
            prompts.append(Prompt(id=str(record.get('id') or 'line{}'.format(lineno)), category=category, text=text))
    if not prompts:
        raise ValueError('{}: no prompts'.format(path))
    ids = [p.id for p in prompts]
    if len(set(ids)) != len(ids):
        raise ValueError('{}: duplicate prompt ids'.format(path))
    return prompts


def categories_of(prompts: list[Prompt]) -> list[str]:
    """Categories in order of first appearance."""
    return list(dict.fromkeys(p.category for p in prompts))


def take_per_category(prompts: list[Prompt], count: int) -> list[Prompt]:
    """Keep the first ``count`` prompts of each category (all when count is 0)."""
    if count < 0:
        raise ValueError('per-category count must be >= 0, got {}'.format(count))
    if count == 0:
        return list(prompts)
    taken: dict[str, int] = {}
    chosen = []
    for prompt in prompts:
        if taken.get(prompt.category, 0) < count:
            taken[prompt.category] = taken.get(prompt.category, 0) + 1
            chosen.append(prompt)
    return chosen


def default_prompts_path(name: str = DEFAULT_PROMPTS, option: str = '--prompts') -> str:
    """bench/prompts.jsonl (or another bench file) of the dev checkout, else of an installed share/gemma_spec_ros."""
    for candidate in shipped_file_candidates(name):
        if candidate.is_file():
            return str(candidate)
    raise ValueError('no {} found; pass {} FILE'.format(name, option))
