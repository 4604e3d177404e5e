"""The node through real rclpy: action clients against GemmaSpecNode on tiny random Gemma 4 models."""

import json
import os
import threading
import time

import jsonschema
import pytest
from conftest import NO_DIAGNOSTIC_UPDATER, TEST_COMPILE, spinning_node

pytest.importorskip('diagnostic_updater', reason=NO_DIAGNOSTIC_UPDATER)

from rcl_interfaces.msg import Parameter as ParameterMsg
from rcl_interfaces.msg import ParameterType, ParameterValue
from rcl_interfaces.srv import SetParameters
from rclpy.parameter import Parameter

from gemma_spec_ros.engine import Engine
from gemma_spec_ros.engine.drafters.base import Drafter
from gemma_spec_ros.engine.drafters.none import NoneDrafter
from gemma_spec_ros.engine.runtime.model import checkpoints as engine_models
from gemma_spec_ros.engine.runtime.steps.causal_lm import DynamicCausalLM
from gemma_spec_ros.tools.client import GenerateClient, make_goal

DOMAIN_ID = 11 + os.getpid() % 80
STEP_SCHEMA = {'type': 'object', 'properties': {'action': {'enum': ['navigate', 'pick', 'place']},
                                                'target': {'type': 'string', 'pattern': '^[a-z]{1,8}$'}},
               'required': ['action', 'target']}
PLAN_SCHEMA = {'type': 'object', 'properties': {'steps': {'type': 'array', 'items': STEP_SCHEMA, 'minItems': 1,
                                                          'maxItems': 2}}, 'required': ['steps']}
LONG = 400  # max_new_tokens of goals that must still be running a moment later


def tiny_params(tiny_models, **extra):
    params = {'engine.target_path': tiny_models.target, 'engine.assistant_path': tiny_models.assistant,
              'engine.draft_model_path': tiny_models.draft, 'engine.drafter': 'ngram', 'engine.device': 'cpu',
              'engine.dtype': 'float32', 'engine.compile': TEST_COMPILE, 'diagnostic_updater.period': 0.2,
              'diagnostics.hardware_id': 'test-hw'}
    params.update(extra)
    return params


def serving(context, name, params, engine_factory=None):
    return spinning_node(context, name, params, engine_factory)


@pytest.fixture(scope='module')
def served(context, tiny_models):
    with serving(context, 'gemma_spec_t', tiny_params(tiny_models)) as pair:
        yield pair


def wait_for_feedback(outcome_holder, count=1, timeout=60):
    deadline = time.monotonic() + timeout
    while len(outcome_holder) < count and time.monotonic() < deadline:
        time.sleep(0.005)
    assert len(outcome_holder) >= count, 'no feedback within {} s'.format(timeout)


def send_in_thread(client, goal, **kwargs):
    box = {}
    feedback = []
    thread = threading.Thread(target=lambda: box.update(outcome=client.send(
        goal, on_feedback=feedback.append, **kwargs)))
    thread.start()
    return thread, box, feedback


def test_streaming_feedback_matches_result(served):
    node, client = served
    outcome = client.send(make_goal('Robot plan: move to the kitchen and', max_new_tokens=48))
    assert outcome.status == 'succeeded', outcome.result.error
    result = outcome.result
    assert result.finish_reason in ('length', 'stop') and result.error == ''
    assert outcome.streamed_text == result.text
    assert [t for f in outcome.feedback for t in f.token_ids_delta] == list(result.token_ids)
    assert len(outcome.feedback) == result.stats.target_passes  # one message per verify round
    generated = [f.tokens_generated for f in outcome.feedback]
    assert generated == sorted(generated) and generated[-1] == result.stats.new_tokens
    assert result.stats.new_tokens == len(result.token_ids) > 0
    assert result.stats.tau >= 1.0 and result.stats.wall_time > 0 and result.stats.process_peak_rss_bytes > 0


def test_chat_messages_and_defaults(served):
    node, client = served
    outcome = client.send(make_goal(messages=[('system', 'You plan robot tasks.'), ('user', 'Fetch a cup.')],
                                    max_new_tokens=8, drafter='none'))
    assert outcome.status == 'succeeded', outcome.result.error
    assert outcome.result.stats.drafter == 'none' and outcome.result.stats.new_tokens <= 8


