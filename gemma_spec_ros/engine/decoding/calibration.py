"""
Verify-cost calibration: time target passes of every size, and start the controllers' cost curve there.

Functions of a loaded Engine (its target, lock and cost model), which it also offers as methods
(Engine.time_target_passes, median_target_passes, calibrate_verify_costs); Stopwatch times a round's parts.
"""

import random
import statistics
import time
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .engine import Engine

CALIBRATION_ROUNDS = 5     # timed passes of every size when the engine loads (calibrate_verify_costs)
CALIBRATION_CONTEXT = 64   # tokens of context the calibration passes follow (at most)


class Stopwatch:
    """Times the parts of a round; on CUDA with events, read after the round's sync (no extra host sync)."""

    def __init__(self, device: torch.device):
        self._cuda = device.type == 'cuda'

    def mark(self):
        if not self._cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start, end) -> float:
        if not self._cuda:
            return end - start
        end.synchronize()  # recorded after the sync (time_target_passes): done at once, but not yet when asked
        return start.elapsed_time(end) / 1000.0


def time_target_passes(engine: 'Engine', prompt_ids: list[int], sizes: list[int]) -> dict[int, float]:
    """
    Seconds of one verify pass of the target over n tokens after prompt_ids, for each n in sizes (benchmarks).

    The passes run through the decode steps the engine verifies with, each from the same prefilled context
    (rolled back after it), between requests.
    """
    if not sizes or min(sizes) < 1 or max(sizes) > engine.config.max_draft_tokens + 1:
        raise ValueError('pass sizes must be 1..{} (max_draft_tokens + 1), got {}'.format(
            engine.config.max_draft_tokens + 1, sizes))
    if not prompt_ids or len(prompt_ids) + max(sizes) > engine._context_limit:
        raise ValueError('a {}-token prompt leaves no room for {} tokens in the {}-token context'.format(
            len(prompt_ids), max(sizes), engine._context_limit))
    stopwatch = Stopwatch(engine._device)
    seconds = {}
    with engine._lock, torch.inference_mode():
        if engine._warmup is not None:
            engine._warmup.adopt()  # between requests: time the graphs built so far
        engine._target.reset()
        engine._target.prefill(torch.tensor([prompt_ids], device=engine._device))
        next_tokens = torch.tensor([(prompt_ids[::-1] * max(sizes))[:max(sizes)]], device=engine._device)  # real ids
        for n in sizes:
            started = stopwatch.mark()
            engine._target.append(next_tokens[:, :n], logits_to_keep=0).logits.sum().item()  # the round's sync
            seconds[n] = stopwatch.seconds(started, stopwatch.mark())
            engine._target.crop(-n)
    return seconds


def median_target_passes(engine: 'Engine', prompt_ids: list[int], rounds: int) -> dict[int, float]:
    """Median seconds of verify passes of 1..max_draft_tokens + 1 tokens after prompt_ids, shuffled per round."""
    sizes = list(range(1, engine.config.max_draft_tokens + 2))
    order = random.Random(0)
    samples: dict[int, list[float]] = {n: [] for n in sizes}
    for _ in range(rounds):
        order.shuffle(sizes)
        for n, seconds in engine.time_target_passes(prompt_ids, sizes).items():
            samples[n].append(seconds)
    return {n: statistics.median(times) for n, times in samples.items()}


def calibrate_verify_costs(engine: 'Engine', rounds: int = CALIBRATION_ROUNDS) -> dict[int, float]:
    """
    Time verify passes of every size (median_target_passes) and start the controllers' cost curve there.

    Learned only online, the curve's shape comes from adjacent passes of different sizes, which a run pairs
    rarely and with a bias (the first plain pass is timed with the target's weights in cache, verify passes after
    the drafter ran); it priced long drafts too dear. Returns the median seconds per size.
    """
    length = min(CALIBRATION_CONTEXT, engine._context_limit - engine.config.max_draft_tokens - 1)
    medians = engine.median_target_passes([token % engine._vocab_size for token in range(16, 16 + length)], rounds)
    with engine._measure_lock:
        engine._target_cost.calibrate(medians)
    return medians


def calibrate(engine: 'Engine', progress) -> None:
    """Calibrate the verify costs when the engine speculates, and report the curve (at load, after warm-up)."""
    if engine._controllers:
        curve = engine.calibrate_verify_costs()
        progress('verify passes of 1..{} tokens: {} ms'.format(len(curve), ' / '.join(
            '{:.1f}'.format(seconds * 1e3) for _, seconds in sorted(curve.items()))))
        if engine._batch is not None:  # the batched passes, whose shares the goals of a batch are priced by
            for rows, passes in engine._batch.calibrate(CALIBRATION_ROUNDS, CALIBRATION_CONTEXT).items():
                times = ' / '.join('{:.1f}'.format(seconds * 1e3) for _, seconds in sorted(passes.items()))
                progress('batched verify passes of {} rows, 1..{} tokens a row: {} ms'.format(rows, len(passes), times))
