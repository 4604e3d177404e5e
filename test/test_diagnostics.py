"""diagnostic_updater fallback and the node's diagnostic tasks: logic without spinning, then one spinning test."""

import os
import time
from types import SimpleNamespace

import pytest
import rclpy
from diagnostic_msgs.msg import DiagnosticArray
from rclpy.context import Context
from rclpy.executors import SingleThreadedExecutor
from rclpy.parameter import Parameter

from gemma_spec_ros.engine.types import DisabledDrafter, EngineStatus, GenerationStats
from gemma_spec_ros.ros import diagnostics
from gemma_spec_ros.ros.diagnostics import ERROR, OK, STALE, WARN, FallbackStatusWrapper, FallbackUpdater

DOMAIN_ID = 11 + (os.getpid() + 53) % 80


class FakeNode:
    """Just what FallbackUpdater uses, so the task logic runs without a ROS context."""

    def __init__(self, parameters=None):
        self.parameters = dict(parameters or {})
        self.published = []
        self.warnings = []

    def has_parameter(self, name):
        return name in self.parameters

    def get_parameter(self, name):
        return SimpleNamespace(value=self.parameters[name])

    def declare_parameter(self, name, value, descriptor=None):
        self.parameters.setdefault(name, value)
        return SimpleNamespace(value=self.parameters[name])

    def create_publisher(self, *args):
        return SimpleNamespace(publish=self.published.append)

    def create_timer(self, period, callback):
        self.timer_period = period
        return None

    def get_name(self):
        return 'fake'

    def get_clock(self):
        return SimpleNamespace(now=lambda: SimpleNamespace(to_msg=lambda: rclpy.time.Time().to_msg()))

    def get_logger(self):
        return SimpleNamespace(warning=self.warnings.append)


def test_task_that_sets_nothing_reports_error():
    updater = FallbackUpdater(FakeNode())
    updater.add('silent', lambda stat: stat)
    updater.add('fine', lambda stat: (stat.summary(OK, 'all good'), stat)[1])
    silent, fine = updater.run_tasks()
    assert silent.level == ERROR and silent.message == 'No message was set'
    assert fine.level == OK and fine.message == 'all good'


def test_updater_reads_period_prefixes_names_sets_hardware_id_and_warns_once():
    node = FakeNode({'diagnostic_updater.period': 0.5})
    updater = FallbackUpdater(node, period=1.0)
    assert updater.period == 0.5 and node.timer_period == 0.5
    updater.add('task', lambda stat: (stat.summary(WARN, 'hot'), stat.add('temp', 80), stat)[2])
    updater.update()
    updater.update()
    assert len(node.warnings) == 1 and 'hardware_id' in node.warnings[0]
    updater.setHardwareID('orin-1')
    updater.update()
    status = node.published[-1].status[0]
    assert status.name == 'fake: task' and status.hardware_id == 'orin-1' and status.level == WARN
    assert [(kv.key, kv.value) for kv in status.values] == [('temp', '80')]
    assert FallbackUpdater(FakeNode()).period == 1.0


def test_status_wrapper_merge_summary():
    stat = FallbackStatusWrapper()
    stat.summary(OK, 'fine')
    stat.mergeSummary(OK, 'also fine')
    assert stat.level == OK and stat.message == 'fine; also fine'
    stat.mergeSummary(WARN, 'slow')
    assert stat.level == WARN and stat.message == 'slow'
    stat.mergeSummary(OK, 'ignored')
    stat.mergeSummary(ERROR, 'broken')
    assert stat.level == ERROR and stat.message == 'slow; broken'
    stat.clearSummary()
    assert stat.level == OK and stat.message == ''
    assert diagnostics.level_name(STALE) == 'STALE' and diagnostics.level_name(1) == 'WARN'


def result(new_tokens=10, passes=5, drafted=8, accepted=5, ttft=0.1, tps=50.0, warnings=()):
    stats = GenerationStats(new_tokens=new_tokens, target_passes=passes, drafted_tokens=drafted,
                            accepted_tokens=accepted, tau=new_tokens / passes, time_to_first_token=ttft,
                            tokens_per_second=tps)
    return SimpleNamespace(stats=stats, warnings=list(warnings))


def values(stat):
    return {kv.key: kv.value for kv in stat.values}


