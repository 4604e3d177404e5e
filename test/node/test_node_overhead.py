"""
What the action adds to the engine: decode rate, feedback latency and cancel latency, measured in one process.

Run ``python -m pytest test/node/test_node_overhead.py -s`` to print the figures. The node serves the bundled models
(config/orin.yaml on CPU); the engine alone runs the same greedy requests on the same loaded engine.
"""

import os
import time
from pathlib import Path

import pytest
import rclpy
import yaml
from conftest import TEST_COMPILE
from rclpy.context import Context
from rclpy.executors import MultiThreadedExecutor
from rclpy.parameter import Parameter

from gemma_spec_ros.engine import Engine, GenerationRequest
from gemma_spec_ros.engine.stats import percentile
from gemma_spec_ros.ros.node import QUEUE_MAX_LENGTH_LIMIT, GemmaSpecNode
from gemma_spec_ros.tools.client import BackgroundSpinner, GenerateClient, make_goal

REPO = Path(__file__).resolve().parents[2]
DOMAIN_ID = 11 + (os.getpid() + 5) % 80
PROMPTS = ['def plan(robot):\n    """Drive to the kitchen table and pick up the cup."""\n',
           'import os\nimport sys\n\n\ndef main(argv):\n',
           'The robot should first check the battery level, then']
MAX_NEW_TOKENS = 64


class TimedEngine:
    """The real engine; records when each delta leaves it (time.monotonic, same clock as the client)."""

    def __init__(self, engine):
        self.inner = engine
        self.delta_times = []

    def generate(self, request, on_delta=None, cancel=None):
        def timed(delta):
            self.delta_times.append(time.monotonic())
            on_delta(delta)
        return self.inner.generate(request, on_delta=timed if on_delta else None, cancel=cancel)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def orin_params():
    params = yaml.safe_load((REPO / 'config' / 'orin.yaml').read_text())['/**']['ros__parameters']
    flat = {}
    for group, values in params.items():
        flat.update({'{}.{}'.format(group, key): value for key, value in values.items()})
    flat['engine.device'] = 'cpu'
    flat['engine.compile'] = TEST_COMPILE
    return flat


def wait_for_feedback(arrived, messages, timeout=5.0):
    """
    Wait until the list `arrived` holds `messages` feedback entries.

    The client stops waiting for feedback once the streamed text equals the result's: a last message without text
    (an end-of-turn token) may still be on its way.
    """
    deadline = time.monotonic() + timeout
    while len(arrived) < messages and time.monotonic() < deadline:
        time.sleep(0.01)


def feedback_tokens(outcome):
    """Return the token ids the feedback messages of a goal carried, in order."""
    return [token for feedback in outcome.feedback for token in feedback.token_ids_delta]


def decode_rate(times, tokens):
    """Tokens per second after the first feedback: (tokens - first) / (last - first)."""
    return (sum(tokens) - tokens[0]) / (times[-1] - times[0]) if len(times) > 1 and times[-1] > times[0] else 0.0


@pytest.fixture(scope='module')
def node_and_client():
    os.environ.setdefault('ROS_AUTOMATIC_DISCOVERY_RANGE', 'LOCALHOST')
    context = Context()
    rclpy.init(context=context, domain_id=DOMAIN_ID)
    holder = {}

    def factory(config):
        holder['engine'] = TimedEngine(Engine.from_config(config))
        return holder['engine']

    node = GemmaSpecNode('gemma_spec_overhead', engine_factory=factory, context=context,
                         parameter_overrides=[Parameter(k, value=v) for k, v in orin_params().items()])
    spinner = BackgroundSpinner(node, MultiThreadedExecutor(num_threads=QUEUE_MAX_LENGTH_LIMIT + 6, context=context))
    client = GenerateClient('/gemma_spec_overhead/generate', 'overhead_client', context=context)
    try:
        deadline = time.monotonic() + 300
        while node.state == 'loading' and time.monotonic() < deadline:
            time.sleep(0.05)
        assert node.state == 'ready'
        assert client.wait_for_server(20)
        yield node, client, holder['engine']
    finally:
        node.shutdown()
        client.close()
        spinner.stop()
        node.destroy_node()
        rclpy.try_shutdown(context=context)


