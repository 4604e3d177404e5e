"""
The node as a managed (lifecycle) node, in process with a real rclpy client on the tiny random models.

Transitions are triggered on the node itself here; test_lifecycle_cli.py walks them with `ros2 lifecycle` against
a launched node.
"""

import os
import threading
import time

import pytest
from conftest import TEST_COMPILE, engine_status, missing_ros2_tools, spinning_node
from rclpy.lifecycle import TransitionCallbackReturn
from rclpy.parameter import Parameter

from gemma_spec_ros.engine import Engine
from gemma_spec_ros.tools.client import make_goal

if missing_ros2_tools():
    pytest.skip(missing_ros2_tools(), allow_module_level=True)

DOMAIN_ID = 11 + (os.getpid() + 41) % 80
PROMPT = 'The robot picked up the red cube and'
LONG_GOAL = dict(prompt='Count slowly: one', max_new_tokens=600, drafter='none')


def params(tiny_models, **extra):
    values = {'engine.target_path': tiny_models.target, 'engine.draft_model_path': tiny_models.draft,
              'engine.assistant_path': tiny_models.assistant, 'engine.drafter': 'ngram', 'engine.device': 'cpu',
              'engine.dtype': 'float32', 'engine.compile': TEST_COMPILE, 'engine.warmup': 'blocking',
              'engine.num_threads': 1, 'diagnostic_updater.period': 0.2, 'lifecycle.autostart': False}
    values.update(extra)
    return values


def managed(context, name, values, engine_factory=None):
    """Spin a GemmaSpecNode (unconfigured unless values autostart it); yield it with a GenerateClient."""
    return spinning_node(context, name, values, engine_factory)


def start_long_goal(client):
    """Send LONG_GOAL from a thread once; return (outcome holder, thread) after its first feedback."""
    box, first = {}, threading.Event()
    thread = threading.Thread(target=lambda: box.update(outcome=client.send(
        make_goal(**LONG_GOAL), on_feedback=lambda _: first.set())))
    thread.start()
    assert first.wait(60), 'the long goal never streamed'
    return box, thread


def test_goals_follow_the_lifecycle_states(context, tiny_models):
    name = 'gemma_spec_lifecycle'
    with managed(context, name, params(tiny_models)) as (node, client):
        assert node.lifecycle_state == 'unconfigured' and node.backend is None
        refused = client.send(make_goal(PROMPT, max_new_tokens=4))
        assert refused.status == 'aborted' and 'unconfigured' in refused.result.error
        values = engine_status(client, name, lambda e: e[2].get('lifecycle') == 'unconfigured')[2]
        assert values['state'] == 'unconfigured'

        assert node.trigger_configure() == TransitionCallbackReturn.SUCCESS
        assert node.lifecycle_state == 'inactive' and node.backend is not None
        inactive = client.send(make_goal(PROMPT, max_new_tokens=4))
        assert inactive.status == 'aborted' and 'inactive' in inactive.result.error

        assert node.trigger_activate() == TransitionCallbackReturn.SUCCESS
        first = client.send(make_goal(PROMPT, max_new_tokens=16, num_draft_tokens=2))
        plain = client.send(make_goal(PROMPT, max_new_tokens=16, drafter='none'))
        assert first.status == plain.status == 'succeeded'
        assert list(first.result.token_ids) == list(plain.result.token_ids)
        engine_status(client, name, lambda e: e[2].get('lifecycle') == 'active' and e[2]['state'] == 'ready')

        # deactivate while a goal runs: by default it finishes, and new goals are refused
        box, thread = start_long_goal(client)
        assert node.trigger_deactivate() == TransitionCallbackReturn.SUCCESS
        late = client.send(make_goal(PROMPT, max_new_tokens=4))
        thread.join(120)
        assert late.status == 'aborted' and 'inactive' in late.result.error
        assert box['outcome'].status == 'succeeded', box['outcome'].result.error
        assert box['outcome'].result.finish_reason in ('length', 'stop')

        # with lifecycle.on_deactivate cancel, the running goal ends with its partial text and the reason
        node.set_parameters([Parameter('lifecycle.on_deactivate', value='cancel')])
        assert node.trigger_activate() == TransitionCallbackReturn.SUCCESS
        box, thread = start_long_goal(client)
        assert node.trigger_deactivate() == TransitionCallbackReturn.SUCCESS
        thread.join(60)
        cut = box['outcome']
        assert cut.status == 'aborted' and cut.result.finish_reason == 'cancelled' and 'inactive' in cut.result.error
        assert 0 < cut.result.stats.new_tokens < 600 and cut.result.text == cut.streamed_text

        # a load-time parameter is refused while configured, and applies at the next configure after cleanup
        refusal = node.set_parameters([Parameter('engine.target_path', value='/elsewhere')])[0]
        assert not refusal.successful and 'cleanup' in refusal.reason
        assert node.trigger_cleanup() == TransitionCallbackReturn.SUCCESS
        assert node.lifecycle_state == 'unconfigured' and node.backend is None
        assert node.set_parameters([Parameter('engine.drafter', value='draft')])[0].successful
        assert node.trigger_configure() == TransitionCallbackReturn.SUCCESS
        assert node.trigger_activate() == TransitionCallbackReturn.SUCCESS
        again = client.send(make_goal(PROMPT, max_new_tokens=16, num_draft_tokens=2))
        assert again.status == 'succeeded' and again.result.stats.drafter == 'draft'
        assert list(again.result.token_ids) == list(plain.result.token_ids)

        assert node.trigger_shutdown() == TransitionCallbackReturn.SUCCESS
        assert node.lifecycle_state == 'finalized' and node.backend is None


