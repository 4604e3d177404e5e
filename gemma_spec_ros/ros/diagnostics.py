"""
/diagnostics of the node with diagnostic_updater: its tasks as pure functions of a snapshot, testable without spinning.

The node builds a ``diagnostic_updater.Updater`` (period from the parameter ``diagnostic_updater.period``), sets
``diagnostics.hardware_id`` and adds the tasks 'engine', 'generation', 'memory' (the fill_* functions below) and
:class:`PeriodStatus`; the updater prefixes each status name with the node name ('gemma_spec: engine').

Every figure comes from gemma_spec_ros.engine.stats, which defines it; a figure without data (tau and acceptance
before a goal speculated, percentiles of an empty window) is NaN there and shows as '-' here.
"""

import math
import threading
from collections import Counter, deque

from diagnostic_msgs.msg import DiagnosticStatus
from diagnostic_updater import FrequencyStatus, FrequencyStatusParam, Updater  # noqa: F401 (Updater: the node's)

from gemma_spec_ros.engine.stats import (
    acceptance_rate,
    format_figure,
    is_known,
    mib,
    percentile,
    read_process_memory,
    tau,
    token_gaps,
    tokens_per_second,
)
from gemma_spec_ros.engine.types import WarningKind

OK = DiagnosticStatus.OK
WARN = DiagnosticStatus.WARN
ERROR = DiagnosticStatus.ERROR
STALE = DiagnosticStatus.STALE

PERIOD_PARAMETER = 'diagnostic_updater.period'  # declared by diagnostic_updater.Updater
PERIOD_TOLERANCE = 0.5  # PeriodStatus: WARN outside [0.5, 1.5] x the configured rate
PERIOD_WINDOW = 5       # PeriodStatus: updates the measured rate is averaged over


class PeriodStatus(FrequencyStatus):
    """
    diagnostic_updater's FrequencyStatus of the updater's own runs ('diagnostics period').

    Each /diagnostics update ticks it, so it measures the rate at which the node's executor actually runs the
    updater timer: WARN ('Frequency too low.') when /diagnostics come out slower than 1 / diagnostic_updater.period
    (a starved executor), with FrequencyStatus's keys 'Actual frequency (Hz)', 'Target frequency (Hz)', ...
    """

    def __init__(self, period):
        if period <= 0:
            raise ValueError('{} must be > 0, got {}'.format(PERIOD_PARAMETER, period))
        rate = 1.0 / float(period)
        super().__init__(FrequencyStatusParam({'min': rate, 'max': rate}, PERIOD_TOLERANCE, PERIOD_WINDOW),
                         'diagnostics period')

    def run(self, stat):
        self.tick()
        return super().run(stat)


# ---- the node's figures and tasks (pure functions of a snapshot, testable without spinning) ----

