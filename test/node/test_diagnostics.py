"""The node's diagnostic tasks on diagnostic_updater's real DiagnosticStatusWrapper, then one spinning Updater."""

import os
import time
from types import SimpleNamespace

import pytest
from conftest import NO_DIAGNOSTIC_UPDATER

pytest.importorskip('diagnostic_updater', reason=NO_DIAGNOSTIC_UPDATER)

import rclpy
from diagnostic_msgs.msg import DiagnosticArray
from diagnostic_updater import DiagnosticStatusWrapper
from rclpy.executors import SingleThreadedExecutor
from rclpy.parameter import Parameter
from rclpy.serialization import deserialize_message, serialize_message

from gemma_spec_ros.engine.backends.vllm import SERVER_WIDE_WARNING, VllmStatus
from gemma_spec_ros.engine.backends.vllm_metrics import unknown_stats
from gemma_spec_ros.engine.types import (
    BatchGoalStatus,
    DisabledDrafter,
    EngineStatus,
    GenerationStats,
    GenerationWarning,
    WarningKind,
    structure_incomplete,
)
from gemma_spec_ros.ros import diagnostics
from gemma_spec_ros.ros.diagnostics import ERROR, OK, STALE, WARN, PeriodStatus, Updater
from gemma_spec_ros.tools.client import level_name

DOMAIN_ID = 11 + (os.getpid() + 53) % 80


def result(new_tokens=10, passes=5, drafted=8, accepted=5, ttft=0.1, tps=50.0, warnings=(), drafter='ngram'):
    stats = GenerationStats(new_tokens=new_tokens, target_passes=passes, drafted_tokens=drafted,
                            accepted_tokens=accepted, tau=new_tokens / passes, time_to_first_token=ttft,
                            tokens_per_second=tps, drafter=drafter)
    return SimpleNamespace(stats=stats, warnings=list(warnings))


def values(stat):
    return {kv.key: kv.value for kv in stat.values}


def test_the_clients_level_names():
    assert [level_name(level) for level in (OK, WARN, ERROR, STALE)] == ['OK', 'WARN', 'ERROR', 'STALE']
    assert level_name(1) == 'WARN'


def test_engine_task_levels():
    metrics = diagnostics.GenerationMetrics()
    failed = diagnostics.fill_engine_status(DiagnosticStatusWrapper(), 'failed', 'engine failed to load: x', None,
                                            metrics)
    assert failed.level == ERROR and 'engine failed to load' in failed.message
    loading = diagnostics.fill_engine_status(DiagnosticStatusWrapper(), 'loading', '', None, metrics, 3.0)
    assert loading.level == WARN and 'loading' in loading.message
    speculating = EngineStatus(target_id='t', drafter='mtp', drafter_id='a', num_draft_tokens=3,
                               draft_cost_ratio=0.1, break_even_tau=1.3, speculating=True, tau_lifetime=2.0)
    ok = diagnostics.fill_engine_status(DiagnosticStatusWrapper(), 'ready', '', speculating, metrics)
    assert ok.level == OK and values(ok)['speculation'] == 'on' and values(ok)['K'] == '3'
    assert values(ok)['tau (lifetime)'] == '2.000'
    paused = diagnostics.fill_engine_status(DiagnosticStatusWrapper(), 'ready', '',
                                            EngineStatus(drafter='mtp', speculating=False), metrics)
    assert paused.level == OK and 'paused by the profit gate' in paused.message   # normal operation
    assert values(paused)['speculation'] == 'paused'
    plain = diagnostics.fill_engine_status(DiagnosticStatusWrapper(), 'ready', '', EngineStatus(drafter='none'),
                                           metrics)
    assert plain.level == OK and values(plain)['speculation'] == 'off'