def test_a_failed_configure_reports_why_and_succeeds_once_fixed(context, tiny_models, tmp_path):
    name = 'gemma_spec_bad_path'
    missing = str(tmp_path / 'no_such_model')
    with managed(context, name, params(tiny_models, **{'engine.target_path': missing})) as (node, client):
        assert node.trigger_configure() == TransitionCallbackReturn.FAILURE
        assert node.lifecycle_state == 'unconfigured'
        level, message, values = engine_status(client, name, lambda e: e[0] == 'ERROR')[:3]
        assert missing in message and 'configure failed' in message and values['lifecycle'] == 'unconfigured'
        refused = client.send(make_goal(PROMPT, max_new_tokens=4))
        assert refused.status == 'aborted' and missing in refused.result.error

        assert node.set_parameters([Parameter('engine.target_path', value=tiny_models.target)])[0].successful
        assert node.trigger_configure() == TransitionCallbackReturn.SUCCESS
        assert node.trigger_activate() == TransitionCallbackReturn.SUCCESS
        assert client.send(make_goal(PROMPT, max_new_tokens=4)).status == 'succeeded'


class OutOfMemoryBackend:
    """Wrap the real engine; its next generate fails as a device out of memory does, once armed."""

    def __init__(self, engine):
        self._engine = engine
        self.out_of_memory = False

    def generate(self, request, on_delta=None, cancel=None):
        if self.out_of_memory:
            raise MemoryError('injected: device out of memory')
        return self._engine.generate(request, on_delta=on_delta, cancel=cancel)

    def __getattr__(self, name):
        return getattr(self._engine, name)


def test_a_fatal_engine_error_goes_through_error_processing_to_unconfigured(context, tiny_models):
    name = 'gemma_spec_fault'
    with managed(context, name, params(tiny_models, **{'lifecycle.autostart': True}),
                 engine_factory=lambda config: OutOfMemoryBackend(Engine.from_config(config))) as (node, client):
        deadline = time.monotonic() + 120
        while node.lifecycle_state != 'active' and time.monotonic() < deadline:
            time.sleep(0.05)
        assert client.send(make_goal(PROMPT, max_new_tokens=4)).status == 'succeeded'
        node.backend.out_of_memory = True
        failed = client.send(make_goal(PROMPT, max_new_tokens=4))
        assert failed.status == 'aborted' and 'out of memory' in failed.result.error
        deadline = time.monotonic() + 30
        while node.lifecycle_state != 'unconfigured' and time.monotonic() < deadline:
            time.sleep(0.05)
        assert node.lifecycle_state == 'unconfigured' and node.backend is None
        level, message, values = engine_status(client, name, lambda e: e[2].get('lifecycle') == 'unconfigured')[:3]
        assert 'out of memory' in message
        assert node.trigger_configure() == TransitionCallbackReturn.SUCCESS  # the operator can bring it back


def test_lifecycle_cycles_under_load_end_every_goal_with_a_reason(tiny_models):
    # the node as a process of its own, cycled through configure, activate, deactivate and cleanup while two
    # planners send goals the whole time: each goal ends with a reason, none hangs or is lost
    import subprocess
    import sys
    from pathlib import Path

    node_args = ['engine.{}:={}'.format(name, value) for name, value in (
        ('target_path', tiny_models.target), ('draft_model_path', tiny_models.draft),
        ('assistant_path', tiny_models.assistant), ('drafter', 'ngram'), ('device', 'cpu'), ('dtype', 'float32'),
        ('compile', 'eager'), ('warmup', 'blocking'), ('num_threads', 1))]
    command = [sys.executable, '-m', 'gemma_spec_ros.tools.lifecycle_memory', '--cycles', '4', '--clients', '2',
               '--max-new-tokens', '8', '--goal-timeout', '120', '--max-growth-mib', '1000']
    for value in node_args:
        command += ['--node-arg', value]
    run = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=Path(__file__).resolve().parents[2])
    summary = [line for line in run.stdout.splitlines() if line.startswith('goals ')]
    assert run.returncode == 0 and summary, run.stdout[-3000:] + run.stderr[-3000:]
    assert 'without a reason 0, hangs 0, lost 0' in summary[0], summary
    assert 'succeeded' in summary[0] and 'aborted' in summary[0], summary   # served while active, refused otherwise