def test_cancel_mid_stream(served):
    node, client = served
    outcome = client.send(make_goal('Count: one two three', max_new_tokens=LONG), cancel_after_tokens=5)
    assert outcome.status == 'canceled'
    result = outcome.result
    assert result.finish_reason == 'cancelled' and result.error == ''
    assert 5 <= result.stats.new_tokens < LONG
    assert result.text == outcome.streamed_text  # partial text
    # stops within a round or two of the cancel reaching the worker; feedback already on its way when the cancel
    # left the client also arrives after it (a loaded CI run: 4 messages within 2 ms of one another)
    after_cancel = [t for t in outcome.feedback_times if t > outcome.cancel_time]
    assert len(after_cancel) <= 6, after_cancel
    assert outcome.cancel_latency < 5.0


BAD_GOALS = [
    (dict(prompt='x', temperature=5.0), 'temperature must be a finite number in [0, 2'),
    (dict(prompt='x', top_p=1.5), 'top_p must be in (0, 1]'),
    (dict(prompt=''), 'empty request'),
    (dict(prompt='x', drafter='eagle'), "unknown drafter 'eagle'"),
    (dict(prompt='x', max_new_tokens=10 ** 6), 'max_new_tokens must be between 1 and 2048'),
    (dict(prompt='x', stop=['']), 'stop strings must not be empty'),
    (dict(prompt='x', num_draft_tokens=50), 'num_draft_tokens must be between 0 (adaptive) and max_draft_tokens=8'),
    (dict(prompt='x' * 40000), 'more than generation.max_prompt_chars = 32768'),
    (dict(messages=[('user', 'hi')] * 1, prompt='', max_new_tokens=1, seed=-1, temperature=float('nan')),
     'temperature must be a finite number'),
    (dict(prompt='x', json_schema='{"type": "object", "properties": {"x": {"type": "vector"}}}'),
     "json_schema: 'vector' is not valid under any of the given schemas at $.properties.x.type"),
    (dict(prompt='x', json_schema='{"type": "integer", "minimum": 5, "maximum": 2}'),
     'json_schema: Invalid range: minimum greater than maximum'),
    (dict(prompt='x', grammar='root ::= "a" | b'),
     'grammar: EBNF parser error at line 1, column 16: Rule "b" is not defined'),
    (dict(prompt='x', json_schema='{"type": "integer"}', grammar='root ::= "1"'),
     'set at most one of json_schema and grammar'),
    (dict(prompt='x', grammar='root ::= "1"', json_free_whitespace=True),
     'json_free_whitespace applies to json_schema only'),
    (dict(prompt='x', json_schema='{"type": "array", "items": {"type": "integer"}, "uniqueItems": true}'),
     "json_schema: 'uniqueItems' at $ is not enforced by the grammar engine; remove it, or set "
     "json_schema_unenforced to 'check'"),
    (dict(prompt='x', json_schema='{"type": "integer"}', json_schema_unenforced='ignore'),
     "json_schema_unenforced must be one of refuse|check"),
]


@pytest.mark.parametrize('fields, expected', BAD_GOALS, ids=[e[:24] for _, e in BAD_GOALS])
def test_bad_goal_is_accepted_then_aborted_with_reason(served, fields, expected):
    node, client = served
    outcome = client.send(make_goal(**fields))
    assert outcome.accepted and outcome.status == 'aborted'
    assert expected in outcome.result.error
    assert outcome.result.finish_reason == 'error' and not outcome.feedback