class GenerationMetrics:
    """Goal counts and a rolling window of per-goal statistics; thread-safe."""

    # aborted: invalid goals, engine errors, preemption and shutdown; busy, timed out and orphaned are aborted too
    OUTCOMES = ('succeeded', 'aborted', 'cancelled', 'busy', 'timed out', 'orphaned')

    def __init__(self, window=32):
        self._lock = threading.Lock()
        self._window = deque(maxlen=int(window))
        self._counts = dict.fromkeys(self.OUTCOMES, 0)
        self._drafter_fallbacks = 0
        self._last_warning = ''

    def resize(self, window):
        with self._lock:
            self._window = deque(self._window, maxlen=int(window))

    def count(self, outcome):
        with self._lock:
            self._counts[outcome] += 1

    def record(self, outcome, result=None, feedback_times=(), accepted_at=None):
        """
        Count a finished goal; keep its statistics when it generated tokens.

        feedback_times: (monotonic time, tokens) for the start of generation and each feedback message;
        a round of n tokens that arrived g seconds after the previous one adds n gaps of g / n.
        accepted_at: monotonic time the goal was accepted; queue wait and time to first token are measured from it
        (else time to first token is the engine's, from the start of generation).
        Unknown figures (NaN or -1, from a server backend) stay out of the window's figures, and goals that ran
        plain decoding (drafter none) stay out of its tau: their tau of 1 would hide what speculation achieves.
        """
        gaps = token_gaps(feedback_times[1:])
        with self._lock:
            self._counts[outcome] += 1
            if result is None:
                return
            if result.warnings:
                self._last_warning = result.warnings[-1]
                self._drafter_fallbacks += sum(getattr(warning, 'kind', None) is WarningKind.DRAFTER_FALLBACK
                                               for warning in result.warnings)
            stats = result.stats
            if stats.new_tokens > 0:
                from_acceptance = accepted_at is not None and len(feedback_times) > 1
                tau_known = stats.drafter != 'none' and is_known(stats.tau) and is_known(stats.target_passes)
                acceptance_known = is_known(stats.drafted_tokens) and is_known(stats.accepted_tokens)
                ttft = feedback_times[1][0] - accepted_at if from_acceptance else stats.time_to_first_token
                rate_known = is_known(stats.tokens_per_second) and stats.tokens_per_second > 0
                decode_tokens = max(0, stats.new_tokens - 1) if rate_known else 0
                self._window.append({
                    'tokens': stats.new_tokens if tau_known else 0,
                    'target_passes': stats.target_passes if tau_known else 0,
                    'drafted': stats.drafted_tokens if acceptance_known else 0,
                    'accepted': stats.accepted_tokens if acceptance_known else 0,
                    'ttft': ttft,   # NaN when unknown: left out of the percentiles
                    'queue_wait': feedback_times[0][0] - accepted_at if from_acceptance else math.nan,
                    # the goal's decode seconds back from its rate, so that the window pools tokens and seconds
                    'decode_tokens': decode_tokens,
                    'decode_time': decode_tokens / stats.tokens_per_second if rate_known else 0.0,
                    # the vision tower's share of the prefill, apart from the text; NaN for a goal without images
                    'image_prefill_ms': stats.image_prefill_ms if stats.image_prefill_ms > 0 else math.nan,
                    'gaps': gaps,
                    # decode rounds by the drafter that drafted them (an auto goal's several; 'none': plain rounds)
                    'rounds_by_drafter': dict(stats.rounds_by_drafter)})

    def snapshot(self) -> dict:
        with self._lock:
            window = list(self._window)
            figures = dict(self._counts, drafter_fallbacks=self._drafter_fallbacks,
                        last_warning=self._last_warning, goals_in_window=len(window))
        drafted = sum(g['drafted'] for g in window)
        decode_time = sum(g['decode_time'] for g in window)
        gaps = [gap for g in window for gap in g['gaps']]
        ttfts = [g['ttft'] for g in window if is_known(g['ttft'])]
        waits = [g['queue_wait'] for g in window if is_known(g['queue_wait'])]
        image_prefills = [g['image_prefill_ms'] for g in window if is_known(g['image_prefill_ms'])]
        figures.update(
            tau=tau([g['tokens'] for g in window], [g['target_passes'] for g in window]),
            acceptance_rate=acceptance_rate(sum(g['accepted'] for g in window), drafted),
            tokens_per_second=tokens_per_second(sum(g['decode_tokens'] for g in window), decode_time),
            ttft_p50=percentile(ttfts, 50), ttft_p95=percentile(ttfts, 95),
            queue_wait_p50=percentile(waits, 50), queue_wait_p95=percentile(waits, 95),
            itl_p50=percentile(gaps, 50), itl_p95=percentile(gaps, 95),
            image_prefill_ms_p50=percentile(image_prefills, 50), image_prefill_ms_p95=percentile(image_prefills, 95),
            image_goals_in_window=len(image_prefills),
            rounds_by_drafter=sum((Counter(g['rounds_by_drafter']) for g in window), Counter()))
        return figures


def _figure(value, digits=3) -> str:
    """Show a figure as /diagnostics does: '-' when undefined (NaN: no data yet, or unknown to a server backend)."""
    return format_figure(value, '{{:.{}f}}'.format(digits))


