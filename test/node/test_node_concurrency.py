"""Concurrent goals through real rclpy: a backend that serves two goals at once, over the tiny-model engine."""

import dataclasses
import os
import re
import threading
import time

import pytest
from conftest import NO_DIAGNOSTIC_UPDATER, TEST_COMPILE, spinning_node

pytest.importorskip('diagnostic_updater', reason=NO_DIAGNOSTIC_UPDATER)

from gemma_spec_ros.engine import Engine
from gemma_spec_ros.engine.backend import Backend
from gemma_spec_ros.ros.goal_queue import SHUTDOWN_REASON
from gemma_spec_ros.tools.client import make_goal

DOMAIN_ID = 11 + (os.getpid() + 23) % 80
NAME = 'gemma_spec_pair'
HOLD_TIMEOUT = 60.0  # seconds a held generate() call waits for the test to let it go
LONG = 400           # max_new_tokens of a goal that is cancelled long before it ends


class TwoAtOnce(Backend):
    """
    The real engine, declared to serve two goals at once; generate() holds each call until the test lets go.

    While held, the test counts the calls inside generate() at the same moment: two goals inside at once is what
    proves the node runs them concurrently. Once let go, the engine serves them (its own lock or batch decides how).
    """

    def __init__(self, engine: Engine):
        self.engine = engine
        self.let_go = threading.Event()
        self._inside = threading.Condition()
        self.calls_inside = 0
        self.most_inside = 0

    @property
    def capabilities(self):
        return dataclasses.replace(self.engine.capabilities, max_concurrent_goals=2)

    @property
    def device(self):
        return self.engine.device

    def describe(self):
        return 'two at once over ' + self.engine.describe()

    def validate(self, request):
        return self.engine.validate(request)

    def generate(self, request, on_delta=None, cancel=None):
        with self._inside:
            self.calls_inside += 1
            self.most_inside = max(self.most_inside, self.calls_inside)
            self._inside.notify_all()
        try:
            if not self.let_go.wait(HOLD_TIMEOUT):
                raise RuntimeError('the test never let the goal go')
            return self.engine.generate(request, on_delta=on_delta, cancel=cancel)
        finally:
            with self._inside:
                self.calls_inside -= 1

    def wait_inside(self, count: int, timeout: float = 60.0) -> bool:
        """Wait until count calls are inside generate() at once."""
        with self._inside:
            return self._inside.wait_for(lambda: self.calls_inside == count, timeout)

    def status(self):
        return self.engine.status()

    def set_default_drafter(self, name):
        self.engine.set_default_drafter(name)

    def set_default_num_draft_tokens(self, k):
        self.engine.set_default_num_draft_tokens(k)

    def close(self):
        self.engine.close()


def two_at_once(config):
    return TwoAtOnce(Engine.from_config(config))


def params(tiny_models):
    return {'engine.target_path': tiny_models.target, 'engine.drafter': 'ngram', 'engine.device': 'cpu',
            'engine.dtype': 'float32', 'engine.compile': TEST_COMPILE, 'diagnostic_updater.period': 0.2}


@pytest.fixture(scope='module')
def served(context, tiny_models):
    with spinning_node(context, NAME, params(tiny_models), engine_factory=two_at_once) as (node, client):
        yield node, client, node.backend


def send_in_thread(client, goal, **kwargs):
    box = {}
    thread = threading.Thread(target=lambda: box.update(outcome=client.send(goal, **kwargs)))
    thread.start()
    return thread, box


def outcomes(sent, timeout=120):
    for thread, _ in sent:
        thread.join(timeout)
    return [box['outcome'] for _, box in sent]


def test_two_goals_run_at_once_and_a_third_waits_for_a_slot(served):
    node, client, backend = served
    backend.let_go.clear()
    sent = []
    try:
        sent += [send_in_thread(client, make_goal('goal %d' % i, max_new_tokens=12)) for i in range(2)]
        assert backend.wait_inside(2), 'the two goals were not inside generate() at the same time'
        sent.append(send_in_thread(client, make_goal('third', max_new_tokens=12)))

        def both_slots_held_one_waiting(statuses):
            values = statuses.get(NAME + ': generation', (0, '', {}))[2]
            return values.get('batch occupancy') == '2 of 2' and values.get('queue depth') == '1'

        latest = client.diagnostics_sample(NAME, 20, both_slots_held_one_waiting)
        assert latest is not None, '/diagnostics never showed both slots held and the third goal waiting'
        assert latest[NAME + ': generation'][1] == 'generating 2 of 2 goals, 1 of 4 waiting'
        assert backend.calls_inside == 2   # the third goal waits in the queue, not in generate()
    finally:
        backend.let_go.set()
    results = outcomes(sent)
    for outcome in results:
        assert outcome.status == 'succeeded', outcome.result.error
        assert outcome.result.stats.new_tokens > 0 and outcome.streamed_text == outcome.result.text
    assert backend.most_inside == 2        # the third started only once a slot was free


