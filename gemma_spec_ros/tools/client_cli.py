"""
Send a Generate goal and stream its feedback, like ``ros2 action send_goal --feedback``.

``python -m gemma_spec_ros client "prompt" [--image PATH] [--max-new-tokens N] [--cancel-after N] ...`` prints the
text as it streams, then the goal status and the result's statistics. With ``--tools FILE`` (a JSON list of tools)
and ``--thinking`` it also streams the thoughts and prints the reply's tool calls (docs/tools.md). The client
itself is GenerateClient (client.py).
"""

import argparse
import json
import sys

import rclpy
from rclpy.signals import SignalHandlerOptions

from gemma_spec_ros.engine.config_file import read_constraint_files
from gemma_spec_ros.engine.stats import format_stats
from gemma_spec_ros.tools.client import (
    DEFAULT_ACTION,
    GenerateClient,
    compressed_image_from_file,
    image_from_file,
    make_goal,
)


class FeedbackPrinter:
    """
    A feedback callback that writes the stream as it comes: thoughts, answer text and completed tool calls.

    Thoughts follow a '[thinking]' mark and the answer after them an '[answer]' mark (a reply without thoughts is
    written as it is); each tool call is a line of its own.
    """

    def __init__(self, stream):
        self._stream = stream
        self._part = ''        # what was written last: '', 'thinking', 'answer' or 'call'
        self._newline = True   # the last character written ends a line (or nothing was written)

    def __call__(self, feedback):
        if feedback.reasoning_delta:
            self._write('thinking', feedback.reasoning_delta, '[thinking] ')
        if feedback.text_delta:
            self._write('answer', feedback.text_delta, '[answer] ' if self._part in ('thinking', 'call') else '')
        for call in feedback.tool_calls_delta:
            self._write('call', '[tool call {}] {} {}\n'.format(call.id, call.name, call.arguments), '')
        self._stream.flush()

    def _write(self, part, text, mark):
        if part != self._part or part == 'call':
            if (mark or part == 'call') and not self._newline:
                self._stream.write('\n')
            self._stream.write(mark)
        self._stream.write(text)
        self._part, self._newline = part, text.endswith('\n')


def read_tools_file(path) -> str:
    """Return a tools file's text (a JSON list of tools); ValueError naming the file when it is not a JSON list."""
    with open(path, encoding='utf-8') as stream:
        text = stream.read()
    try:
        tools = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError('{}: not valid JSON ({})'.format(path, error)) from error
    if not isinstance(tools, list):
        raise ValueError('{}: a JSON list of tools is expected'.format(path))
    return text


def _message(text):
    role, sep, content = text.partition(':')
    if not sep:
        raise argparse.ArgumentTypeError('--message takes ROLE:CONTENT, e.g. user:hello')
    return role, content


def show_images(messages, count: int) -> list[tuple]:
    """Return (role, content) messages with images 0..count-1 shown before the last user turn's text."""
    users = [index for index, (role, _) in enumerate(messages) if role == 'user']
    if not users:
        raise ValueError('images need a user turn to show them: add --message user:TEXT')
    return [(role, content, range(count) if index == users[-1] else ())
            for index, (role, content) in enumerate(messages)]


def build_parser():
    parser = argparse.ArgumentParser(prog='python -m gemma_spec_ros client',
                                     description=__doc__.strip().split('\n')[0])
    parser.add_argument('prompt', nargs='?', default='', help='raw text prompt (ignored with --message)')
    parser.add_argument('--message', '-m', action='append', type=_message, default=[], metavar='ROLE:CONTENT',
                        help='chat turn, repeatable (rendered with the chat template)')
    parser.add_argument('--image', action='append', default=[], metavar='PATH',
                        help='PNG or JPEG file sent as it is (sensor_msgs/CompressedImage), shown before the text of '
                             'the last user turn (a prompt becomes a user turn); repeatable')
    parser.add_argument('--raw-image', action='append', default=[], metavar='PATH',
                        help='PNG or JPEG file sent decoded (sensor_msgs/Image, rgb8), as a camera driver '
                             'publishes; shown before the --image files; repeatable')
    parser.add_argument('--max-new-tokens', type=int, default=0, help='0 = node default')
    parser.add_argument('--temperature', type=float, default=0.0, help='0 = greedy')
    parser.add_argument('--top-p', type=float, default=0.0, help='0 = off')
    parser.add_argument('--top-k', type=int, default=0, help='0 = off')
    parser.add_argument('--stop', action='append', default=[], help='stop string, repeatable')
    parser.add_argument('--seed', type=int, default=-1, help='-1 = random')
    parser.add_argument('--drafter', default='', help="none|mtp|draft|ngram|lookahead|eagle3|auto ('' = node default)")
    parser.add_argument('--num-draft-tokens', type=int, default=0, help='K, 0 = adaptive')
    parser.add_argument('--json-schema', metavar='FILE', help='JSON Schema file the output must match')
    parser.add_argument('--grammar', metavar='FILE', help='EBNF grammar file (xgrammar syntax, rule root)')
    parser.add_argument('--json-free-whitespace', action='store_true',
                        help='allow up to 16 whitespace characters between JSON elements (default: compact JSON)')
    parser.add_argument('--json-schema-unenforced', default='', choices=('', 'refuse', 'check'),
                        help='a json_schema keyword the grammar cannot enforce: refuse the goal (default) or check '
                             '(generate without it, validate the output at the end)')
    parser.add_argument('--tools', metavar='FILE',
                        help='JSON file with a list of tools the reply may call (e.g. config/robot_tools.json)')
    parser.add_argument('--tool-choice', default='', metavar='CHOICE',
                        help="auto|none|required|a tool's name ('' = auto with tools)")
    parser.add_argument('--one-call', action='store_true',
                        help='at most one tool call per reply (parallel_tool_calls false)')
    parser.add_argument('--thinking', action='store_true', help='let the model think first (streams its thoughts)')
    parser.add_argument('--max-thinking-tokens', type=int, default=0, metavar='N',
                        help='thought tokens before the thoughts are closed (0 = no budget; needs --thinking)')
    parser.add_argument('--cancel-after', type=int, default=0, metavar='N', help='cancel after N tokens')
    parser.add_argument('--action', default=DEFAULT_ACTION, help='action name (default %(default)s)')
    parser.add_argument('--server-timeout', type=float, default=30.0, help='seconds to wait for the server')
    parser.add_argument('--retries', type=int, default=0,
                        help='send the goal again this many times when its server is lost (killed, respawned)')
    parser.add_argument('--quiet', '-q', action='store_true', help='do not stream the text')
    return parser


