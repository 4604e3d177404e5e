"""
Every rule about an engine config and its parameters, in one place.

Limits and choices, cross-field rules, the batch's slots within its KV budget, and the drafter and K that a goal or
a parameter change may pick.

The node's parameter callbacks, loading and the request rules go through these; imports no torch.
"""

import dataclasses

from .types import AUTO, DRAFTERS, REGISTRY, EngineConfig, parameter_name


def check_config(config: EngineConfig) -> None:
    """Raise ValueError naming the parameter when the config breaks a limit, a choice or a cross-field rule."""
    for field in dataclasses.fields(EngineConfig):
        value, meta, name = getattr(config, field.name), field.metadata, parameter_name(field.name)
        check_parameter(name, value, meta['choices'], meta['limits'])
    spec = REGISTRY.get(config.drafter)  # auto: whatever drafters load
    if spec is not None and spec.path_field and not getattr(config, spec.path_field):
        raise ValueError('drafter {!r} needs {} (the {} directory)'.format(
            config.drafter, parameter_name(spec.path_field), spec.role))
    check_num_draft_tokens(config.num_draft_tokens, config)
    if config.ngram_min > config.ngram_max:
        raise ValueError('ngram sizes need 1 <= ngram_min <= ngram_max, got {} and {}'.format(
            config.ngram_min, config.ngram_max))
    check_max_new_tokens(config.max_new_tokens, config)
    check_batching(config)
    if config.quantization != 'none' and config.compile == 'transformers':
        raise ValueError("{}={} needs the lean forward; {}=transformers runs transformers' own forward, which "
                         'reads float weights'.format(parameter_name('quantization'), config.quantization,
                                                      parameter_name('compile')))


def check_batching(config: EngineConfig) -> None:
    """engine.max_batch 0 (auto) needs engine.batch_kv_budget_mb and the local engine; the budget needs auto."""
    max_batch, budget = parameter_name('max_batch'), parameter_name('batch_kv_budget_mb')
    if config.max_batch == 0 and config.backend != 'local':
        raise ValueError('{}=0 (as many KV-cache slots as {} holds) is for the local backend; with {}={} it is the '
                         'goals this node sends at once, >= 1'.format(max_batch, budget, parameter_name('backend'),
                                                                       config.backend))
    if config.max_batch == 0 and config.batch_kv_budget_mb <= 0:
        raise ValueError("{}=0 sizes the batch by {}, the MiB of the target's KV cache its slots may take: set it "
                         '(> 0), or set {} >= 1'.format(max_batch, budget, max_batch))
    if config.max_batch != 0 and config.batch_kv_budget_mb > 0:
        raise ValueError('{}={} MiB applies only with {}=0 (slots from the budget); got {}={}'.format(
            budget, config.batch_kv_budget_mb, max_batch, max_batch, config.max_batch))


def slots_within_budget(config: EngineConfig, slot_bytes: int, context_limit: int) -> int:
    """
    Return the batch's KV-cache slots with engine.max_batch 0: as many as engine.batch_kv_budget_mb holds (<= 64).

    slot_bytes: the target's KV cache per slot at context_limit. ValueError when the budget holds fewer than 2.
    """
    most = EngineConfig.__dataclass_fields__['max_batch'].metadata['limits'][1]
    slots = min(most, int(config.batch_kv_budget_mb * 2 ** 20 // slot_bytes))
    if slots < 2:
        raise ValueError('{}={} MiB holds {} KV-cache slot(s) of {:.1f} MiB ({} tokens of context each); a batch '
                         'needs 2: raise it, lower {}, or set {}=1'.format(
                             parameter_name('batch_kv_budget_mb'), config.batch_kv_budget_mb, slots,
                             slot_bytes / 2 ** 20, context_limit, parameter_name('context_limit'),
                             parameter_name('max_batch')))
    return slots


def check_parameter(name: str, value, choices: tuple | None, limits: tuple | None) -> None:
    """Check one parameter: a string among its choices, a number within its limits (min, max)."""
    if choices is not None and value not in choices:
        unknown = 'unknown drafter {!r}: '.format(value) if name == parameter_name('drafter') else ''
        raise ValueError('{}{} must be one of {}, got {!r}'.format(unknown, name, '|'.join(choices), value))
    if limits is not None and not limits[0] <= value <= limits[1]:
        raise ValueError('{} must be between {} and {}, got {}'.format(name, limits[0], limits[1], value))


def check_num_draft_tokens(k: int, config: EngineConfig) -> None:
    if not 0 <= k <= config.max_draft_tokens:
        raise ValueError('num_draft_tokens must be between 0 (adaptive) and max_draft_tokens={}, got {}'.format(
            config.max_draft_tokens, k))


def check_max_new_tokens(max_new_tokens: int, config: EngineConfig) -> None:
    if not 1 <= max_new_tokens <= config.max_new_tokens_limit:
        raise ValueError('max_new_tokens must be between 1 and {} ({}), got {}'.format(
            config.max_new_tokens_limit, parameter_name('max_new_tokens_limit'), max_new_tokens))


def check_drafter(name: str, loaded) -> None:
    """Raise ValueError when drafter name is unknown or its model was not loaded (auto: when loaded lacks it)."""
    if name not in DRAFTERS:
        raise ValueError('unknown drafter {!r}; choose one of {}'.format(name, ', '.join(DRAFTERS)))
    if name == AUTO and name not in loaded:
        raise ValueError('drafter {!r} is not served by this backend'.format(name))
    if name not in loaded:
        raise ValueError('drafter {!r} is not loaded: set {} to its model directory'.format(
            name, parameter_name(REGISTRY[name].path_field)))


def number_digits(config: EngineConfig) -> tuple[int, int]:
    """Return the most digits of a JSON number's integer part and fraction in json_schema output (0: unbounded)."""
    return config.json_integer_digits, config.json_fraction_digits
