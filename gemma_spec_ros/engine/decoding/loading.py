"""
Loading an Engine from an EngineConfig: the target, its tokenizer, every drafter whose model is set, and the warm-up.

Engine.from_config calls load_engine. The engine it builds warms up as the config asks (Engine.warm_up: blocking,
done here; background, a Warmup started here unless start_warmup is False) and calibrates its verify costs.
"""

import torch

from .. import requests
from ..drafters import drafter_class
from ..drafters.base import LoadContext
from ..runtime import causal_lm, models
from ..runtime.quantize import Quantizer
from ..stats import mib
from ..types import REGISTRY, DisabledDrafter, EngineConfig
from . import compile_worker
from .engine import Engine


def load_engine(config: EngineConfig, progress=None, tolerate_drafter_errors: bool = False,
                start_warmup: bool = True) -> Engine:
    """
    Load the target and every drafter whose model path is set; ValueError when something does not fit.

    tolerate_drafter_errors: a drafter that fails to load is disabled (see drafter_errors) instead of failing
    the whole engine; requests for it run plain decoding with a warning. The target is always required.
    start_warmup: False leaves a background warm-up to warmup.start() or its build calls (benchmarks, tests).
    """
    progress = progress or (lambda message: None)
    requests.check_config(config)
    if config.num_threads > 0:
        torch.set_num_threads(config.num_threads)
    device = models.resolve_device(config.device)
    dtype = models.resolve_dtype(config.dtype, device)
    progress('loading target {} on {} ({})'.format(config.target_path, device, str(dtype).replace('torch.', '')))
    quantizer = Quantizer.for_mode(config.quantization)
    target = models.load_causal_lm(config.target_path, 'target', device, dtype, quantizer)
    tokenizer = models.load_tokenizer(config.target_path)
    target_lm = causal_lm.build_causal_lm(target, config.compile, models.context_limit(config, target),
                                          config.max_draft_tokens + 1, 'target', progress, quantizer)
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
    engine = Engine(config, target_lm, tokenizer, drafters, device, dtype, errors)
    engine.warm_up(progress, compile_worker.__name__)
    status = engine.status()
    progress('engine ready: drafters {}; decode steps {} ({}), warm-up {}, weights {:.1f} MiB, KV cache {:.1f} MiB '
        '({} tokens)'.format(', '.join(sorted(drafters)), target_lm.mode, status.warmup.serving,
                             'in the background ({} graphs)'.format(len(engine.graph_jobs)) if engine.warmup else
                             '{:.1f} s'.format(status.warmup.seconds),
                             mib(status.weights_bytes), mib(status.kv_cache_bytes), engine.context_limit))
    if engine.warmup is not None and start_warmup:
        engine.warmup.start()
    return engine
