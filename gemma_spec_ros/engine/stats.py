"""
One definition of each metric, used by the engine, /diagnostics, the tools and the benchmark. Imports no torch.

- tau: tokens emitted per target pass, bonus token included (plain decoding has tau = 1);
- inter-token latency: a round that emits n tokens g seconds after the previous one adds n gaps of g / n;
- percentiles: linear interpolation between order statistics;
- memory: process RSS and its high-water mark, and system MemAvailable, from /proc.
"""

import resource
from dataclasses import dataclass, field

from .types import GenerationStats

MIB = 1024.0 * 1024.0


def percentile(values: list[float], q: float) -> float:
    """Return the q-th percentile (0..100) by linear interpolation; 0.0 for no values."""
    if not values:
        return 0.0
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
    arrivals: list[tuple[float, int]] = field(default_factory=list)  # (time, tokens) from the first token on

    def add_prefill(self, first_token_time: float) -> None:
        self.target_passes += 1
        self.arrivals.append((first_token_time, 1))

    def add_round(self, num_drafted: int, num_accepted: int, emitted_time: float) -> None:
        self.rounds += 1
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
    first_token_time, last_token_time = tally.arrivals[0][0], tally.arrivals[-1][0]
    decode_time = last_token_time - first_token_time
    gaps = token_gaps(tally.arrivals)
    return GenerationStats(
        prompt_tokens=prompt_tokens, new_tokens=new_tokens, target_passes=tally.target_passes,
        drafted_tokens=tally.drafted, accepted_tokens=tally.accepted,
        tau=new_tokens / tally.target_passes,
        acceptance_rate=tally.accepted / tally.drafted if tally.drafted else 0.0,
        per_position_acceptance=[a / d for a, d in zip(tally.accepted_at, tally.drafted_at, strict=True)],
        mean_num_draft_tokens=tally.drafted / tally.rounds if tally.rounds else 0.0,
        rounds_by_draft_length=list(tally.by_draft_length),
        draft_cost_ratio=draft_cost_ratio, drafter=drafter, paused_rounds=tally.paused_rounds,
        time_to_first_token=first_token_time - started,
        inter_token_latency_p50=percentile(gaps, 50), inter_token_latency_p95=percentile(gaps, 95),
        tokens_per_second=(new_tokens - 1) / decode_time if decode_time > 0 else 0.0,
        wall_time=finished - started, process_peak_rss_bytes=process_peak_rss_bytes())


def format_stats(stats) -> str:
    """Three lines about a GenerationStats (the engine's dataclass or the gemma_spec_msgs message)."""
    return ('tokens {} (prompt {})  tau {:.2f}  acceptance {:.2f}  drafter {}  K {:.1f}  c {:.3f}\n'
            'ttft {:.3f} s  itl p50 {:.4f} s  p95 {:.4f} s  decode {:.1f} tok/s  wall {:.2f} s  '
            'process peak RSS {:.0f} MiB\ndecode steps: {}').format(
        stats.new_tokens, stats.prompt_tokens, stats.tau, stats.acceptance_rate, stats.drafter or '-',
        stats.mean_num_draft_tokens, stats.draft_cost_ratio, stats.time_to_first_token,
        stats.inter_token_latency_p50, stats.inter_token_latency_p95, stats.tokens_per_second, stats.wall_time,
        stats.process_peak_rss_bytes / MIB, stats.decode_path or '-')