def test_engine_task_levels():
    metrics = diagnostics.GenerationMetrics()
    failed = diagnostics.fill_engine_status(FallbackStatusWrapper(), 'failed', 'engine failed to load: x', None,
                                            metrics)
    assert failed.level == ERROR and 'engine failed to load' in failed.message
    loading = diagnostics.fill_engine_status(FallbackStatusWrapper(), 'loading', '', None, metrics, 3.0)
    assert loading.level == WARN and 'loading' in loading.message
    speculating = EngineStatus(target_id='t', drafter='mtp', drafter_id='a', num_draft_tokens=3,
                               draft_cost_ratio=0.1, break_even_tau=1.3, speculating=True, tau_lifetime=2.0)
    ok = diagnostics.fill_engine_status(FallbackStatusWrapper(), 'ready', '', speculating, metrics)
    assert ok.level == OK and values(ok)['speculation'] == 'on' and values(ok)['K'] == '3'
    paused = diagnostics.fill_engine_status(FallbackStatusWrapper(), 'ready', '',
                                            EngineStatus(drafter='mtp', speculating=False), metrics)
    assert paused.level == OK and 'paused by the profit gate' in paused.message   # normal operation
    assert values(paused)['speculation'] == 'paused'
    plain = diagnostics.fill_engine_status(FallbackStatusWrapper(), 'ready', '', EngineStatus(drafter='none'),
                                           metrics)
    assert plain.level == OK and values(plain)['speculation'] == 'off'


def test_disabled_drafter_is_an_error_naming_role_path_and_cause():
    broken = DisabledDrafter('mtp', 'MTP assistant', '/models/assistant', 'safetensors header: incomplete metadata')
    status = EngineStatus(drafter='mtp', disabled_drafters=[broken])
    stat = diagnostics.fill_engine_status(FallbackStatusWrapper(), 'ready', '', status,
                                          diagnostics.GenerationMetrics())
    assert stat.level == ERROR
    for part in ("drafter 'mtp' disabled", 'MTP assistant', '/models/assistant', 'incomplete metadata',
                 'run plain decoding'):
        assert part in stat.message, part
    assert values(stat)['speculation'] == 'off (drafter disabled)'
    assert values(stat)['disabled drafter mtp'] == 'MTP assistant /models/assistant: ' + broken.cause


def test_generation_task_window_and_latency_budget():
    metrics = diagnostics.GenerationMetrics(window=2)
    metrics.record('succeeded', result(ttft=0.1), [(0.0, 0), (0.1, 1), (0.3, 2), (0.4, 1)])
    metrics.record('succeeded', result(ttft=0.3, new_tokens=20, passes=5))
    metrics.record('cancelled', result(ttft=0.2, new_tokens=10, passes=10))  # pushes the first out
    metrics.record('busy')
    snap = metrics.snapshot()
    assert snap['goals_in_window'] == 2 and snap['succeeded'] == 2 and snap['cancelled'] == 1
    assert snap['tau'] == pytest.approx(30 / 15) and snap['acceptance_rate'] == pytest.approx(10 / 16)
    assert snap['ttft_p50'] == pytest.approx(0.25)
    ok = diagnostics.fill_generation_status(FallbackStatusWrapper(), metrics, 0, False, ttft_budget=1.0)
    assert ok.level == OK and ok.message == 'idle' and values(ok)['goals busy'] == '1'
    slow = diagnostics.fill_generation_status(FallbackStatusWrapper(), metrics, 2, True, ttft_budget=0.25)
    assert slow.level == WARN and 'time to first token p95' in slow.message
    busy = diagnostics.fill_generation_status(FallbackStatusWrapper(), metrics, 2, True, queue_limit=4)
    assert busy.message == 'generating, 2 of 4 waiting' and values(busy)['queue limit'] == '4'


def test_time_to_first_token_counts_the_queue_wait():
    metrics = diagnostics.GenerationMetrics()
    # accepted at 10.0, started after 2 s in the queue, first token 0.05 s later (engine ttft 0.05 s)
    metrics.record('succeeded', result(ttft=0.05), [(12.0, 0), (12.05, 1), (12.1, 1)], accepted_at=10.0)
    snap = metrics.snapshot()
    assert snap['queue_wait_p95'] == pytest.approx(2.0) and snap['ttft_p95'] == pytest.approx(2.05)
    stat = diagnostics.fill_generation_status(FallbackStatusWrapper(), metrics, 0, False, ttft_budget=1.0)
    assert stat.level == WARN and 'queue wait p95 2.000 s' in stat.message
    assert values(stat)['queue wait p50 (s)'] == '2.0000' and values(stat)['time to first token p95 (s)'] == '2.0500'


