"""
The lean Gemma 4 forward and what it reads: the models, their weights and their KV caches.

- checkpoints.py: loading the target, draft model, MTP assistant and tokenizer from local directories; their checks.
- forward.py: the lean forward (LeanGemma4, LeanAssistant) over the loaded weights.
- layers.py, weights.py: one decoder layer's arithmetic, and the weights it reads (row products, blocked storage).
- cache.py: the static KV cache, and its slotted form (a slot per goal of a batch).
- prefix_cache.py: KV blocks of prompt prefixes kept across goals (engine.prefix_cache_mb).
- vision.py: a multimodal target's vision tower, run once per image goal before the prefill.
- eagle.py: an EAGLE-3 draft head over the target's tapped states, its checkpoint and its own K/V.
"""