def test_structured_output_goal(served):
    node, client = served
    outcome = client.send(make_goal('Plan: ', max_new_tokens=400, json_schema=json.dumps(PLAN_SCHEMA),
                                    drafter='draft', num_draft_tokens=3))
    assert outcome.status == 'succeeded', outcome.result.error
    result = outcome.result
    assert result.finish_reason == 'stop' and result.structure_complete and not result.warnings
    jsonschema.validate(json.loads(result.text), PLAN_SCHEMA)
    assert outcome.streamed_text == result.text
    short = client.send(make_goal('Plan: ', max_new_tokens=4, grammar='root ::= "[" [a-z]{1,20} "]"'))
    assert short.status == 'succeeded' and short.result.finish_reason == 'length'
    assert not short.result.structure_complete and short.result.text.startswith('[')
    assert any(w.startswith('structure incomplete') for w in short.result.warnings)
    plain = client.send(make_goal('Plan: ', max_new_tokens=4))
    assert plain.status == 'succeeded' and not plain.result.structure_complete and not plain.result.warnings


def test_a_goal_may_leave_an_unenforced_keyword_to_the_final_check(served):
    node, client = served
    schema = {'type': 'array', 'items': {'type': 'string', 'pattern': '^[a-z]{1,8}$'}, 'minItems': 1, 'maxItems': 3,
              'uniqueItems': True}
    outcome = client.send(make_goal('Rooms: ', max_new_tokens=200, json_schema=json.dumps(schema),
                                    json_schema_unenforced='check'))
    assert outcome.status == 'succeeded', outcome.result.error
    result = outcome.result
    assert "'uniqueItems' at $ is not enforced by the grammar engine" in result.warnings[0]
    items = json.loads(result.text) if result.finish_reason == 'stop' else None
    assert result.structure_complete == (items is not None and len(set(items)) == len(items)), result.text


def test_bad_goal_does_not_wait_behind_a_running_goal(served):
    node, client = served
    thread, box, feedback = send_in_thread(client, make_goal('a long one', max_new_tokens=LONG))
    wait_for_feedback(feedback)
    started = time.monotonic()
    bad = client.send(make_goal('x', top_k=0, temperature=-1.0))
    assert bad.status == 'aborted' and 'temperature' in bad.result.error
    assert 'outcome' not in box, 'the bad goal waited for the running one'
    assert time.monotonic() - started < 5.0
    thread.join()
    assert box['outcome'].status == 'succeeded'


def test_queue_fifo_and_busy_goals(served):
    node, client = served
    node.set_parameters([Parameter('queue.max_length', value=1)])
    planners = [GenerateClient('/gemma_spec_t/generate', 'planner_%d' % i, context=node.context) for i in range(3)]
    try:
        for planner in planners:
            assert planner.wait_for_server(20)
        first = send_in_thread(client, make_goal('first', max_new_tokens=LONG))
        wait_for_feedback(first[2])
        others = [send_in_thread(planner, make_goal('other %d' % i, max_new_tokens=16))
                  for i, planner in enumerate(planners)]
        for thread, _, _ in [first] + others:
            thread.join(120)
        outcomes = [box['outcome'] for _, box, _ in [first] + others]
    finally:
        node.set_parameters([Parameter('queue.max_length', value=4)])
        for planner in planners:
            planner.close()
    statuses = sorted(o.status for o in outcomes[1:])
    assert outcomes[0].status == 'succeeded'
    assert statuses == ['aborted', 'aborted', 'succeeded'], statuses
    queued = next(o for o in outcomes[1:] if o.status == 'succeeded')
    for busy in (o for o in outcomes[1:] if o.status == 'aborted'):
        assert busy.accepted and busy.busy and not busy.feedback
        assert busy.result.error.startswith('busy: 2 of 2 slots taken') and 'queue.max_length 1' in busy.result.error
    assert queued.first_feedback_latency > 0 and queued.result.stats.new_tokens > 0


def test_cancel_of_a_waiting_goal(served):
    node, client = served
    running = send_in_thread(client, make_goal('running', max_new_tokens=LONG))
    wait_for_feedback(running[2])
    # cancelled right after its acceptance: the running goal's LONG tokens take far longer on any machine
    waiting = client.send(make_goal('waiting', max_new_tokens=LONG), cancel_after_seconds=0.02)
    assert waiting.status == 'canceled' and waiting.result.finish_reason == 'cancelled'
    assert waiting.result.text == '' and not waiting.feedback
    assert 'outcome' not in running[1], 'the waiting goal was not cancelled while queued'
    running[0].join()
    assert running[1]['outcome'].status == 'succeeded'