def fill_server_status(stat, status, figures):
    """Fill the engine task of a server backend (VllmStatus): ERROR with the URL while the server is unreachable."""
    if not status.reachable:
        stat.summary(ERROR, status.error or 'vLLM server at {} is unreachable'.format(status.url))
        stat.add('url', status.url)
        return stat
    stat.summary(OK, 'ready, vLLM server {} serving {}{}'.format(
        status.url, status.model, ', speculating ({})'.format(status.drafter) if status.speculating else ''))
    for key, value in (
            ('url', status.url), ('model', status.model), ('drafter', status.drafter or '-'),
            ('speculation', 'on' if status.speculating else 'off'), ('K', status.num_draft_tokens),
            ('requests running', status.requests_running), ('requests waiting', status.requests_waiting),
            ('KV-cache usage', _figure(status.kv_cache_usage)),
            ('prefix cache hit rate (prompt tokens)', _figure(status.prefix_cache_hit_rate)),
            ('prefix cache tokens reused', status.prefix_cache_tokens_reused),
            ('requests in flight (this node)', status.requests_in_flight),
            ('tau (window)', _figure(figures['tau'])),
            ('tau (lifetime)', _figure(status.tau_lifetime)),
            ('acceptance rate (window)', _figure(figures['acceptance_rate'])),
            ('acceptance rate (lifetime)', _figure(status.acceptance_rate_lifetime))):
        stat.add(key, str(value))
    if figures['last_warning']:
        stat.add('last warning', str(figures['last_warning']))
    return stat


def fill_engine_status(stat, state, error, status, metrics, loading_seconds=0.0, progress=''):
    """
    Fill the engine task: ERROR when the models or a drafter's model failed to load, OK while serving.

    progress: the latest loading step (a client waits while it changes: GenerateClient.wait_until_ready).

    A disabled drafter is ERROR although the node serves without it (an operator must fix the model); speculation
    paused by the profit gate is normal operation and stays OK.
    """
    stat.add('state', str(state))
    if state == 'failed':
        stat.summary(ERROR, error or 'models not loaded')
        return stat
    if state == 'loading':
        stat.summary(WARN, 'loading models ({:.0f} s){}'.format(loading_seconds, ': ' + progress if progress else ''))
        return stat
    if state in ('unconfigured', 'inactive', 'shutdown') or status is None:
        stat.summary(WARN, error or 'not serving: the node is {}'.format(state))
        return stat
    figures = metrics.snapshot()
    if status.backend != 'local':
        return fill_server_status(stat, status, figures)
    disabled = {d.name: d for d in status.disabled_drafters}
    if status.drafter == 'none':
        speculation = 'off'
        stat.summary(OK, 'ready, plain decoding')
    elif status.drafter in disabled:
        speculation = 'off (drafter disabled)'
        stat.summary(OK, 'ready, plain decoding')
    elif status.speculating:
        speculation = 'on'
        stat.summary(OK, 'ready, speculating with {} (K={})'.format(status.drafter, status.num_draft_tokens))
    else:
        speculation = 'paused'
        stat.summary(OK, 'ready; speculation paused by the profit gate: drafter {} does not beat plain decoding '
                     '(break-even tau {:.2f})'.format(status.drafter, status.break_even_tau))
    for drafter in disabled.values():
        stat.mergeSummary(ERROR, '{}; goals asking for it run plain decoding'.format(drafter.describe()))
    warmup = status.warmup
    if not warmup.done:
        stat.mergeSummary(OK, 'warming up: {} of {} graphs ready, serving {} steps meanwhile'.format(
            warmup.graphs_ready, warmup.graphs_total, 'eager' if not warmup.graphs_ready else 'eager and compiled'))
    for graph in warmup.failed:
        stat.mergeSummary(WARN, 'graph {} failed to build: its steps run eager'.format(graph))
    for key, value in (
            ('target model', status.target_id), ('drafter', status.drafter),
            ('drafter model', status.drafter_id or '-'), ('device', status.device), ('dtype', status.dtype),
            ('decode steps', status.compile_mode), ('warm-up', warmup.policy), ('serving', warmup.serving),
            ('graphs ready', '{} of {}'.format(warmup.graphs_ready, warmup.graphs_total)),
            ('warm-up done', str(warmup.done).lower()),
            ('warm-up s', '{:.1f}'.format(warmup.seconds)),  # once done: the time to full speed
            ('weights MiB', '{:.1f}'.format(mib(status.weights_bytes))),
            ('KV cache MiB', '{:.1f}'.format(mib(status.kv_cache_bytes))),
            ('speculation', speculation), ('K', status.num_draft_tokens),
            ('draft cost ratio c', '{:.3f}'.format(status.draft_cost_ratio)),
            ('break-even tau', '{:.3f}'.format(status.break_even_tau)),
            ('tau (window)', _figure(figures['tau'])),
            ('tau (lifetime)', _figure(status.tau_lifetime)),
            ('acceptance rate (window)', _figure(figures['acceptance_rate'])),
            ('acceptance rate (lifetime)', _figure(status.acceptance_rate_lifetime)),
            ('drafter fallbacks', figures['drafter_fallbacks']),
            ('rounds by drafter (window)', ', '.join('{} {}'.format(name, rounds) for name, rounds in sorted(
                figures['rounds_by_drafter'].items())) or '-')):
        stat.add(key, str(value))
    if status.kv_cache_slot_bytes:
        stat.add('KV cache MiB per batch slot (target)', '{:.1f}'.format(mib(status.kv_cache_slot_bytes)))
        stat.add('batch slots', str(status.batch_slots))
        stat.add('KV cache MiB of the batch slots (target)', '{:.1f}'.format(
            mib(status.batch_slots * status.kv_cache_slot_bytes)))
    prefix = getattr(status, 'prefix_cache', None)  # the vLLM backend's status has none
    if prefix is not None:
        stat.add('prefix cache hit rate', _figure(prefix.hit_rate))
        stat.add('prefix cache tokens reused', str(prefix.tokens_reused))
        stat.add('prefix cache MiB', '{:.1f} of {:.1f}'.format(mib(prefix.nbytes), mib(prefix.budget_bytes)))
    for goal in status.batch_goals:
        stat.add('batch slot {}'.format(goal.slot), describe_batch_goal(goal))
    for drafter in disabled.values():
        stat.add('disabled drafter ' + drafter.name, '{} {}: {}'.format(drafter.role, drafter.path, drafter.cause))
    if figures['last_warning']:
        stat.add('last warning', str(figures['last_warning']))
    return stat


