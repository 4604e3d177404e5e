"""
Record planner requests and the node's responses to a rosbag2 bag, and replay such a bag against the node.

``record``: sends each request of a JSONL file (GenerateRequest fields; images and compressed_images as lists of
PNG/JPEG paths, relative to the file: images are decoded to rgb8; messages as make_goal takes them, tool_calls and
name included; tools as JSON text or a list) as a Generate goal through the real action,
publishes and writes GenerateRequest on /gemma_spec/requests and GenerateResponse on /gemma_spec/responses (rosbags
writer, mcap or sqlite3; CDR bytes from rclpy.serialization).
``replay``: sends each recorded request again in order (optionally at the recorded rate), requires greedy
responses to match token for token, compares sampled ones by their statistics, reports tau and latency
against the recording, and can write the replay as a new bag.
"""

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path

import rclpy
from gemma_spec_msgs.msg import GenerateRequest, GenerateResponse
from rclpy.serialization import serialize_message
from rclpy.signals import SignalHandlerOptions
from rosbags.rosbag2 import Reader, StoragePlugin, Writer
from rosbags.typesys import Stores, get_types_from_msg, get_typestore
from rosidl_runtime_py import set_message_fields

from gemma_spec_ros.engine.stats import format_figure
from gemma_spec_ros.ros.conversions import stats_to_msg
from gemma_spec_ros.tools.client import (
    GenerateClient,
    chat_message,
    compressed_image_from_file,
    image_from_file,
    make_goal,
    tools_text,
)

REQUESTS_TOPIC = '/gemma_spec/requests'
RESPONSES_TOPIC = '/gemma_spec/responses'
MSG_TYPES = ('ToolCall', 'ChatMessage', 'GenerationStats', 'GenerateRequest', 'GenerateResponse')
REQUEST_FIELDS = ('request_id', 'prompt', 'messages', 'images', 'compressed_images', 'max_new_tokens', 'temperature',
                  'top_p', 'top_k', 'stop', 'seed', 'drafter', 'num_draft_tokens', 'tools', 'tool_choice',
                  'parallel_tool_calls', 'thinking', 'max_thinking_tokens', 'cancel_after_seconds')


def typestore():
    """Return a rosbags typestore (Jazzy) with gemma_spec_msgs registered from the installed .msg files."""
    from ament_index_python.packages import get_package_share_directory
    share = Path(get_package_share_directory('gemma_spec_msgs')) / 'msg'
    store = get_typestore(Stores.ROS2_JAZZY)
    types = {}
    for name in MSG_TYPES:
        types.update(get_types_from_msg((share / (name + '.msg')).read_text(), 'gemma_spec_msgs/msg/' + name))
    store.register(types)
    return store


def request_from_dict(fields: dict, index: int, base: Path = Path('.')) -> GenerateRequest:
    """
    Build a GenerateRequest from one JSONL object; ValueError naming unknown fields.

    images and compressed_images hold image file paths (relative to base): images are decoded to rgb8
    sensor_msgs/Image, compressed_images are sent as they are.
    """
    unknown = sorted(set(fields) - set(REQUEST_FIELDS))
    if unknown:
        raise ValueError('request {}: unknown field(s) {}; known: {}'.format(index, unknown, ', '.join(REQUEST_FIELDS)))
    request = GenerateRequest(request_id=str(fields.get('request_id', 'r{:03d}'.format(index))))
    readers = {'images': image_from_file, 'compressed_images': compressed_image_from_file}
    for name in REQUEST_FIELDS[1:]:
        if name == 'messages':
            request.messages = [chat_message(m) for m in fields.get(name, [])]
        elif name == 'tools':
            request.tools = tools_text(fields.get(name, ''))
        elif name in readers:
            setattr(request, name, [readers[name](base / path) for path in fields.get(name, [])])
        elif name in fields:
            setattr(request, name, fields[name])
    return request


