"""Speculative-decoding engine for Gemma 4 (no ROS imports)."""

from .config_file import load_engine_config, resolve_model_path
from .engine import Engine
from .types import (
    DRAFTERS,
    FINISH_REASONS,
    CancelToken,
    DeltaCallback,
    EngineConfig,
    EngineStatus,
    GenerationRequest,
    GenerationResult,
    GenerationStats,
    StreamDelta,
)
from .verify import verify

__all__ = [
    'DRAFTERS', 'FINISH_REASONS', 'CancelToken', 'DeltaCallback', 'Engine', 'EngineConfig', 'EngineStatus',
    'GenerationRequest', 'GenerationResult', 'GenerationStats', 'StreamDelta', 'load_engine_config',
    'resolve_model_path', 'verify',
]
