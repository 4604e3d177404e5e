"""record / replay through the real action: node, recorder and replayer each in their own process."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import NO_DIAGNOSTIC_UPDATER, TEST_COMPILE

pytest.importorskip('diagnostic_updater', reason=NO_DIAGNOSTIC_UPDATER)

from gemma_spec_msgs.msg import GenerateResponse
from rclpy.serialization import deserialize_message, serialize_message
from rosbags.rosbag2 import Reader, Writer

from gemma_spec_ros.tools.bag import REQUESTS_TOPIC, RESPONSES_TOPIC, read_bag, typestore

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / 'test' / 'data'
DOMAIN_ID = 11 + (os.getpid() + 41) % 80
REQUESTS = [
    {'request_id': 'greedy-chat', 'messages': [{'role': 'system', 'content': 'You plan robot tasks.'},
                                               {'role': 'user', 'content': 'Bring the cup to the sink.'}],
     'max_new_tokens': 16, 'drafter': 'mtp', 'num_draft_tokens': 2},
    {'request_id': 'greedy-ngram', 'prompt': 'import os\nimport os\nimport', 'max_new_tokens': 16,
     'drafter': 'ngram', 'stop': ['\n\n']},
    {'request_id': 'sampled', 'prompt': 'Robot:', 'max_new_tokens': 16, 'temperature': 0.8, 'top_p': 0.95,
     'seed': 7, 'drafter': 'draft', 'num_draft_tokens': 2},
    {'request_id': 'bad', 'prompt': 'x', 'temperature': 9.0},
]
SAY = {'name': 'say', 'parameters': {'type': 'object', 'properties': {'text': {'type': 'string', 'maxLength': 8}},
                                     'required': ['text']}}
TOOL_REQUESTS = [   # tools as a list and as JSON text; a call and its result sent back
    {'request_id': 'tool-call', 'messages': [{'role': 'user', 'content': 'Greet the user.'}], 'tools': [SAY],
     'tool_choice': 'required', 'max_new_tokens': 256, 'drafter': 'ngram'},
    {'request_id': 'tool-result', 'messages': [
        {'role': 'user', 'content': 'Say hello.'},
        {'role': 'assistant', 'content': '',
         'tool_calls': [{'id': 'call_0', 'name': 'say', 'arguments': {'text': 'hi'}}]},
        {'role': 'tool', 'name': 'say', 'content': {'ok': True}}],
     'tools': json.dumps([SAY]), 'parallel_tool_calls': False, 'thinking': True, 'max_thinking_tokens': 2,
     'max_new_tokens': 8, 'drafter': 'none'},
]


BUNDLED_DOMAIN_ID = DOMAIN_ID + 1  # apart from the tiny-model node, which also serves /gemma_spec/generate


def ros_env(domain_id=DOMAIN_ID):
    return dict(os.environ, ROS_DOMAIN_ID=str(domain_id), ROS_AUTOMATIC_DISCOVERY_RANGE='LOCALHOST',
                PYTHONUNBUFFERED='1')


def run_cli(*args, timeout=300, domain_id=DOMAIN_ID):
    return subprocess.run([sys.executable, '-m', 'gemma_spec_ros', *args], env=ros_env(domain_id),
                          capture_output=True, text=True, timeout=timeout, cwd=REPO)


class NodeProcess:
    """The node in its own process; one torch thread keeps a shared 2-core machine from oversubscribing."""

    def __init__(self, *ros_args, domain_id=DOMAIN_ID):
        self.process = subprocess.Popen(
            [sys.executable, '-m', 'gemma_spec_ros', 'node', '--ros-args', *ros_args], env=ros_env(domain_id), cwd=REPO,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def stop(self):
        self.process.send_signal(signal.SIGINT)
        output, _ = self.process.communicate(timeout=30)
        return self.process.returncode, output


@pytest.fixture(scope='module')
def tiny_node(tiny_models):
    node = NodeProcess('-p', 'engine.target_path:=' + tiny_models.target,
                       '-p', 'engine.assistant_path:=' + tiny_models.assistant,
                       '-p', 'engine.draft_model_path:=' + tiny_models.draft, '-p', 'engine.device:=cpu',
                       '-p', 'engine.num_threads:=1', '-p', 'engine.compile:=' + TEST_COMPILE)
    yield node
    code, output = node.stop()
    assert code == 0, output


def test_record_then_replay(tiny_node, tmp_path):
    requests = tmp_path / 'requests.jsonl'
    requests.write_text(''.join(json.dumps(r) + '\n' for r in REQUESTS + TOOL_REQUESTS))
    bag = tmp_path / 'bag'
    recorded = run_cli('record', str(requests), '--output', str(bag))
    assert recorded.returncode == 0, recorded.stdout + recorded.stderr

    # the bag reads back with rosbags' own CDR decoder too (interoperability), and with rclpy
    store = typestore()
    with Reader(bag) as reader:
        assert {c.topic for c in reader.connections} == {REQUESTS_TOPIC, RESPONSES_TOPIC}
        for connection, _, data in reader.messages():
            decoded = store.deserialize_cdr(data, connection.msgtype)
            assert decoded.request_id in {r['request_id'] for r in REQUESTS + TOOL_REQUESTS}
    requests_in_bag, responses = read_bag(bag)
    assert [r.request_id for _, r in requests_in_bag] == [r['request_id'] for r in REQUESTS + TOOL_REQUESTS]
    assert responses['greedy-chat'].status == 'succeeded' and responses['greedy-chat'].stats.new_tokens == 16
    assert responses['bad'].status == 'aborted' and 'temperature' in responses['bad'].error
    assert responses['sampled'].stats.drafter in ('draft', 'none')
    tool_request = next(r for _, r in requests_in_bag if r.request_id == 'tool-result')
    assert json.loads(tool_request.tools) == [SAY] and tool_request.thinking and tool_request.max_thinking_tokens == 2
    assert not tool_request.parallel_tool_calls and requests_in_bag[0][1].parallel_tool_calls   # default true
    assert tool_request.messages[1].tool_calls[0].name == 'say' and tool_request.messages[2].name == 'say'
    called = responses['tool-call']
    assert called.status == 'succeeded' and called.finish_reason == 'tool_calls', called.error
    assert called.tool_calls and {c.name for c in called.tool_calls} == {'say'}
    assert responses['tool-result'].status == 'succeeded', responses['tool-result'].error

    replayed = run_cli('replay', str(bag), '--output', str(tmp_path / 'replay'), '--storage', 'sqlite3')
    assert replayed.returncode == 0, replayed.stdout + replayed.stderr
    assert 'greedy parity: 4/4 identical; 0 of 6 requests failed' in replayed.stdout
    assert len(read_bag(tmp_path / 'replay')[0]) == len(REQUESTS + TOOL_REQUESTS)


def test_replay_reports_a_greedy_mismatch(tiny_node, tmp_path):
    requests = tmp_path / 'requests.jsonl'
    requests.write_text(json.dumps(REQUESTS[1]) + '\n')
    bag = tmp_path / 'bag'
    assert run_cli('record', str(requests), '--output', str(bag)).returncode == 0
    tampered = tmp_path / 'tampered'
    store = typestore()
    with Reader(bag) as reader, Writer(tampered, version=9) as writer:
        connections = {c.topic: writer.add_connection(c.topic, c.msgtype, typestore=store)
                       for c in reader.connections}
        for connection, timestamp, data in reader.messages():
            if connection.topic == RESPONSES_TOPIC:
                response = deserialize_message(bytes(data), GenerateResponse)
                response.token_ids = list(response.token_ids[:-1]) + [response.token_ids[-1] + 1]
                data = serialize_message(response)
            writer.write(connections[connection.topic], timestamp, data)
    replayed = run_cli('replay', str(tampered))
    assert replayed.returncode == 1
    assert 'FAIL' in replayed.stdout and 'greedy tokens differ from position' in replayed.stdout


def committed_bags():
    return sorted(p for p in DATA.glob('*') if (p / 'metadata.yaml').exists())


def test_replay_committed_bags_on_the_bundled_models():
    bags = committed_bags()
    assert bags, 'no committed bags under test/data'
    node = NodeProcess('--params-file', str(REPO / 'config' / 'orin.yaml'), '-p', 'engine.device:=cpu',
                       '-p', 'engine.num_threads:=1', '-p', 'engine.compile:=' + TEST_COMPILE,
                       domain_id=BUNDLED_DOMAIN_ID)
    try:
        for bag in bags:
            replayed = run_cli('replay', str(bag), timeout=600, domain_id=BUNDLED_DOMAIN_ID)
            assert replayed.returncode == 0, '{}:\n{}{}'.format(bag.name, replayed.stdout, replayed.stderr)
            assert ' 0 of ' in replayed.stdout
    finally:
        code, output = node.stop()
    assert code == 0, output
