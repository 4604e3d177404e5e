"""
The fast decode path.

A static KV cache, a lean Gemma 4 forward over the loaded weights, and per-q step functions run eager,
inductor-compiled (CPU) or captured as CUDA graphs (GPU). transformers stays the loader and the reference.
"""

from .assistant import FastAssistant
from .cache import StaticKvCache
from .model import LeanAssistant, LeanGemma4, StepOutput
from .runner import FastCausalLM, GraphJob, WarmupReport
from .steps import STEP_MODES, resolve_compile_mode

__all__ = ['STEP_MODES', 'FastAssistant', 'FastCausalLM', 'GraphJob', 'LeanAssistant', 'LeanGemma4', 'StaticKvCache',
           'StepOutput', 'WarmupReport', 'resolve_compile_mode']