def goal_from_request(request: GenerateRequest):
    return make_goal(request.prompt, request.messages, request.max_new_tokens, request.temperature, request.top_p,
                     request.top_k, request.stop, request.seed, request.drafter, request.num_draft_tokens,
                     images=request.images, compressed_images=request.compressed_images, tools=request.tools,
                     tool_choice=request.tool_choice, parallel_tool_calls=request.parallel_tool_calls,
                     thinking=request.thinking,
                     max_thinking_tokens=request.max_thinking_tokens)


def run_request(client, request: GenerateRequest) -> GenerateResponse:
    """Send one request as a goal; return the response as it is recorded."""
    outcome = client.send(goal_from_request(request), cancel_after_seconds=request.cancel_after_seconds)
    response = GenerateResponse(request_id=request.request_id, accepted=outcome.accepted, status=outcome.status,
                                feedback_messages=len(outcome.feedback),
                                first_feedback_latency=outcome.first_feedback_latency)
    response.stamp = client.node.get_clock().now().to_msg()
    if outcome.result is not None:
        result = outcome.result
        response.text, response.token_ids = result.text, list(result.token_ids)
        response.finish_reason, response.error = result.finish_reason, result.error
        response.stats = stats_to_msg(result.stats, response.stats)
        response.reasoning, response.tool_calls = result.reasoning, list(result.tool_calls)
    return response


class BagWriter:
    """Writes requests and responses (and publishes them) while a session runs."""

    def __init__(self, path, storage, node):
        plugin = {'mcap': StoragePlugin.MCAP, 'sqlite3': StoragePlugin.SQLITE3}[storage]
        store = typestore()
        self._writer = Writer(path, version=9, storage_plugin=plugin)
        self._writer.open()
        self._connections = {
            REQUESTS_TOPIC: self._writer.add_connection(REQUESTS_TOPIC, 'gemma_spec_msgs/msg/GenerateRequest',
                                                        typestore=store),
            RESPONSES_TOPIC: self._writer.add_connection(RESPONSES_TOPIC, 'gemma_spec_msgs/msg/GenerateResponse',
                                                         typestore=store)}
        self._publishers = {REQUESTS_TOPIC: node.create_publisher(GenerateRequest, REQUESTS_TOPIC, 10),
                            RESPONSES_TOPIC: node.create_publisher(GenerateResponse, RESPONSES_TOPIC, 10)}

    def write(self, topic, message):
        self._publishers[topic].publish(message)
        self._writer.write(self._connections[topic], time.time_ns(), serialize_message(message))

    def close(self):
        self._writer.close()


def read_bag(path):
    """
    Return (requests, responses by request_id) from a bag written by record.

    A bag outlives changes to the messages: each is read with the definitions stored in the bag and carried into
    today's message by field name, so that a field added since keeps its default and a removed one is dropped.
    """
    requests, responses = [], {}
    with Reader(path) as reader:
        recorded_types = _recorded_typestore(reader)
        wanted = [c for c in reader.connections if c.topic in (REQUESTS_TOPIC, RESPONSES_TOPIC)]
        for connection, timestamp, data in reader.messages(connections=wanted):
            recorded = recorded_types.deserialize_cdr(bytes(data), connection.msgtype)
            if connection.topic == REQUESTS_TOPIC:
                requests.append((timestamp, _as_current(recorded, GenerateRequest)))
            else:
                response = _as_current(recorded, GenerateResponse)
                responses[response.request_id] = response
    requests.sort(key=lambda pair: pair[0])
    return requests, responses


def _recorded_typestore(reader):
    """Return a typestore with the message definitions the bag was written with."""
    store = get_typestore(Stores.ROS2_JAZZY)
    for connection in reader.connections:
        if connection.msgdef.data:
            store.register(get_types_from_msg(connection.msgdef.data, connection.msgtype))
    return store


def _as_current(recorded, message_type):
    """Return a message of today's message_type with the fields of a message read with the recorded definitions."""
    message = message_type()
    set_message_fields(message, _fields_of(recorded, message))
    return message


