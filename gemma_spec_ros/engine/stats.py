"""
One definition of each metric; the engine, the vLLM backend, /diagnostics, the tools, bench and train use these.

Imports no torch: the ROS tools import this module.

- tau (τ): tokens per decode pass, (new tokens - 1) / (target passes - 1): the prefill pass and the first token it
  yields are left out, so τ is what a decode round yields (its accepted drafts and the bonus token), the figure
  Leviathan's prediction (expected_tokens) is about. Plain decoding has τ = 1. GenerationStats.tau, /diagnostics,
  the tools and the bench all show this one τ;
- acceptance rate: accepted drafts / drafted tokens;
- decode tokens per second: tokens that arrived after the first one / seconds from the first arrival to the last
  (time to first token is a figure of its own);
- inter-token latency: a round that emits n tokens g seconds after the previous one adds n gaps of g / n;
- percentiles: linear interpolation between order statistics;
- memory: bytes everywhere; MiB (2**20 bytes) only where a figure is shown, through mib;
  process RSS and its high-water mark, and system MemAvailable, come from /proc.

Undefined figures: a ratio without data (nothing drafted, no target pass, no decode time, no samples) is NaN,
never 0.0, so that it cannot pass for a measurement. format_figure shows NaN as NO_DATA ('-'), which is how
/diagnostics, the tools and the reports print it; a server backend's unknown figures are NaN too (counts -1).
"""

import math
import resource
from collections.abc import Sequence
from dataclasses import dataclass, field

from .types import GenerationStats

MIB = float(2 ** 20)
NO_DATA = '-'


def _ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator > 0 else math.nan


def is_known(value) -> bool:
    """Tell whether a figure is defined: NaN is no data (or unknown to a server backend), as is a count of -1."""
    return value is not None and not (isinstance(value, float) and math.isnan(value)) and value != -1


def format_figure(value, spec: str = '{:.3f}') -> str:
    """Show a figure with spec, or NO_DATA ('-') when it is undefined."""
    return spec.format(value) if is_known(value) else NO_DATA


def tau(new_tokens: float | Sequence[float], target_passes: float | Sequence[float], generations: float = 1) -> float:
    """
    Return τ, tokens per decode pass: (new_tokens - 1) / (target_passes - 1), NaN without a decode pass.

    The prefill pass yields the first token alone; leaving it out gives what one decode round yields, which is
    what expected_tokens predicts and what decode tokens per second is made of. For several generations pass
    their counts as sequences (each leaves its own prefill pass out, and the ratio pools what remains), or their
    sums with the number of generations.
    """
    if isinstance(new_tokens, int | float):
        return _ratio(max(0.0, new_tokens - generations), max(0.0, target_passes - generations))
    return _ratio(sum(max(0, n - 1) for n in new_tokens), sum(max(0, p - 1) for p in target_passes))


def slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Return the least-squares slope of ys over xs (a memory trend); NaN with fewer than 2 distinct xs."""
    if len(xs) < 2:
        return math.nan
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    spread = sum((x - mean_x) ** 2 for x in xs)
    return _ratio(sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)), spread)


def acceptance_rate(accepted: float, drafted: float) -> float:
    """Return accepted drafts / drafted tokens; NaN when nothing was drafted (plain decoding)."""
    return _ratio(accepted, drafted)


def tokens_per_second(tokens: float, seconds: float) -> float:
    """Return tokens / seconds; NaN without time (one token, or nothing measured)."""
    return _ratio(tokens, seconds)


def decode_tokens_per_second(arrivals: list[tuple[float, int]], total_tokens: int | None = None) -> float:
    """
    Return the decode rate of (time, tokens) arrivals, the first arrival holding the first token(s).

    That is the tokens that came after the first arrival over the time from the first arrival to the last; NaN
    with fewer than two arrivals.

    total_tokens: the tokens kept in all, when the output was cut inside the last arrival (a stop string or
    max_new_tokens keeps part of a round); the first arrival's tokens are taken out of it.
    """
    if not arrivals:
        return math.nan
    if total_tokens is None:
        total_tokens = sum(tokens for _, tokens in arrivals)
    return tokens_per_second(max(0, total_tokens - arrivals[0][1]), arrivals[-1][0] - arrivals[0][0])


def mib(num_bytes: float) -> float:
    """Bytes in MiB (2**20 bytes)."""
    return num_bytes / MIB


def percentile(values: list[float], q: float) -> float:
    """Return the q-th percentile (0..100) by linear interpolation; NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100.0
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def token_gaps(arrivals: list[tuple[float, int]]) -> list[float]:
    """
    Per-token inter-token latencies from (time, tokens) arrivals, the first arrival being the first token.

    Example: arrivals [(0.0, 1), (0.3, 3)] give [0.1, 0.1, 0.1].
    """
    gaps: list[float] = []
    for (earlier, _), (later, tokens) in zip(arrivals, arrivals[1:], strict=False):
        gaps += [(later - earlier) / tokens] * tokens if tokens else []
    return gaps