def test_engine_task_lists_each_goal_of_the_batch():
    goals = [BatchGoalStatus(0, 'mtp', 3, True, 2.5, 40, 0.0125), BatchGoalStatus(1, 'ngram', 0, False, 1.1, 12, 0.0),
             BatchGoalStatus(3, 'none', 0, False, float('nan'), 0, 1.5)]
    status = EngineStatus(drafter='mtp', speculating=True, kv_cache_slot_bytes=2 ** 20, batch_slots=4,
                          batch_goals=goals)
    stat = values(diagnostics.fill_engine_status(DiagnosticStatusWrapper(), 'ready', '', status,
                                                 diagnostics.GenerationMetrics()))
    assert stat['batch slot 0'] == 'mtp, K 3, tau 2.50, 40 tokens, waited 0.013 s for its slot'
    assert stat['batch slot 1'] == 'ngram, paused by its profit gate, tau 1.10, 12 tokens, waited 0.000 s for its slot'
    assert stat['batch slot 3'] == 'plain decoding, tau -, 0 tokens, waited 1.500 s for its slot'
    assert 'batch slot 2' not in stat and stat['KV cache MiB per batch slot (target)'] == '1.0'
    assert stat['batch slots'] == '4' and stat['KV cache MiB of the batch slots (target)'] == '4.0'


def test_disabled_drafter_is_an_error_naming_role_path_and_cause():
    broken = DisabledDrafter('mtp', 'MTP assistant', '/models/assistant', 'safetensors header: incomplete metadata')
    status = EngineStatus(drafter='mtp', disabled_drafters=[broken])
    stat = diagnostics.fill_engine_status(DiagnosticStatusWrapper(), 'ready', '', status,
                                          diagnostics.GenerationMetrics())
    assert stat.level == ERROR
    for part in ("drafter 'mtp' disabled", 'MTP assistant', '/models/assistant', 'incomplete metadata',
                 'run plain decoding'):
        assert part in stat.message, part
    assert values(stat)['speculation'] == 'off (drafter disabled)'
    assert values(stat)['disabled drafter mtp'] == 'MTP assistant /models/assistant: ' + broken.cause


def test_server_backend_status_error_with_the_url_else_its_figures():
    metrics = diagnostics.GenerationMetrics()
    url = 'http://gpu-server:8000'
    down = VllmStatus(url=url, error='vLLM server at {} is unreachable: refused'.format(url))
    stat = diagnostics.fill_engine_status(DiagnosticStatusWrapper(), 'ready', '', down, metrics)
    assert stat.level == ERROR and url in stat.message and values(stat)['url'] == url
    assert values(stat)['state'] == 'ready'   # the node serves on: goals end with the reason
    up = VllmStatus(url=url, reachable=True, model='gemma', drafter='ngram', speculating=True, num_draft_tokens=4,
                    requests_running=2, requests_waiting=1, kv_cache_usage=0.25, tau_lifetime=1.5)
    stat = diagnostics.fill_engine_status(DiagnosticStatusWrapper(), 'ready', '', up, metrics)
    assert stat.level == OK and url in stat.message and 'gemma' in stat.message
    assert (values(stat)['requests running'], values(stat)['requests waiting']) == ('2', '1')
    assert (values(stat)['KV-cache usage'], values(stat)['tau (lifetime)']) == ('0.250', '1.500')
    unknown = VllmStatus(url=url, reachable=True, model='gemma', drafter='none')   # NaN figures read '-'
    assert values(diagnostics.fill_engine_status(DiagnosticStatusWrapper(), 'ready', '', unknown, metrics))[
        'KV-cache usage'] == '-'