def test_action_overhead_feedback_and_cancel_latency(node_and_client):
    node, client, engine = node_and_client
    rows = []
    plain_tokens = {}  # prompt -> the engine's greedy output alone, drafter none
    for drafter in ('none', 'mtp'):
        for prompt in PROMPTS:
            request = GenerationRequest(prompt=prompt, max_new_tokens=MAX_NEW_TOKENS, drafter=drafter)
            alone = engine.inner.generate(request)  # the same loaded engine, no ROS in between
            plain_tokens.setdefault(prompt, list(alone.token_ids))
            engine.delta_times.clear()
            received = []
            outcome = client.send(make_goal(prompt, max_new_tokens=MAX_NEW_TOKENS, drafter=drafter),
                                  on_feedback=lambda f, times=received: times.append(time.monotonic()))
            assert outcome.status == 'succeeded' and list(outcome.result.token_ids) == list(alone.token_ids)
            # the action carries each of the engine's deltas as one feedback message, none lost, merged or added
            wait_for_feedback(received, len(engine.delta_times))
            assert len(received) == len(engine.delta_times), (len(received), len(engine.delta_times))
            assert feedback_tokens(outcome) == list(outcome.result.token_ids)
            assert outcome.streamed_text == outcome.result.text
            latencies = [r - s for r, s in zip(received, engine.delta_times, strict=True)]
            assert all(latency > 0 for latency in latencies)  # one clock: a feedback arrives after its delta left
            tokens = [len(f.token_ids_delta) for f in outcome.feedback]
            rows.append((drafter, alone.stats.tokens_per_second, decode_rate(received, tokens),
                         outcome.result.stats.tokens_per_second, latencies, outcome.result_time,
                         alone.stats.wall_time))

    cancels = []
    for _ in range(3):
        engine.delta_times.clear()
        outcome = client.send(make_goal(PROMPTS[0], max_new_tokens=500, drafter='none'), cancel_after_tokens=8)
        assert outcome.status == 'canceled' and outcome.result.finish_reason == 'cancelled'
        # the engine stopped where the result ends: it sent nothing the client did not get, and the result is the
        # start of the uncancelled greedy output, at least the 8 tokens received before the cancel
        cancelled = list(outcome.result.token_ids)
        wait_for_feedback(outcome.feedback, len(engine.delta_times))
        assert len(engine.delta_times) == len(outcome.feedback) and feedback_tokens(outcome) == cancelled
        assert 8 <= len(cancelled) < 500 and outcome.result.stats.new_tokens == len(cancelled)
        common = min(len(cancelled), len(plain_tokens[PROMPTS[0]]))
        assert cancelled[:common] == plain_tokens[PROMPTS[0]][:common]
        cancels.append((outcome.cancel_latency, outcome.result.stats.new_tokens - 8))

    print('\nthrough the action vs the engine alone (bundled models, CPU, greedy, {} new tokens):'.format(
        MAX_NEW_TOKENS))
    print('{:<6} {:>14} {:>16} {:>14} {:>12} {:>12} {:>12}'.format(
        'drafter', 'engine tok/s', 'client tok/s', 'node tok/s', 'fb p50 ms', 'fb p95 ms', 'fb max ms'))
    all_latencies = []
    for drafter, engine_rate, client_rate, node_rate, latencies, _, _ in rows:
        all_latencies += latencies
        print('{:<6} {:>14.1f} {:>16.1f} {:>14.1f} {:>12.2f} {:>12.2f} {:>12.2f}'.format(
            drafter, engine_rate, client_rate, node_rate, 1e3 * percentile(latencies, 50),
            1e3 * percentile(latencies, 95), 1e3 * max(latencies)))
    engine_mean = sum(r[1] for r in rows) / len(rows)
    client_mean = sum(r[2] for r in rows) / len(rows)
    print('mean decode tok/s: engine alone {:.1f}, received through the action {:.1f} ({:.1%})'.format(
        engine_mean, client_mean, client_mean / engine_mean))
    print('feedback latency (engine delta -> client callback): p50 {:.2f} ms, p95 {:.2f} ms over {} messages'.format(
        1e3 * percentile(all_latencies, 50), 1e3 * percentile(all_latencies, 95), len(all_latencies)))
    print('cancel latency (cancel request -> result at the client): {} ms; extra tokens after the cancel: {}'.format(
        ', '.join('{:.1f}'.format(1e3 * c) for c, _ in cancels), [extra for _, extra in cancels]))
    assert percentile(all_latencies, 95) < 0.5
    assert client_mean > 0.5 * engine_mean
    assert all(latency < 2.0 for latency, _ in cancels)