def expected_tokens(acceptance: list[float], k: int) -> float:
    """
    Return the tokens a round with k drafts emits, bonus token included: 1 + sum_{j<=k} prod_{i<=j} acceptance[i].

    acceptance[i] is the chance that draft i+1 is accepted after all earlier ones were; with the same alpha
    everywhere this is Leviathan's (1 - alpha^(k+1)) / (1 - alpha), see iid_expected_tokens.
    """
    total, survive = 1.0, 1.0
    for rate in acceptance[:k]:
        survive *= rate
        total += survive
    return total


def iid_expected_tokens(alpha: float, k: float) -> float:
    """Leviathan's closed form of expected_tokens at i.i.d. acceptance alpha; k may be a mean (fractional)."""
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def _read_kib(path: str, keys: tuple[str, ...]) -> dict[str, int]:
    values = {}
    try:
        with open(path) as file:
            for line in file:
                name, _, rest = line.partition(':')
                if name in keys:
                    values[name] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    return values


def read_process_memory() -> dict[str, int]:
    """Bytes: VmRSS and VmHWM of this process, MemAvailable and MemTotal of the system (unified on Jetson)."""
    memory = _read_kib('/proc/self/status', ('VmRSS', 'VmHWM'))
    memory.update(_read_kib('/proc/meminfo', ('MemAvailable', 'MemTotal')))
    return memory


def process_rss_bytes() -> int:
    """Bytes of this process resident now (VmRSS; 0 where /proc is not there)."""
    return read_process_memory().get('VmRSS', 0)


def process_peak_rss_bytes() -> int:
    """Process resident-set high-water mark since the process started (VmHWM, else getrusage)."""
    peak = read_process_memory().get('VmHWM')
    return peak if peak is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@dataclass
class RoundTally:
    """Counters of one generation, turned into GenerationStats at the end."""

    target_passes: int = 0
    rounds: int = 0                 # decode rounds (after prefill)
    paused_rounds: int = 0          # rounds the profit gate ran plain
    drafted: int = 0
    accepted: int = 0
    drafted_at: list[int] = field(default_factory=list)    # [K] rounds that drafted position i
    accepted_at: list[int] = field(default_factory=list)   # [K] rounds that accepted position i
    by_draft_length: list[int] = field(default_factory=lambda: [0])  # [K + 1] rounds that drafted k tokens
    by_drafter: dict[str, int] = field(default_factory=dict)  # rounds by the drafter that drafted ('none': nothing)
    arrivals: list[tuple[float, int]] = field(default_factory=list)  # (time, tokens) from the first token on
    image_seconds: float = 0.0      # the vision tower on the goal's images, before the target's prefill
    cached_prompt_tokens: int = 0   # prompt tokens the prefix cache held (not prefilled)

    def add_prefill(self, first_token_time: float) -> None:
        self.target_passes += 1
        self.arrivals.append((first_token_time, 1))

    def add_round(self, num_drafted: int, num_accepted: int, emitted_time: float, drafter: str = 'none') -> None:
        """Count a decode round: num_accepted of num_drafted drafts (by drafter) kept, emitted at emitted_time."""
        self.rounds += 1
        name = drafter if num_drafted else 'none'
        self.by_drafter[name] = self.by_drafter.get(name, 0) + 1
        self.target_passes += 1
        self.drafted += num_drafted
        self.accepted += num_accepted
        self.arrivals.append((emitted_time, num_accepted + 1))
        while len(self.by_draft_length) <= num_drafted:
            self.by_draft_length.append(0)
        self.by_draft_length[num_drafted] += 1
        while len(self.drafted_at) < num_drafted:
            self.drafted_at.append(0)
            self.accepted_at.append(0)
        for position in range(num_drafted):
            self.drafted_at[position] += 1
            self.accepted_at[position] += position < num_accepted


