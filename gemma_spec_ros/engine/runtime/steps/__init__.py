"""
The decode steps: per-q step functions run eager, inductor-compiled (CPU) or captured as CUDA graphs (GPU).

- causal_lm.py: one interface over a causal LM and its KV cache, fast (FastCausalLM) or transformers' (DynamicCausalLM).
- runner.py: FastCausalLM, the step functions per query length; GraphJob, one graph a background warm-up builds.
- assistant.py: FastAssistant, the MTP assistant's runner over the target's static cache.
- eagle.py: FastEagle3, the EAGLE-3 head's entries over its own K/V.
- rows.py: FastRows, the target's batched steps (continuous batching): row b of a pass in KV-cache slot b.
- tables.py, direct_graph.py: step tables per compile mode, and compiled CPU graphs called directly.
- warmup.py: blocking or background warm-up of the step graphs (its compile process is decoding/compile_worker.py).
"""