def _fields_of(recorded, current) -> dict:
    """Return the recorded message's values as a dict, keeping only the fields current has (nested alike)."""
    fields = {}
    for name in current.get_fields_and_field_types():
        if not hasattr(recorded, name):
            continue
        value, today = getattr(recorded, name), getattr(current, name)
        if dataclasses.is_dataclass(value):
            value = _fields_of(value, today)
        elif isinstance(value, list) and value and dataclasses.is_dataclass(value[0]):
            element = _element_type(current, name)()
            value = [_fields_of(item, element) for item in value]
        elif hasattr(value, 'tolist'):  # a numeric array
            value = value.tolist()
        fields[name] = value
    return fields


def _element_type(message, field_name: str):
    """Return the message class of a sequence field's elements (e.g. ChatMessage for GenerateRequest.messages)."""
    from rosidl_runtime_py.utilities import get_message

    field_type = message.get_fields_and_field_types()[field_name]  # e.g. 'sequence<gemma_spec_msgs/ChatMessage>'
    return get_message(field_type.split('<', 1)[1].rstrip('>').replace('/', '/msg/', 1))


def _session(args, prog):
    rclpy.init(args=[prog], signal_handler_options=SignalHandlerOptions.NO)
    client = GenerateClient(args.action, 'gemma_spec_' + prog)
    if not client.wait_for_server(args.ready_timeout):
        raise RuntimeError('no action server {} within {} s'.format(args.action, args.ready_timeout))
    client.wait_until_ready(args.node, args.ready_timeout)
    return client


def _common_arguments(parser):
    parser.add_argument('--action', default='/gemma_spec/generate', help='Generate action (default %(default)s)')
    parser.add_argument('--node', default='gemma_spec', help='node name on /diagnostics (readiness)')
    parser.add_argument('--storage', choices=('mcap', 'sqlite3'), default='mcap', help='bag storage format')
    parser.add_argument('--ready-timeout', type=float, default=300.0, help='seconds to wait for the node')


def record_main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog='python -m gemma_spec_ros record',
                                     description='Send JSONL requests through the action and record a rosbag2 bag.')
    parser.add_argument('requests', help='JSONL file, one GenerateRequest object per line')
    parser.add_argument('--output', '-o', required=True, help='bag directory to create')
    _common_arguments(parser)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    with open(args.requests, encoding='utf-8') as stream:
        requests = [request_from_dict(json.loads(line), i, Path(args.requests).parent)
                    for i, line in enumerate(stream) if line.strip()]
    if os.path.exists(args.output):
        print('record: {} exists; choose a new --output'.format(args.output), file=sys.stderr)
        return 2
    client = writer = None
    try:
        client = _session(args, 'record')
        writer = BagWriter(args.output, args.storage, client.node)
        for request in requests:
            request.stamp = client.node.get_clock().now().to_msg()
            writer.write(REQUESTS_TOPIC, request)
            response = run_request(client, request)
            writer.write(RESPONSES_TOPIC, response)
            print('{:<12} {:<9} {:>4} tokens  tau {}  {}'.format(
                request.request_id, response.status, response.stats.new_tokens,
                format_figure(response.stats.tau, '{:.2f}'),
                response.error or repr(response.text[:40])), flush=True)
    except RuntimeError as error:
        print('record: {}'.format(error), file=sys.stderr)
        return 1
    finally:
        if writer is not None:
            writer.close()
        if client is not None:
            client.close()
        rclpy.try_shutdown()
    print('recorded {} requests to {}'.format(len(requests), args.output))
    return 0


def compare(request, recorded, replayed, tau_tolerance):
    """Return (ok, verdict) for one replayed response against the recorded one."""
    if recorded is None:
        return False, 'no recorded response'
    if replayed.status != recorded.status:
        return False, 'status {} != recorded {}'.format(replayed.status, recorded.status)
    if recorded.status != 'succeeded':
        return True, 'same status'
    if request.temperature == 0:
        if list(replayed.token_ids) != list(recorded.token_ids):
            same = next((i for i, (a, b) in enumerate(zip(replayed.token_ids, recorded.token_ids, strict=False))
                         if a != b), min(len(replayed.token_ids), len(recorded.token_ids)))
            return False, 'greedy tokens differ from position {}'.format(same)
        return True, 'greedy: identical tokens'
    if replayed.finish_reason != recorded.finish_reason:
        return False, 'finish_reason {} != recorded {}'.format(replayed.finish_reason, recorded.finish_reason)
    new, old = replayed.stats, recorded.stats
    if old.drafted_tokens and abs(new.tau - old.tau) > tau_tolerance * old.tau:
        return False, 'sampled: tau {:.2f} vs recorded {:.2f}'.format(new.tau, old.tau)
    return True, 'sampled: same finish, tau within {:.0%}{}'.format(
        tau_tolerance, ', identical tokens' if list(replayed.token_ids) == list(recorded.token_ids) else '')