def test_unknown_server_figures_stay_out_of_the_window():
    metrics = diagnostics.GenerationMetrics()
    metrics.record('succeeded', result(new_tokens=10, passes=5, drafted=8, accepted=5))
    server_wide = unknown_stats()   # tau NaN, counts -1: another request overlapped on the server
    server_wide.new_tokens, server_wide.tokens_per_second = 12, 40.0
    metrics.record('succeeded', SimpleNamespace(stats=server_wide, warnings=[SERVER_WIDE_WARNING]),
                   [(0.0, 0), (0.2, 4), (0.3, 8)], accepted_at=0.0)
    snap = metrics.snapshot()
    assert snap['goals_in_window'] == 2 and snap['tau'] == pytest.approx(9 / 4)  # τ: tokens per decode pass
    assert snap['acceptance_rate'] == pytest.approx(5 / 8) and snap['ttft_p50'] == pytest.approx(0.15)
    assert snap['drafter_fallbacks'] == 0 and snap['last_warning'] == SERVER_WIDE_WARNING


def test_only_drafter_fallbacks_count_as_drafter_fallbacks():
    metrics = diagnostics.GenerationMetrics()
    dropped = GenerationWarning(WarningKind.DROPPED_TOOL_CALL, 'dropped a tool call the server parsed (x)')
    fallback = GenerationWarning(WarningKind.DRAFTER_FALLBACK, "drafter 'mtp' failed (RuntimeError: x)")
    metrics.record('succeeded', result(warnings=[structure_incomplete(8), dropped, SERVER_WIDE_WARNING]))
    assert metrics.snapshot()['drafter_fallbacks'] == 0
    metrics.record('succeeded', result(warnings=[fallback, structure_incomplete(8)]))
    snap = metrics.snapshot()
    assert snap['drafter_fallbacks'] == 1 and snap['last_warning'] == structure_incomplete(8)
    import copy
    import pickle
    for warning in (fallback, copy.deepcopy(fallback), pickle.loads(pickle.dumps(fallback))):
        assert isinstance(warning, str) and warning.kind is WarningKind.DRAFTER_FALLBACK
        assert warning == "drafter 'mtp' failed (RuntimeError: x)"


def test_plain_goals_stay_out_of_the_window_tau():
    metrics = diagnostics.GenerationMetrics()
    metrics.record('succeeded', result(new_tokens=12, passes=3, drafted=12, accepted=9, tps=60.0))
    metrics.record('succeeded', result(new_tokens=20, passes=20, drafted=0, accepted=0, tps=20.0, drafter='none'))
    snap = metrics.snapshot()
    assert snap['goals_in_window'] == 2 and snap['tau'] == pytest.approx(11 / 2)
    assert snap['acceptance_rate'] == pytest.approx(9 / 12)
    assert snap['tokens_per_second'] == pytest.approx((11 + 19) / (11 / 60.0 + 19 / 20.0))  # plain goals count here


def test_tau_and_acceptance_read_a_dash_until_a_goal_speculates():
    metrics = diagnostics.GenerationMetrics()
    metrics.record('succeeded', result(new_tokens=20, passes=20, drafted=0, accepted=0, drafter='none'))
    status = EngineStatus(drafter='mtp', speculating=True)  # a fresh engine: nothing speculated yet
    before = values(diagnostics.fill_engine_status(DiagnosticStatusWrapper(), 'ready', '', status, metrics))
    assert [before[key] for key in ('tau (window)', 'tau (lifetime)', 'acceptance rate (window)',
                                    'acceptance rate (lifetime)')] == ['-'] * 4
    metrics.record('succeeded', result(new_tokens=12, passes=3, drafted=12, accepted=9, drafter='mtp'))
    status.tau_lifetime, status.acceptance_rate_lifetime = 4.0, 0.75
    after = values(diagnostics.fill_engine_status(DiagnosticStatusWrapper(), 'ready', '', status, metrics))
    assert [after[key] for key in ('tau (window)', 'tau (lifetime)', 'acceptance rate (window)',
                                   'acceptance rate (lifetime)')] == ['5.500', '4.000', '0.750', '0.750']


