"""
The vLLM server's Prometheus counters, and the speculation figures of a window between two scrapes.

    target passes = generation tokens - accepted tokens     (each pass emits its accepted drafts + 1 token)
    tau           = (generation tokens - R) / (target passes - R), R the requests that ended in the window
                    (stats.tau: tokens per decode pass, each request's prefill pass and first token left out)
    acceptance    = accepted tokens / draft tokens          (stats.acceptance_rate: NaN without drafts)

The counters are server-wide: when another request ran on the server meanwhile, the window covers it too.

Unknown values (the server cannot supply them): float fields are NaN (``UNKNOWN_FLOAT``), int fields -1
(``UNKNOWN_INT``), the NaN that engine.stats uses for no data. A plain server (no speculative config, no
spec_decode counters) has tau 1 exactly.
"""

import math
import re
from dataclasses import dataclass, field, fields

from ..stats import acceptance_rate, tau
from ..types import GenerationStats, GenerationWarning, WarningKind

UNKNOWN_FLOAT = math.nan
UNKNOWN_INT = -1
SERVER_WIDE_WARNING = GenerationWarning(WarningKind.SERVER_WIDE_FIGURES, 'tau and acceptance are server-wide: other '
                                        'requests ran on the server during this one')
_METRIC_LINE = re.compile(r'^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+(\S+)')
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


@dataclass
class ServerCounters:
    """One scrape of the server's Prometheus metrics for the served model (summed over engines)."""

    generation_tokens: float = 0.0
    drafts: float | None = None                 # None: no spec_decode counters, the server does not speculate
    draft_tokens: float = 0.0
    accepted_tokens: float = 0.0
    accepted_per_position: list[float] = field(default_factory=list)   # [K] accepted at draft position i
    aborted_requests: float = 0.0
    finished_requests: float = 0.0              # every finished_reason, abort included
    requests_running: float = 0.0               # gauge
    requests_waiting: float = 0.0               # gauge
    kv_cache_usage: float = UNKNOWN_FLOAT       # gauge, 0..1
    prefix_cache_queries: float = 0.0           # prompt tokens looked up in the server's prefix cache
    prefix_cache_hits: float = 0.0              # ... and found there

    @property
    def busy(self) -> bool:
        return self.requests_running + self.requests_waiting > 0


@dataclass
class SpeculationStats:
    """Speculation figures over a window of server counters (see the module docstring)."""

    target_passes: float
    drafted_tokens: float
    accepted_tokens: float
    tau: float
    acceptance_rate: float
    per_position_acceptance: list[float]        # [K] accepted at position i / drafts
    mean_num_draft_tokens: float


def speculation_stats(before: ServerCounters | None, after: ServerCounters) -> SpeculationStats:
    """Speculation figures between two scrapes (before None: since the server started)."""
    base = before or ServerCounters(drafts=0.0 if after.drafts is not None else None)
    generated = after.generation_tokens - base.generation_tokens
    if after.drafts is None:  # plain decoding: one token per target pass
        return SpeculationStats(generated, 0.0, 0.0, tau(generated, generated), acceptance_rate(0.0, 0.0), [], 0.0)
    drafts = after.drafts - (base.drafts or 0.0)
    drafted = after.draft_tokens - base.draft_tokens
    accepted = after.accepted_tokens - base.accepted_tokens
    earlier = base.accepted_per_position + [0.0] * (len(after.accepted_per_position) -
                                                     len(base.accepted_per_position))
    passes = generated - accepted
    ended = after.finished_requests - base.finished_requests
    return SpeculationStats(
        target_passes=passes, drafted_tokens=drafted, accepted_tokens=accepted,
        tau=tau(generated, passes, ended), acceptance_rate=acceptance_rate(accepted, drafted),
        per_position_acceptance=[acceptance_rate(now - then, drafts) for now, then in
                                 zip(after.accepted_per_position, earlier, strict=True)] if drafts > 0 else [],
        mean_num_draft_tokens=drafted / drafts if drafts > 0 else 0.0)