def test_cancel_of_one_running_goal_leaves_the_other(served):
    node, client, backend = served
    backend.let_go.clear()
    sent = []
    try:
        sent.append(send_in_thread(client, make_goal('cancel me', max_new_tokens=LONG), cancel_after_tokens=3))
        sent.append(send_in_thread(client, make_goal('keep me', max_new_tokens=12)))
        assert backend.wait_inside(2), 'the two goals were not inside generate() at the same time'
    finally:
        backend.let_go.set()
    cancelled, kept = outcomes(sent)
    assert cancelled.status == 'canceled' and cancelled.result.finish_reason == 'cancelled'
    assert 3 <= cancelled.result.stats.new_tokens < LONG
    assert kept.status == 'succeeded' and kept.result.error == '' and kept.result.stats.new_tokens > 0


def test_shutdown_ends_every_running_goal(context, tiny_models):
    with spinning_node(context, NAME + '_end', params(tiny_models), engine_factory=two_at_once) as (node, client):
        backend = node.backend
        sent = [send_in_thread(client, make_goal('running %d' % i, max_new_tokens=LONG)) for i in range(2)]
        stopper = threading.Thread(target=node.shutdown)
        try:
            assert backend.wait_inside(2), 'the two goals were not inside generate() at the same time'
            stopper.start()
            deadline = time.monotonic() + 10
            while node.state != 'shutdown' and time.monotonic() < deadline:
                time.sleep(0.01)
            assert node.state == 'shutdown'
        finally:
            backend.let_go.set()   # both see their cancelled token at once
        if stopper.is_alive():
            stopper.join(30)
        for outcome in outcomes(sent):
            assert outcome.status == 'aborted' and outcome.result.error == SHUTDOWN_REASON
            assert outcome.result.finish_reason == 'cancelled' and outcome.result.stats.new_tokens < LONG


def test_the_batched_local_engine_serves_two_goals_together_through_the_node(context, tiny_models):
    # engine.max_batch 2: the node runs two workers, the engine decodes both goals in one batch; each gets what it
    # gets alone (greedy)
    goals = [make_goal('The robot picked up the red cube and', max_new_tokens=30),
             make_goal('def add(a, b):\n    return a + b\n', max_new_tokens=24, drafter='ngram')]
    with spinning_node(context, NAME + '_batched', {**params(tiny_models), 'engine.max_batch': 2}) as (node, client):
        assert node.backend.capabilities.max_concurrent_goals == 2
        alone = [client.send(goal) for goal in goals]
        together = outcomes([send_in_thread(client, goal) for goal in goals])
        # /diagnostics lists each goal of the batch while they run: its drafter and K, its tau, its wait for a slot
        long_goals = [send_in_thread(client, make_goal('The robot picked up the red cube and', max_new_tokens=900,
                                                       drafter=drafter)) for drafter in ('none', 'ngram')]

        def both_goals_listed(statuses):
            values = statuses.get(NAME + '_batched: engine', (0, '', {}))[2]
            return all(values.get('batch slot {}'.format(slot), '').count(' tokens') for slot in (0, 1))

        latest = client.diagnostics_sample(NAME + '_batched', 60, both_goals_listed)
        assert all(outcome.status == 'succeeded' for outcome in outcomes(long_goals))
    for single, batched in zip(alone, together, strict=True):
        assert single.status == batched.status == 'succeeded', batched.result.error
        assert batched.result.text == single.result.text and batched.streamed_text == batched.result.text
    assert latest is not None, '/diagnostics never listed both goals of the batch'
    engine_values = latest[NAME + '_batched: engine'][2]
    listed = sorted(value for key, value in engine_values.items() if re.fullmatch(r'batch slot \d+', key))
    assert listed[0].startswith('ngram, ') and listed[1].startswith('plain decoding, tau 1.00, '), listed
    assert all(re.search(r'tau [0-9.]+, [0-9]+ tokens, waited [0-9.]+ s for its slot$', value) for value in listed)
    assert engine_values['batch slots'] == '2'