def test_preempt_policy(served):
    node, client = served
    node.set_parameters([Parameter('queue.policy', value='preempt')])
    try:
        old = send_in_thread(client, make_goal('old goal', max_new_tokens=LONG))
        wait_for_feedback(old[2], 3)
        new = client.send(make_goal('new goal', max_new_tokens=8))
        old[0].join(60)
    finally:
        node.set_parameters([Parameter('queue.policy', value='fifo')])
    preempted = old[1]['outcome']
    assert new.status == 'succeeded'
    assert preempted.status == 'aborted' and 'preempted by a newer goal' in preempted.result.error
    assert preempted.result.finish_reason == 'cancelled'
    assert preempted.result.text == preempted.streamed_text and preempted.result.stats.new_tokens < LONG


def _set_parameter_service(client_node, node_name, name, value):
    service = client_node.create_client(SetParameters, '/{}/set_parameters'.format(node_name))
    assert service.wait_for_service(10)
    if isinstance(value, str):
        pv = ParameterValue(type=ParameterType.PARAMETER_STRING, string_value=value)
    else:
        pv = ParameterValue(type=ParameterType.PARAMETER_INTEGER, integer_value=value)
    future = service.call_async(SetParameters.Request(parameters=[ParameterMsg(name=name, value=pv)]))
    done = threading.Event()
    future.add_done_callback(lambda _: done.set())
    assert done.wait(10)
    client_node.destroy_client(service)
    return future.result().results[0]


def test_parameters_at_run_time(served):
    node, client = served
    set_param = lambda name, value: _set_parameter_service(client.node, 'gemma_spec_t', name, value)  # noqa: E731
    try:
        assert set_param('engine.drafter', 'draft').successful
        assert node.backend.status().drafter == 'draft'
        outcome = client.send(make_goal('use the default drafter', max_new_tokens=6, num_draft_tokens=2))
        assert outcome.status == 'succeeded' and outcome.result.stats.drafter == 'draft'
        rejected = set_param('engine.drafter', 'eagle')
        assert not rejected.successful and 'must be one of none|mtp|draft|ngram' in rejected.reason
        assert set_param('engine.num_draft_tokens', 3).successful
        assert node.backend.status().num_draft_tokens == 3
        too_big = set_param('engine.num_draft_tokens', 20)
        assert not too_big.successful and 'max_draft_tokens=8' in too_big.reason
        assert not set_param('engine.target_path', '/elsewhere').successful  # read-only after start
        bad_policy = set_param('queue.policy', 'lifo')
        assert not bad_policy.successful and 'fifo|preempt' in bad_policy.reason
    finally:
        node.set_parameters([Parameter('engine.drafter', value='ngram'),
                             Parameter('engine.num_draft_tokens', value=0)])
    assert node.backend.status().drafter == 'ngram'


def test_diagnostics_content(served):
    node, client = served
    assert client.send(make_goal('warm the figures', max_new_tokens=12)).status == 'succeeded'

    def after_a_goal(statuses):  # a status computed while the goal ran may precede the goal's figures
        names = ('gemma_spec_t: engine', 'gemma_spec_t: generation', 'gemma_spec_t: memory')
        return (all(name in statuses for name in names)
                and int(statuses['gemma_spec_t: generation'][2].get('goals succeeded', 0)) >= 1)

    latest = client.diagnostics_sample('gemma_spec_t', 10, after_a_goal)
    assert latest is not None, 'no diagnostics after a goal'
    engine = latest['gemma_spec_t: engine']
    generation = latest['gemma_spec_t: generation']
    memory = latest['gemma_spec_t: memory']
    assert engine[0] in ('OK', 'WARN') and engine[2]['state'] == 'ready'
    for key in ('target model', 'drafter', 'speculation', 'K', 'draft cost ratio c', 'break-even tau',
                'tau (window)', 'tau (lifetime)', 'acceptance rate (window)', 'device'):
        assert key in engine[2], key
    assert engine[2]['target model'] == 'target' and engine[2]['drafter'] == 'ngram'
    assert float(engine[2]['tau (lifetime)']) >= 1.0
    for key in ('decode tokens/s', 'time to first token p50 (s)', 'time to first token p95 (s)',
                'inter-token latency p50 (s)', 'inter-token latency p95 (s)', 'queue depth', 'queue limit',
                'queue wait p50 (s)', 'queue wait p95 (s)', 'goals succeeded', 'goals aborted', 'goals cancelled',
                'goals busy', 'goals timed out', 'goals orphaned'):
        assert key in generation[2], key
    assert int(generation[2]['goals succeeded']) >= 1 and float(generation[2]['decode tokens/s']) > 0
    assert float(memory[2]['process RSS (MiB)']) > 10 and float(memory[2]['MemAvailable (MiB)']) > 0