def describe_batch_goal(goal) -> str:
    """One goal of the batch (a BatchGoalStatus) as /diagnostics shows it: its drafter, K, τ, tokens and slot wait."""
    if goal.drafter == 'none':
        drafting = 'plain decoding'
    elif goal.speculating:
        drafting = '{}, K {}'.format(goal.drafter, goal.num_draft_tokens)
    else:
        drafting = '{}, paused by its profit gate'.format(goal.drafter)
    return '{}, tau {}, {} tokens, waited {:.3f} s for its slot'.format(drafting, _figure(goal.tau, 2),
                                                                        goal.new_tokens, goal.slot_wait)


def describe_images(capabilities) -> str:
    """Whether goals may carry images (the backend's Capabilities): 'accepted', or 'refused: ' and why."""
    return 'accepted' if capabilities.images else 'refused: {}'.format(capabilities.image_refusal)


def fill_generation_status(stat, metrics, queued, running, ttft_budget=0.0, inter_token_latency_budget=0.0,
                           queue_limit=None, max_running=1):
    """
    Fill the generation task: throughput, latency percentiles, queue, batch occupancy and counts; WARN over a budget.

    running: the goals running now, of max_running that may run at once (batch occupancy; 'running' says whether
    any does). Time to first token is measured from the goal's acceptance, queue wait included, as the planner waits;
    the image prefill (the vision tower on a goal's images, part of it) shows apart, over the goals with images.
    """
    figures = metrics.snapshot()
    limit = '' if queue_limit is None else ' of {}'.format(queue_limit)
    batch = ' {} of {} goals'.format(int(running), max_running) if max_running > 1 else ''
    stat.summary(OK, 'generating{}, {}{} waiting'.format(batch, queued, limit) if running else 'idle')
    if ttft_budget > 0 and figures['goals_in_window'] and figures['ttft_p95'] > ttft_budget:
        stat.mergeSummary(WARN, 'time to first token p95 {:.3f} s (queue wait p95 {:.3f} s) over budget {:.3f} s'
                          .format(figures['ttft_p95'], figures['queue_wait_p95'], ttft_budget))
    if inter_token_latency_budget > 0 and figures['itl_p95'] > inter_token_latency_budget:
        stat.mergeSummary(WARN, 'inter-token latency p95 {:.3f} s over budget {:.3f} s'.format(
            figures['itl_p95'], inter_token_latency_budget))
    for key, value in (
            ('queue depth', queued), ('queue limit', '-' if queue_limit is None else queue_limit),
            ('running', bool(running)),
            ('batch occupancy', '{} of {}'.format(int(running), max_running)),
            ('decode tokens/s', _figure(figures['tokens_per_second'], 2)),
            ('queue wait p50 (s)', _figure(figures['queue_wait_p50'], 4)),
            ('queue wait p95 (s)', _figure(figures['queue_wait_p95'], 4)),
            ('time to first token p50 (s)', _figure(figures['ttft_p50'], 4)),
            ('time to first token p95 (s)', _figure(figures['ttft_p95'], 4)),
            ('inter-token latency p50 (s)', _figure(figures['itl_p50'], 4)),
            ('inter-token latency p95 (s)', _figure(figures['itl_p95'], 4)),
            ('image prefill p50 (ms)', _figure(figures['image_prefill_ms_p50'], 1)),
            ('image prefill p95 (ms)', _figure(figures['image_prefill_ms_p95'], 1)),
            ('goals with images in window', figures['image_goals_in_window']),
            ('goals in window', figures['goals_in_window'])):
        stat.add(key, str(value))
    for outcome in GenerationMetrics.OUTCOMES:
        stat.add('goals ' + outcome, str(figures[outcome]))
    return stat