def test_the_engine_task_counts_each_drafter_s_rounds_over_the_window():
    metrics = diagnostics.GenerationMetrics()
    status = EngineStatus(drafter='auto', speculating=True)
    empty = values(diagnostics.fill_engine_status(DiagnosticStatusWrapper(), 'ready', '', status, metrics))
    assert empty['rounds by drafter (window)'] == '-'
    auto = result(drafter='auto')
    auto.stats.rounds_by_drafter = {'ngram': 7, 'mtp': 3, 'none': 1}
    single = result(drafter='mtp')
    single.stats.rounds_by_drafter = {'mtp': 4}
    for goal in (auto, single):
        metrics.record('succeeded', goal)
    stat = values(diagnostics.fill_engine_status(DiagnosticStatusWrapper(), 'ready', '', status, metrics))
    assert stat['rounds by drafter (window)'] == 'mtp 7, ngram 7, none 1'


def test_generation_task_window_and_latency_budget():
    metrics = diagnostics.GenerationMetrics(window=2)
    metrics.record('succeeded', result(ttft=0.1), [(0.0, 0), (0.1, 1), (0.3, 2), (0.4, 1)])
    metrics.record('succeeded', result(ttft=0.3, new_tokens=20, passes=5))
    metrics.record('cancelled', result(ttft=0.2, new_tokens=10, passes=10))  # pushes the first out
    metrics.record('busy')
    snap = metrics.snapshot()
    assert snap['goals_in_window'] == 2 and snap['succeeded'] == 2 and snap['cancelled'] == 1
    assert snap['tau'] == pytest.approx((19 + 9) / (4 + 9)) and snap['acceptance_rate'] == pytest.approx(10 / 16)
    assert snap['ttft_p50'] == pytest.approx(0.25)
    ok = diagnostics.fill_generation_status(DiagnosticStatusWrapper(), metrics, 0, False, ttft_budget=1.0)
    assert ok.level == OK and ok.message == 'idle' and values(ok)['goals busy'] == '1'
    slow = diagnostics.fill_generation_status(DiagnosticStatusWrapper(), metrics, 2, True, ttft_budget=0.25)
    assert slow.level == WARN and 'time to first token p95' in slow.message
    busy = diagnostics.fill_generation_status(DiagnosticStatusWrapper(), metrics, 2, True, queue_limit=4)
    assert busy.message == 'generating, 2 of 4 waiting' and values(busy)['queue limit'] == '4'


def test_time_to_first_token_counts_the_queue_wait():
    metrics = diagnostics.GenerationMetrics()
    # accepted at 10.0, started after 2 s in the queue, first token 0.05 s later (engine ttft 0.05 s)
    metrics.record('succeeded', result(ttft=0.05), [(12.0, 0), (12.05, 1), (12.1, 1)], accepted_at=10.0)
    snap = metrics.snapshot()
    assert snap['queue_wait_p95'] == pytest.approx(2.0) and snap['ttft_p95'] == pytest.approx(2.05)
    stat = diagnostics.fill_generation_status(DiagnosticStatusWrapper(), metrics, 0, False, ttft_budget=1.0)
    assert stat.level == WARN and 'queue wait p95 2.000 s' in stat.message
    assert values(stat)['queue wait p50 (s)'] == '2.0000' and values(stat)['time to first token p95 (s)'] == '2.0500'


def test_inter_token_gaps_from_feedback_times():
    metrics = diagnostics.GenerationMetrics()
    # start, first round (ttft, excluded), then 2 tokens after 0.2 s and 1 token after 0.1 s
    metrics.record('succeeded', result(), [(0.0, 0), (0.1, 1), (0.3, 2), (0.4, 1)])
    snap = metrics.snapshot()
    assert snap['itl_p50'] == pytest.approx(0.1) and snap['itl_p95'] == pytest.approx(0.1)
    stat = diagnostics.fill_generation_status(DiagnosticStatusWrapper(), metrics, 0, False,
                                              inter_token_latency_budget=0.05)
    assert stat.level == WARN and 'inter-token latency p95' in stat.message


