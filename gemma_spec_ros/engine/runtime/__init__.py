"""
What runs the models: loading them, the fast decode path, and its warm-up.

The fast path: a static KV cache, a lean Gemma 4 forward over the loaded weights, and per-q step functions run eager,
inductor-compiled (CPU) or captured as CUDA graphs (GPU). transformers stays the loader and the reference.

- models.py: loading the target, draft model, MTP assistant and tokenizer from local directories; their checks.
- causal_lm.py: one interface over a causal LM and its KV cache, fast (FastCausalLM) or transformers' (DynamicCausalLM).
- runner.py: FastCausalLM, the step functions per query length; GraphJob, one graph a background warm-up builds.
- assistant.py: FastAssistant, the MTP assistant's runner over the target's static cache.
- rows.py: FastRows, the target's batched steps (continuous batching): row b of a pass in KV-cache slot b.
- model.py, layers.py, weights.py: the lean forward, one decoder layer's arithmetic, the weights it reads.
- cache.py: the static KV cache, and its slotted form (a slot per goal of a batch).
- quantize.py, quantized_loading.py: engine.quantization (int8, int4, float16), and loading straight into it.
- cpu_ops.py (cpu_attention.cpp, int8_linear.cpp, lane_totals.h): the C++ CPU ops, attention and the int8 product.
- vision.py: a multimodal target's vision tower, run once per image goal before the prefill.
- steps.py, direct_graph.py, compile_cache.py: step tables per compile mode, compiled CPU graphs called directly,
  inductor's on-disk cache.
- torch_internals.py: the one module that touches torch's private APIs (probed, with a public fallback).
- warmup.py: blocking or background warm-up of the step graphs (its compile process is decoding/compile_worker.py).

Imports from the engine only the shared types and logits/ (greedy_pick, verify).
"""

from .assistant import FastAssistant
from .cache import StaticKvCache
from .model import LeanAssistant, LeanGemma4, StepOutput
from .runner import FastCausalLM, GraphJob, WarmupReport
from .steps import STEP_MODES, resolve_compile_mode

__all__ = ['STEP_MODES', 'FastAssistant', 'FastCausalLM', 'GraphJob', 'LeanAssistant', 'LeanGemma4', 'StaticKvCache',
           'StepOutput', 'WarmupReport', 'resolve_compile_mode']