def _mean(values):
    values = [v for v in values if v > 0 and math.isfinite(v)]
    return sum(values) / len(values) if values else math.nan


def replay_main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog='python -m gemma_spec_ros replay',
                                     description='Replay a recorded bag against the node and compare the responses.')
    parser.add_argument('bag', help='bag directory written by record')
    parser.add_argument('--rate', type=float, default=0.0,
                        help='send at this multiple of the recorded rate (0 = one after another, default)')
    parser.add_argument('--output', '-o', default='', help='write the replay to this new bag')
    parser.add_argument('--tau-tolerance', type=float, default=0.5,
                        help='relative tau difference allowed for sampled requests (default %(default)s)')
    _common_arguments(parser)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    requests, recorded = read_bag(args.bag)
    if not requests:
        print('replay: no requests on {} in {}'.format(REQUESTS_TOPIC, args.bag), file=sys.stderr)
        return 2
    client = writer = None
    failures, rows = 0, []
    try:
        client = _session(args, 'replay')
        if args.output:
            writer = BagWriter(args.output, args.storage, client.node)
        start_wall, start_bag = time.monotonic(), requests[0][0]
        for timestamp, request in requests:
            if args.rate > 0:
                delay = (timestamp - start_bag) / 1e9 / args.rate - (time.monotonic() - start_wall)
                time.sleep(max(0.0, delay))
            if writer is not None:
                request.stamp = client.node.get_clock().now().to_msg()
                writer.write(REQUESTS_TOPIC, request)
            response = run_request(client, request)
            if writer is not None:
                writer.write(RESPONSES_TOPIC, response)
            old = recorded.get(request.request_id)
            ok, verdict = compare(request, old, response, args.tau_tolerance)
            failures += not ok
            rows.append((request, old, response))
            figures = [format_figure(getattr(stats, key) if stats is not None else math.nan, spec)   # '-': no data
                       for key, spec in (('tau', '{:5.2f}'), ('time_to_first_token', '{:6.3f}'),
                                         ('tokens_per_second', '{:7.1f}'))
                       for stats in (old.stats if old else None, response.stats)]
            print('{:<4} {:<12} {:<9} tau {} -> {}  ttft {} -> {} s  {} -> {} tok/s  {}'.format(
                'ok' if ok else 'FAIL', request.request_id, response.status, *figures, verdict), flush=True)
    except RuntimeError as error:
        print('replay: {}'.format(error), file=sys.stderr)
        return 1
    finally:
        if writer is not None:
            writer.close()
        if client is not None:
            client.close()
        rclpy.try_shutdown()
    done = [(old, new) for _, old, new in rows if old is not None and new.status == 'succeeded']
    for label, key in (('tau', 'tau'), ('time to first token (s)', 'time_to_first_token'),
                       ('decode tokens/s', 'tokens_per_second'), ('inter-token latency p95 (s)',
                                                                 'inter_token_latency_p95')):
        print('{:<28} recorded {:>8}   replay {:>8}'.format(
            label, *(format_figure(_mean([getattr(pair[side].stats, key) for pair in done])) for side in (0, 1))))
    greedy = [(r, o, n) for r, o, n in rows if r.temperature == 0 and o is not None and o.status == 'succeeded']
    print('greedy parity: {}/{} identical; {} of {} requests failed'.format(
        sum(list(o.token_ids) == list(n.token_ids) for _, o, n in greedy), len(greedy), failures, len(rows)))
    return 1 if failures else 0

