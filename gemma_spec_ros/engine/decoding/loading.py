"""
Loading what an Engine is made of, from an EngineConfig: the target, its tokenizer, every drafter whose model is set.

Engine.from_config builds the engine from these parts in one step (load_parts), then warms it up.
"""

import dataclasses
from dataclasses import dataclass

import torch

from .. import config_checks
from ..drafters import drafter_class
from ..drafters.base import Drafter, LoadContext
from ..runtime import FastCausalLM, resolve_row_product_max_rows
from ..runtime.model import checkpoints
from ..runtime.model.prefix_cache import PrefixCache
from ..runtime.quant.quantize import Quantizer
from ..runtime.steps import causal_lm
from ..stats import mib
from ..types import REGISTRY, DisabledDrafter, EngineConfig


@dataclass
class EngineParts:
    """What loading builds: the arguments of the Engine made from them (Engine.from_config)."""

    config: EngineConfig
    target_lm: object                      # runtime.causal_lm: FastCausalLM or DynamicCausalLM
    tokenizer: object
    drafters: dict[str, Drafter]
    device: torch.device
    dtype: torch.dtype
    drafter_errors: dict[str, DisabledDrafter]
    prefix_caches: list[PrefixCache]


def load_parts(config: EngineConfig, progress, tolerate_drafter_errors: bool = False) -> EngineParts:
    """
    Load the target and every drafter whose model path is set; ValueError when something does not fit.

    tolerate_drafter_errors: a drafter that fails to load is disabled (see drafter_errors) instead of failing
    the whole engine; requests for it run plain decoding with a warning. The target is always required.
    """
    config_checks.check_config(config)
    # resolved once: every runner, and the background compile process (it loads this config), use the same graphs
    config = dataclasses.replace(config, row_product_max_rows=resolve_row_product_max_rows(config.row_product_max_rows))
    if config.num_threads > 0:
        torch.set_num_threads(config.num_threads)
    device = checkpoints.resolve_device(config.device)
    dtype = checkpoints.resolve_dtype(config.dtype, device)
    progress('loading target {} on {} ({})'.format(config.target_path, device, str(dtype).replace('torch.', '')))
    quantizer = Quantizer.for_mode(config.quantization)
    target = checkpoints.load_causal_lm(config.target_path, 'target', device, dtype, quantizer)
    tokenizer = checkpoints.load_tokenizer(config.target_path)
    target_lm = causal_lm.build_causal_lm(target, config.compile, checkpoints.context_limit(config, target),
                                          config.max_draft_tokens + 1, 'target', progress, quantizer,
                                          config.row_product_max_rows)
    context = LoadContext(config, target_lm, tokenizer, device, dtype, progress)
    drafters, errors = {}, {}
    for name, spec in REGISTRY.items():
        if spec.path_field and not getattr(config, spec.path_field):
            continue
        try:
            drafters[name] = drafter_class(name).load(context)
        except ValueError as exc:
            if not tolerate_drafter_errors:
                raise
            errors[name] = DisabledDrafter(name, spec.role, getattr(config, spec.path_field), str(exc))
            progress(errors[name].describe())
    return EngineParts(config, target_lm, tokenizer, drafters, device, dtype, errors,
                       prefix_caches(config, target_lm, drafters))


def ready_message(engine) -> str:
    """Describe a loaded engine: its drafters, decode steps, warm-up, weights and KV cache."""
    status = engine.status()
    return ('engine ready: drafters {}; decode steps {} ({}), warm-up {}, weights {:.1f} MiB, KV cache {:.1f} MiB '
            '({} tokens)').format(', '.join(sorted(engine.capabilities.drafters)), status.compile_mode,
                                  status.warmup.serving, 'in the background ({} graphs)'.format(
                                      len(engine.graph_jobs)) if engine.warmup else '{:.1f} s'.format(
                                      status.warmup.seconds), mib(status.weights_bytes), mib(status.kv_cache_bytes),
                                  engine.context_limit)


def prefix_caches(config: EngineConfig, target_lm, drafters: dict) -> list[PrefixCache]:
    """
    Return the prefix caches within engine.prefix_cache_mb: the target's first, then its drafters' own models'.

    The budget is shared by K/V bytes per prompt token, so that each model keeps about as many tokens. None (an
    empty list) when it is 0, or off the fast path (transformers' forward has no static cache to restore into).
    """
    budget = config.prefix_cache_mb * 2 ** 20
    if budget <= 0 or not isinstance(target_lm, FastCausalLM):
        return []
    per_token = {name: drafter.prompt_kv_bytes_per_token for name, drafter in drafters.items()}
    target_per_token = target_lm.cache.nbytes / target_lm.cache.context_limit
    total = target_per_token + sum(per_token.values())
    caches = [PrefixCache(int(budget * target_per_token / total))]
    for name, drafter in drafters.items():
        if per_token[name]:
            caches.append(PrefixCache(int(budget * per_token[name] / total)))
            drafter.keep_prefixes(caches[-1])
    return caches
