"""
What runs the models: loading them, the fast decode path, and its warm-up.

The fast path: a static KV cache, a lean Gemma 4 forward over the loaded weights, and per-q step functions run eager,
inductor-compiled (CPU) or captured as CUDA graphs (GPU). transformers stays the loader and the reference.

Four rooms, each importing only the rooms below it (an import contract in setup.cfg):
- steps/: the step functions per query length, their runners (single, batched rows, the MTP assistant) and warm-up.
- model/: the lean forward, its layers and weights, the KV caches (static, slotted, prefix), the vision tower, and
  loading the checkpoints.
- quant/: weight-only quantization (int8, int4, float16), and loading straight into it.
- ops/: the C++ CPU ops, inductor's on-disk cache, and the one module touching torch's private APIs.

Imports from the engine only the shared types and logits/ (greedy_pick, verify).
"""

from .model.cache import StaticKvCache
from .model.forward import LeanAssistant, LeanGemma4, StepOutput
from .model.layers import resolve_row_product_max_rows
from .steps.assistant import FastAssistant
from .steps.runner import FastCausalLM, GraphJob, WarmupReport
from .steps.tables import STEP_MODES, resolve_compile_mode

__all__ = ['STEP_MODES', 'FastAssistant', 'FastCausalLM', 'GraphJob', 'LeanAssistant', 'LeanGemma4', 'StaticKvCache',
           'StepOutput', 'WarmupReport', 'resolve_compile_mode', 'resolve_row_product_max_rows']