def test_inter_token_gaps_from_feedback_times():
    metrics = diagnostics.GenerationMetrics()
    # start, first round (ttft, excluded), then 2 tokens after 0.2 s and 1 token after 0.1 s
    metrics.record('succeeded', result(), [(0.0, 0), (0.1, 1), (0.3, 2), (0.4, 1)])
    snap = metrics.snapshot()
    assert snap['itl_p50'] == pytest.approx(0.1) and snap['itl_p95'] == pytest.approx(0.1)
    stat = diagnostics.fill_generation_status(FallbackStatusWrapper(), metrics, 0, False,
                                              inter_token_latency_budget=0.05)
    assert stat.level == WARN and 'inter-token latency p95' in stat.message


def test_memory_task_budgets():
    mib = 2 ** 20
    memory = {'VmRSS': 900 * mib, 'VmHWM': 950 * mib, 'MemAvailable': 300 * mib, 'MemTotal': 8000 * mib,
              'cuda_allocated': 100 * mib, 'cuda_reserved': 700 * mib}
    ok = diagnostics.fill_memory_status(FallbackStatusWrapper(), memory)
    assert ok.level == OK and values(ok)['CUDA reserved (MiB)'] == '700.0'
    over = diagnostics.fill_memory_status(FallbackStatusWrapper(), memory, rss_budget_mb=800,
                                          min_mem_available_mb=512, cuda_reserved_budget_mb=600)
    assert over.level == WARN
    assert 'RSS' in over.message and 'MemAvailable' in over.message and 'CUDA reserved' in over.message
    real = diagnostics.read_memory('cpu')
    assert real['VmRSS'] > 0 and real['MemAvailable'] > 0 and 'cuda_reserved' not in real


def test_spinning_updater_publishes_on_diagnostics():
    os.environ.setdefault('ROS_AUTOMATIC_DISCOVERY_RANGE', 'LOCALHOST')
    context = Context()
    rclpy.init(context=context, domain_id=DOMAIN_ID)
    node = rclpy.create_node('diag_publisher', context=context,
                             parameter_overrides=[Parameter('diagnostic_updater.period', value=0.1)])
    listener = rclpy.create_node('diag_listener', context=context)
    received = []
    listener.create_subscription(DiagnosticArray, '/diagnostics', received.append, 10)
    updater = FallbackUpdater(node)
    updater.setHardwareID('hw')
    updater.add('heartbeat', lambda stat: (stat.summary(OK, 'alive'), stat)[1])
    executor = SingleThreadedExecutor(context=context)
    executor.add_node(node)
    executor.add_node(listener)
    try:
        deadline = time.monotonic() + 10
        while not received and time.monotonic() < deadline:
            executor.spin_once(timeout_sec=0.05)
        assert received, 'No diagnostics received'
        status = received[0].status[0]
        assert status.name == 'diag_publisher: heartbeat' and status.level == OK and status.hardware_id == 'hw'
        assert updater.period == pytest.approx(0.1)
    finally:
        executor.shutdown(timeout_sec=1)
        node.destroy_node()
        listener.destroy_node()
        rclpy.try_shutdown(context=context)


def test_exported_api_is_diagnostic_updater_compatible():
    try:
        import diagnostic_updater  # noqa: F401
    except ImportError:
        assert diagnostics.USING_FALLBACK and diagnostics.Updater is FallbackUpdater
    for name in ('summary', 'mergeSummary', 'clearSummary', 'add'):
        assert callable(getattr(diagnostics.DiagnosticStatusWrapper, name))
    for name in ('setHardwareID', 'add', 'update', 'force_update', 'broadcast'):
        assert callable(getattr(diagnostics.Updater, name))


class StrictWrapper(FallbackStatusWrapper):
    """diagnostic_updater's add() stores the value as given: a non-str would fail in the KeyValue message."""

    def add(self, key, value):
        assert isinstance(key, str) and isinstance(value, str), (key, value)
        super().add(key, value)


def test_tasks_pass_strings_as_diagnostic_updater_requires():
    metrics = diagnostics.GenerationMetrics()
    metrics.record('succeeded', result(warnings=['drafter failed']), [(0.0, 0), (0.1, 1), (0.2, 1)])
    status = EngineStatus(target_id='t', drafter='mtp', speculating=True, num_draft_tokens=2)
    diagnostics.fill_engine_status(StrictWrapper(), 'ready', '', status, metrics)
    diagnostics.fill_generation_status(StrictWrapper(), metrics, 1, True)
    memory = dict(diagnostics.read_memory('cpu'), cuda_allocated=1, cuda_reserved=2)
    diagnostics.fill_memory_status(StrictWrapper(), memory)