def generation_stats(tally: RoundTally, prompt_tokens: int, new_tokens: int, started: float, finished: float,
                     drafter: str, draft_cost_ratio: float) -> GenerationStats:
    """GenerationStats of a finished generation (memory fields are filled by the caller)."""
    first_token_time = tally.arrivals[0][0] if tally.arrivals else math.nan  # NaN: cancelled before its prefill
    gaps = token_gaps(tally.arrivals)
    return GenerationStats(
        prompt_tokens=prompt_tokens, new_tokens=new_tokens, target_passes=tally.target_passes,
        drafted_tokens=tally.drafted, accepted_tokens=tally.accepted,
        tau=tau(new_tokens, tally.target_passes),
        acceptance_rate=acceptance_rate(tally.accepted, tally.drafted),
        per_position_acceptance=[a / d for a, d in zip(tally.accepted_at, tally.drafted_at, strict=True)],
        mean_num_draft_tokens=tally.drafted / tally.rounds if tally.rounds else 0.0,
        rounds_by_draft_length=list(tally.by_draft_length), rounds_by_drafter=dict(tally.by_drafter),
        draft_cost_ratio=draft_cost_ratio, drafter=drafter, paused_rounds=tally.paused_rounds,
        time_to_first_token=first_token_time - started,
        inter_token_latency_p50=percentile(gaps, 50), inter_token_latency_p95=percentile(gaps, 95),
        tokens_per_second=decode_tokens_per_second(tally.arrivals, new_tokens),
        wall_time=finished - started, process_peak_rss_bytes=process_peak_rss_bytes(),
        image_prefill_ms=tally.image_seconds * 1000.0, cached_prompt_tokens=tally.cached_prompt_tokens)


def format_stats(stats) -> str:
    """Three lines about a GenerationStats (the engine's dataclass or the gemma_spec_msgs message); NaN shows '-'."""
    figure = format_figure
    return ('tokens {} (prompt {})  tau {}  acceptance {}  drafter {}  K {:.1f}  c {:.3f}\n'
            'ttft {} s  itl p50 {} s  p95 {} s  decode {} tok/s  wall {:.2f} s  '
            'process peak RSS {:.0f} MiB\ndecode steps: {}').format(
        stats.new_tokens, stats.prompt_tokens, figure(stats.tau, '{:.2f}'), figure(stats.acceptance_rate, '{:.2f}'),
        stats.drafter or '-', stats.mean_num_draft_tokens, stats.draft_cost_ratio,
        figure(stats.time_to_first_token), figure(stats.inter_token_latency_p50, '{:.4f}'),
        figure(stats.inter_token_latency_p95, '{:.4f}'), figure(stats.tokens_per_second, '{:.1f}'), stats.wall_time,
        mib(stats.process_peak_rss_bytes), stats.decode_path or '-') + (
        '  image prefill {:.1f} ms'.format(stats.image_prefill_ms) if is_known(stats.image_prefill_ms) and
        stats.image_prefill_ms > 0 else '')
