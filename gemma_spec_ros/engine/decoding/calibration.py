"""
Verify-cost calibration: time target passes of every size, which start the controllers' cost curve.

Engine.calibrate_verify_costs runs them; Stopwatch times a round's parts.
"""

import random
import statistics
import time

import torch

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


def check_passes(prompt_ids: list[int], sizes: list[int], max_size: int, context_limit: int) -> None:
    """Raise ValueError unless passes of sizes (1..max_size tokens) fit after prompt_ids in the context."""
    if not sizes or min(sizes) < 1 or max(sizes) > max_size:
        raise ValueError('pass sizes must be 1..{} (max_draft_tokens + 1), got {}'.format(max_size, sizes))
    if not prompt_ids or len(prompt_ids) + max(sizes) > context_limit:
        raise ValueError('a {}-token prompt leaves no room for {} tokens in the {}-token context'.format(
            len(prompt_ids), max(sizes), context_limit))


def time_passes(target, device: torch.device, prompt_ids: list[int], sizes: list[int]) -> dict[int, float]:
    """
    Time one verify pass of target over n tokens after prompt_ids, for each n in sizes (seconds).

    Its caller holds the engine: this runs between goals.
    Each pass runs from the same prefilled context (rolled back after it), through the decode steps the engine
    verifies with.
    """
    stopwatch = Stopwatch(device)
    seconds = {}
    target.reset()
    target.prefill(torch.tensor([prompt_ids], device=device))
    next_tokens = torch.tensor([(prompt_ids[::-1] * max(sizes))[:max(sizes)]], device=device)  # real ids
    for n in sizes:
        started = stopwatch.mark()
        target.append(next_tokens[:, :n], logits_to_keep=0).logits.sum().item()  # the round's sync
        seconds[n] = stopwatch.seconds(started, stopwatch.mark())
        target.crop(-n)
    return seconds


def median_passes(time_sizes, max_size: int, rounds: int) -> dict[int, float]:
    """Median seconds of passes of 1..max_size tokens over rounds, the sizes shuffled per round (time_sizes(sizes))."""
    sizes = list(range(1, max_size + 1))
    order = random.Random(0)
    samples: dict[int, list[float]] = {n: [] for n in sizes}
    for _ in range(rounds):
        order.shuffle(sizes)
        for n, seconds in time_sizes(sizes).items():
            samples[n].append(seconds)
    return {n: statistics.median(times) for n, times in samples.items()}


def calibration_prompt(context_limit: int, max_draft_tokens: int, vocab_size: int) -> list[int]:
    """Return the context the calibration passes follow: CALIBRATION_CONTEXT tokens at most, room for the largest."""
    length = min(CALIBRATION_CONTEXT, context_limit - max_draft_tokens - 1)
    return [token % vocab_size for token in range(16, 16 + length)]


def report_curve(progress, curve: dict[int, float], batched: dict[int, dict[int, float]]) -> None:
    """Report the verify-pass times that start the cost curves (single-goal, and batched per row count)."""
    progress('verify passes of 1..{} tokens: {} ms'.format(len(curve), ' / '.join(
        '{:.1f}'.format(seconds * 1e3) for _, seconds in sorted(curve.items()))))
    for rows, passes in batched.items():
        times = ' / '.join('{:.1f}'.format(seconds * 1e3) for _, seconds in sorted(passes.items()))
        progress('batched verify passes of {} rows, 1..{} tokens a row: {} ms'.format(rows, len(passes), times))
