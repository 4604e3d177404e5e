"""
The local engine: the decode loop (Engine, the local Backend) and what only it uses.

- engine.py: Engine, the local Backend; its single-goal loop runs the target's own passes and cache.
- rounds.py: Rounds, the steps of a decode round (plan, draft, verify, accept, emit) for one goal or a batch.
- loading.py: load_parts, what an Engine is built from (Engine.from_config): models, drafters, prefix caches.
- calibration.py: timing target passes of every size, the controllers' verify-cost curve; Stopwatch.
- batch.py: BatchScheduler, continuous batching (engine.max_batch): goals decoded together, one pass per round.
- run.py: Run, the state of one generation, and end_of_output (EOS, max_new_tokens).
- auto.py: AutoDrafting, the members of an auto goal (every loaded drafter) and the drafter of each of its rounds.
- stream.py: incremental detokenizing and stop strings.
- compile_worker.py: the compile process of a background warm-up (``python -m``; it loads an Engine).

Nothing here is imported by the drafters, the controller, the runtime or the logits functions below it.
"""