def main(argv=None) -> int:
    args, ros_args = build_parser().parse_known_args(sys.argv[1:] if argv is None else argv)
    if not args.prompt and not args.message:
        print('client: give a prompt or --message ROLE:CONTENT', file=sys.stderr)
        return 2
    try:
        constraint = read_constraint_files(args.json_schema, args.grammar)
        tools = read_tools_file(args.tools) if args.tools else ''
        images = [image_from_file(path) for path in args.raw_image]
        compressed_images = [compressed_image_from_file(path) for path in args.image]
        messages = show_images(args.message or [('user', args.prompt)], len(images) + len(compressed_images)) \
            if images or compressed_images else args.message
    except (OSError, ValueError) as error:
        print('client: {}'.format(error), file=sys.stderr)
        return 2
    goal = make_goal(args.prompt, messages, args.max_new_tokens, args.temperature, args.top_p, args.top_k,
                     args.stop, args.seed, args.drafter, args.num_draft_tokens,
                     json_free_whitespace=args.json_free_whitespace,
                     json_schema_unenforced=args.json_schema_unenforced, images=images,
                     compressed_images=compressed_images, tools=tools, tool_choice=args.tool_choice,
                     parallel_tool_calls=not args.one_call, thinking=args.thinking,
                     max_thinking_tokens=args.max_thinking_tokens, **constraint)
    rclpy.init(args=['client'] + ros_args, signal_handler_options=SignalHandlerOptions.NO)
    client = GenerateClient(args.action)
    try:
        if not client.wait_for_server(args.server_timeout):
            print('client: no action server {} within {} s'.format(args.action, args.server_timeout),
                  file=sys.stderr)
            return 1

        stream = FeedbackPrinter(sys.stdout) if not args.quiet else None
        outcome = client.send(goal, on_feedback=stream, cancel_after_tokens=args.cancel_after, retries=args.retries,
                              server_timeout=args.server_timeout)
    except KeyboardInterrupt:
        return 130
    finally:
        client.close()
        rclpy.try_shutdown()
    print('\n---')
    print('status: {}  feedback messages: {}  first feedback after {:.3f} s  result after {:.3f} s'.format(
        outcome.status, len(outcome.feedback), outcome.first_feedback_latency, outcome.result_time))
    if outcome.cancel_time:
        print('cancel requested at {:.3f} s, result {:.3f} s later'.format(outcome.cancel_time,
                                                                         outcome.cancel_latency))
    if outcome.result is not None:
        print('finish_reason: {}'.format(outcome.result.finish_reason))
        if goal.json_schema or goal.grammar:
            print('structure_complete: {}'.format(outcome.result.structure_complete))
        if outcome.result.error:
            print('error: {}'.format(outcome.result.error))
        for warning in outcome.result.warnings:
            print('warning: {}'.format(warning))
        if outcome.result.reasoning:
            print('reasoning: {}'.format(outcome.result.reasoning))
        for call in outcome.result.tool_calls:
            print('tool_call {}: {} {}'.format(call.id, call.name, call.arguments))
        print(format_stats(outcome.result.stats))
    if outcome.status == 'succeeded' or (outcome.status == 'canceled' and args.cancel_after):
        return 0
    return 1


if __name__ == '__main__':
    sys.exit(main())

