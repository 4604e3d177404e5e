"""
open_backend: the Backend that engine.backend names, the local engine or a vLLM server.

Above both implementations (it imports each inside the call), so that neither imports the other.
"""

from collections.abc import Callable

from .backend import Backend
from .types import EngineConfig


def open_backend(config: EngineConfig, vllm=None, progress: Callable[[str], None] | None = None) -> Backend:
    """
    Open the backend config.backend names.

    'local' loads the models here (minutes with a cold compile cache); 'vllm' connects lazily to the server vllm
    (a VllmConfig) names and is ready at once.
    """
    if config.backend == 'vllm':
        from .backends.vllm import VllmBackend, VllmConfig

        return VllmBackend(config, vllm if vllm is not None else VllmConfig())
    from .decoding.engine import Engine

    return Engine.from_config(config, progress=progress, tolerate_drafter_errors=True)