def test_memory_task_budgets():
    mib = 2 ** 20
    memory = {'VmRSS': 900 * mib, 'VmHWM': 950 * mib, 'MemAvailable': 300 * mib, 'MemTotal': 8000 * mib,
              'cuda_allocated': 100 * mib, 'cuda_reserved': 700 * mib}
    ok = diagnostics.fill_memory_status(DiagnosticStatusWrapper(), memory)
    assert ok.level == OK and values(ok)['CUDA reserved (MiB)'] == '700.0'
    over = diagnostics.fill_memory_status(DiagnosticStatusWrapper(), memory, rss_budget_mb=800,
                                          min_mem_available_mb=512, cuda_reserved_budget_mb=600)
    assert over.level == WARN
    assert 'RSS' in over.message and 'MemAvailable' in over.message and 'CUDA reserved' in over.message
    real = diagnostics.read_memory('cpu')
    assert real['VmRSS'] > 0 and real['MemAvailable'] > 0 and 'cuda_reserved' not in real


class StrictWrapper(DiagnosticStatusWrapper):
    """diagnostic_updater's add() stores the value as given: a non-str would fail in the KeyValue message."""

    def add(self, key, val):
        assert isinstance(key, str) and isinstance(val, str), (key, val)
        super().add(key, val)


def test_tasks_pass_strings_as_diagnostic_updater_requires():
    metrics = diagnostics.GenerationMetrics()
    fallback = GenerationWarning(WarningKind.DRAFTER_FALLBACK, 'drafter failed')
    metrics.record('succeeded', result(warnings=[fallback]), [(0.0, 0), (0.1, 1), (0.2, 1)])
    local = EngineStatus(target_id='t', drafter='mtp', speculating=True, num_draft_tokens=2,
                         disabled_drafters=[DisabledDrafter('ngram', 'n-gram table', '/models/ngram', 'missing')])
    server = VllmStatus(url='http://gpu-server:8000', reachable=True, model='gemma', drafter='ngram',
                        num_draft_tokens=4, requests_running=2, requests_waiting=0)
    memory = dict(diagnostics.read_memory('cpu'), cuda_allocated=1, cuda_reserved=3 * 2 ** 20)
    engine = diagnostics.fill_engine_status(StrictWrapper(), 'ready', '', local, metrics)
    engine_on_a_server = diagnostics.fill_engine_status(StrictWrapper(), 'ready', '', server, metrics)
    generation = diagnostics.fill_generation_status(StrictWrapper(), metrics, 1, True, queue_limit=4)
    memory_task = diagnostics.fill_memory_status(StrictWrapper(), memory)
    # the figures that start as numbers, booleans or None arrive as their text
    assert (values(engine)['K'], values(engine)['drafter fallbacks']) == ('2', '1')
    assert values(engine)['disabled drafter ngram'] == 'n-gram table /models/ngram: missing'
    assert (values(engine_on_a_server)['K'], values(engine_on_a_server)['requests running']) == ('4', '2')
    assert values(engine_on_a_server)['KV-cache usage'] == '-'
    assert [values(generation)[key] for key in ('queue depth', 'queue limit', 'running', 'goals in window')] == [
        '1', '4', 'True', '1']
    assert values(memory_task)['CUDA reserved (MiB)'] == '3.0'
    # and the array the updater publishes serialises with every key and value intact
    tasks = [engine, engine_on_a_server, generation, memory_task]
    published = deserialize_message(serialize_message(DiagnosticArray(status=tasks)), DiagnosticArray)
    assert [values(status) for status in published.status] == [values(task) for task in tasks]