def test_missing_model_directory_reports_error_and_refuses_goals(context, tiny_models, tmp_path):
    params = tiny_params(tiny_models, **{'engine.target_path': str(tmp_path / 'no_such_model')})
    with serving(context, 'gemma_spec_missing', params) as (node, client):
        assert node.state == 'failed'
        latest = client.diagnostics_sample('gemma_spec_missing', timeout=10)
        assert latest is not None, 'No diagnostics received'
        level, message, values, _ = latest['gemma_spec_missing: engine']
        assert level == 'ERROR' and 'does not exist' in message and values['state'] == 'failed'
        outcome = client.send(make_goal('hello', max_new_tokens=4))
        assert outcome.accepted and outcome.status == 'aborted'
        assert 'engine failed to load' in outcome.result.error and 'no_such_model' in outcome.result.error


class FailingDrafter(Drafter):
    name = 'ngram'

    def propose(self, context, k):
        raise RuntimeError('injected drafter failure')


class FlakyEngine:
    """Wrap the real engine; its next generate raises once when armed."""

    def __init__(self, engine):
        self._engine = engine
        self.fail_next = False

    def generate(self, request, on_delta=None, cancel=None):
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError('injected engine failure')
        return self._engine.generate(request, on_delta=on_delta, cancel=cancel)

    def __getattr__(self, name):
        return getattr(self._engine, name)


def engine_with_failing_drafter(config):
    device = engine_models.resolve_device(config.device)
    dtype = engine_models.resolve_dtype(config.dtype, device)
    target = engine_models.load_causal_lm(config.target_path, 'target', device, dtype)
    tokenizer = engine_models.load_tokenizer(config.target_path)
    drafters = {'none': NoneDrafter(), 'ngram': FailingDrafter()}
    return FlakyEngine(Engine(config, DynamicCausalLM(target), tokenizer, drafters, device, dtype))


def test_drafter_failure_falls_back_and_engine_failure_aborts(context, tiny_models):
    params = tiny_params(tiny_models, **{'engine.assistant_path': '', 'engine.draft_model_path': ''})
    with serving(context, 'gemma_spec_faults', params, engine_factory=engine_with_failing_drafter) as (node, client):
        assert node.state == 'ready'
        outcome = client.send(make_goal('fall back please', max_new_tokens=10, num_draft_tokens=2))
        assert outcome.status == 'succeeded' and outcome.result.error == ''
        assert outcome.result.stats.drafter == 'none' and outcome.result.stats.new_tokens == 10
        assert any('injected drafter failure' in warning for warning in outcome.result.warnings)
        assert outcome.streamed_text == outcome.result.text

        node.backend.fail_next = True
        failed = client.send(make_goal('boom', max_new_tokens=4))
        assert failed.status == 'aborted'
        assert 'engine error: RuntimeError: injected engine failure' in failed.result.error
        again = client.send(make_goal('still serving', max_new_tokens=4, drafter='none'))
        assert again.status == 'succeeded'

        latest = client.diagnostics_sample('gemma_spec_faults', timeout=10)
        engine_values = latest['gemma_spec_faults: engine'][2]
        assert engine_values['drafter fallbacks'] == '1'
        assert 'injected drafter failure' in engine_values['last warning']
        assert latest['gemma_spec_faults: generation'][2]['goals aborted'] == '1'