def fill_speculation(stats: GenerationStats, before: ServerCounters | None, after: ServerCounters | None,
                     new_tokens: int, overlapped: bool) -> bool:
    """
    Fill a request's tau, acceptance and counts from the scrapes around it; whether they are server-wide.

    Plain decoding is exact per request whatever else ran. With speculation, counts are the request's own only
    when nothing overlapped it and the window's tokens are its tokens; else they stay unknown and the rates cover
    every request of the window (server-wide).
    """
    if after is None or after.drafts is None:
        stats.tau, stats.acceptance_rate = tau(new_tokens, new_tokens), acceptance_rate(0, 0)
        stats.mean_num_draft_tokens = 0.0
        stats.target_passes, stats.drafted_tokens, stats.accepted_tokens = new_tokens, 0, 0
        stats.per_position_acceptance = []
        return False
    window = speculation_stats(before, after)
    alone = not overlapped and window.target_passes + window.accepted_tokens == new_tokens
    stats.tau, stats.acceptance_rate = window.tau, window.acceptance_rate
    stats.per_position_acceptance = window.per_position_acceptance
    stats.mean_num_draft_tokens = window.mean_num_draft_tokens
    if alone:  # the request's own counts: its τ leaves its own prefill pass out, whatever the counters' timing
        stats.tau = tau(new_tokens, window.target_passes)
        stats.target_passes = int(window.target_passes)
        stats.drafted_tokens, stats.accepted_tokens = int(window.drafted_tokens), int(window.accepted_tokens)
    return not alone


def metric_samples(text: str, model: str = ''):
    """Yield (name without 'vllm:', labels, value) of the vllm: samples in Prometheus text, for one model if given."""
    for line in text.splitlines():
        match = _METRIC_LINE.match(line)
        if not match or not match.group(1).startswith('vllm:'):
            continue
        labels = dict(_LABEL.findall(match.group(2) or ''))
        if model and labels.get('model_name', model) != model:
            continue
        yield match.group(1)[len('vllm:'):], labels, float(match.group(3))


def parse_metrics(text: str, model: str = '') -> ServerCounters:
    """ServerCounters from Prometheus text; samples labelled with another model_name are skipped."""
    counters = ServerCounters()
    per_position: dict[int, float] = {}
    kv_usage: list[float] = []
    for name, labels, value in metric_samples(text, model):
        if name == 'generation_tokens_total':
            counters.generation_tokens += value
        elif name == 'spec_decode_num_drafts_total':
            counters.drafts = (counters.drafts or 0.0) + value
        elif name == 'spec_decode_num_draft_tokens_total':
            counters.draft_tokens += value
        elif name == 'spec_decode_num_accepted_tokens_total':
            counters.accepted_tokens += value
        elif name == 'spec_decode_num_accepted_tokens_per_pos_total':
            position = int(labels.get('position', 0))
            per_position[position] = per_position.get(position, 0.0) + value
        elif name == 'request_success_total':
            counters.finished_requests += value
            if labels.get('finished_reason') == 'abort':
                counters.aborted_requests += value
        elif name == 'num_requests_running':
            counters.requests_running += value
        elif name == 'num_requests_waiting':
            counters.requests_waiting += value
        elif name == 'prefix_cache_queries_total':
            counters.prefix_cache_queries += value
        elif name == 'prefix_cache_hits_total':
            counters.prefix_cache_hits += value
        elif name in ('kv_cache_usage_perc', 'gpu_cache_usage_perc'):
            kv_usage.append(value)
    counters.accepted_per_position = [per_position[p] for p in sorted(per_position)]
    if kv_usage:
        counters.kv_cache_usage = max(kv_usage)
    return counters

def unknown_stats() -> GenerationStats:
    """GenerationStats with every numeric field unknown (NaN or -1); the backend fills what it knows."""
    stats = GenerationStats()
    for item in fields(GenerationStats):
        value = getattr(stats, item.name)
        if isinstance(value, float):
            setattr(stats, item.name, UNKNOWN_FLOAT)
        elif isinstance(value, int) and not isinstance(value, bool):
            setattr(stats, item.name, UNKNOWN_INT)
    return stats