def read_memory(device='cpu') -> dict:
    """Process RSS, system MemAvailable (/proc; unified memory on Jetson) and CUDA memory on CUDA, bytes."""
    memory = read_process_memory()
    if str(device).startswith('cuda'):
        import torch
        if torch.cuda.is_available():
            memory['cuda_allocated'] = torch.cuda.memory_allocated()
            memory['cuda_reserved'] = torch.cuda.memory_reserved()
    return memory


def fill_memory_status(stat, memory, rss_budget_mb=0.0, min_mem_available_mb=0.0,
                       cuda_reserved_budget_mb=0.0):
    """Fill the memory task: WARN over the RSS or CUDA budget, or when MemAvailable drops below its floor."""
    stat.summary(OK, 'memory within budget')
    rss = mib(memory.get('VmRSS', 0))
    available = mib(memory.get('MemAvailable', 0))
    if rss_budget_mb > 0 and rss > rss_budget_mb:
        stat.mergeSummary(WARN, 'process RSS {:.0f} MiB over budget {:.0f} MiB'.format(rss, rss_budget_mb))
    if min_mem_available_mb > 0 and 'MemAvailable' in memory and available < min_mem_available_mb:
        stat.mergeSummary(WARN, 'MemAvailable {:.0f} MiB below {:.0f} MiB'.format(
            available, min_mem_available_mb))
    stat.add('process RSS (MiB)', '{:.1f}'.format(rss))
    stat.add('process peak RSS (MiB)', '{:.1f}'.format(mib(memory.get('VmHWM', 0))))
    stat.add('MemAvailable (MiB)', '{:.1f}'.format(available))
    stat.add('MemTotal (MiB)', '{:.1f}'.format(mib(memory.get('MemTotal', 0))))
    if 'cuda_reserved' in memory:
        reserved = mib(memory['cuda_reserved'])
        stat.add('CUDA allocated (MiB)', '{:.1f}'.format(mib(memory['cuda_allocated'])))
        stat.add('CUDA reserved (MiB)', '{:.1f}'.format(reserved))
        if cuda_reserved_budget_mb > 0 and reserved > cuda_reserved_budget_mb:
            stat.mergeSummary(WARN, 'CUDA reserved {:.0f} MiB over budget {:.0f} MiB'.format(
                reserved, cuda_reserved_budget_mb))
    return stat
