"""
Speculative-decoding engine for Gemma 4 (no ROS imports).

Names are imported on first use, so ``from gemma_spec_ros.engine.types import ...`` and the torch-free modules
(types with the drafters' registry, requests, stats) load without torch.
"""

import importlib

_EXPORTS = {
    'Engine': 'decoding.engine', 'verify': 'logits.verify', 'RequestPlan': 'requests',
    'load_engine_config': 'config_file', 'resolve_model_path': 'config_file',
    **{name: 'types' for name in ('DRAFTERS', 'FINISH_REASONS', 'CancelToken', 'DeltaCallback', 'DisabledDrafter',
                                  'EngineConfig', 'EngineStatus', 'GenerationRequest', 'GenerationResult',
                                  'GenerationStats', 'StreamDelta', 'ToolCall')},
}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError('module {!r} has no attribute {!r}'.format(__name__, name))
    return getattr(importlib.import_module('.' + _EXPORTS[name], __name__), name)