def test_period_status_reports_the_configured_rate_and_warns_when_off():
    status = PeriodStatus(60.0)  # runs back to back: far faster than once a minute
    first = status.run(DiagnosticStatusWrapper())
    second = status.run(DiagnosticStatusWrapper())
    assert first.level == WARN and second.level == WARN and second.message == 'Frequency too high.'
    keys = values(second)
    assert keys['Events since startup'] == '2'
    assert float(keys['Target frequency (Hz)']) == pytest.approx(1 / 60.0, abs=1e-6)
    assert float(keys['Minimum acceptable frequency (Hz)']) == pytest.approx(0.5 / 60.0, abs=1e-6)
    assert float(keys['Maximum acceptable frequency (Hz)']) == pytest.approx(1.5 / 60.0, abs=1e-6)
    with pytest.raises(ValueError, match='diagnostic_updater.period must be > 0'):
        PeriodStatus(0.0)


def test_spinning_updater_publishes_tasks_at_the_configured_period(context):
    node = rclpy.create_node('diag_publisher', context=context,
                             parameter_overrides=[Parameter(diagnostics.PERIOD_PARAMETER, value=0.1)])
    listener = rclpy.create_node('diag_listener', context=context)
    arrays = []
    listener.create_subscription(DiagnosticArray, '/diagnostics', arrays.append, 50)
    updater = Updater(node)
    updater.setHardwareID('hw-1')
    metrics = diagnostics.GenerationMetrics()
    updater.add('generation', lambda stat: diagnostics.fill_generation_status(stat, metrics, 0, False))
    updater.add('silent', lambda stat: stat)  # sets nothing: diagnostic_updater reports ERROR
    updater.add(PeriodStatus(updater.period))
    executor = SingleThreadedExecutor(context=context)
    executor.add_node(node)
    executor.add_node(listener)
    try:
        periodic = []  # arrays from the timer (not the 'Node starting up' ones add() publishes)
        deadline = time.monotonic() + 20
        while len(periodic) < 6 and time.monotonic() < deadline:
            executor.spin_once(timeout_sec=0.05)
            periodic = [a for a in arrays if len(a.status) == 3]
        assert len(periodic) >= 6, 'expected 6 periodic /diagnostics arrays, got {}'.format(len(periodic))
        assert updater.period == pytest.approx(0.1)
        statuses = {s.name: s for s in periodic[-1].status}
        assert sorted(statuses) == ['diag_publisher: diagnostics period', 'diag_publisher: generation',
                                    'diag_publisher: silent']
        assert all(s.hardware_id == 'hw-1' for s in statuses.values())
        generation = statuses['diag_publisher: generation']
        assert generation.level == OK and generation.message == 'idle'
        assert values(generation)['goals succeeded'] == '0'
        silent = statuses['diag_publisher: silent']
        assert silent.level == ERROR and silent.message == 'No message was set'
        period = values(statuses['diag_publisher: diagnostics period'])
        assert float(period['Target frequency (Hz)']) == pytest.approx(10.0)
        assert int(period['Events since startup']) >= 6
    finally:
        executor.shutdown(timeout_sec=1)
        node.destroy_node()
        listener.destroy_node()


def test_an_empty_window_reads_a_dash_and_unknown_rates_stay_out():
    metrics = diagnostics.GenerationMetrics()
    empty = values(diagnostics.fill_generation_status(DiagnosticStatusWrapper(), metrics, 0, False,
                                                      ttft_budget=0.1, inter_token_latency_budget=0.01))
    assert [empty[key] for key in ('decode tokens/s', 'time to first token p95 (s)',
                                   'inter-token latency p50 (s)', 'queue wait p50 (s)')] == ['-'] * 4
    metrics.record('succeeded', result(new_tokens=11, passes=4, tps=50.0))
    no_rate = unknown_stats()        # a server backend that streamed nothing measurable
    no_rate.new_tokens = 30
    metrics.record('succeeded', SimpleNamespace(stats=no_rate, warnings=[]))
    snap = metrics.snapshot()
    assert snap['tokens_per_second'] == pytest.approx(50.0) and snap['ttft_p50'] == pytest.approx(0.1)
