"""
``make run``: stream a planner-style goal through the node's action, show the figures, keep serving until Ctrl-C.

``python -m gemma_spec_ros demo --client`` is the planner side only, against a node that is already running: make run
starts ``ros2 launch gemma_spec_ros orin.launch.py`` and this client as separate processes (scripts/run.sh).
Without --client it first starts the node itself as a subprocess, as orin.launch.py would
(``python -m gemma_spec_ros node --ros-args --params-file ...``). Either way it waits until /diagnostics say the
engine is ready, then runs a planner loop: it sends the request with the robot's tools (config/robot_tools.json),
streams the calls as they form, answers each with a simulated tool result ({"ok": true}) and sends the
conversation back until the model answers; it prints the plan, runs the same loop with plain decoding to compare
tokens and speed, then one image goal (a table scene rendered by the vision model's scene generator, with its
right answer) when /diagnostics say the backend accepts images (else it says why not), prints tau / latency /
memory from the results and one /diagnostics sample, then serves until Ctrl-C.
"""

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import rclpy
from rclpy.signals import SignalHandlerOptions

from gemma_spec_ros.engine.stats import format_figure, format_stats
from gemma_spec_ros.tools.client import GenerateClient, compressed_image_from_file, make_goal

NODE_NAME = 'gemma_spec'
TOOLS_FILE = os.path.join('config', 'robot_tools.json')
# The system turn stays the same on every call; each user turn opens with the scene as the robot sees it now.
SYSTEM = ('You are the task planner of a mobile robot with an arm. Each request starts with the scene as the robot '
          'sees it. Call the tools one at a time to do what the user asks, then answer in one short sentence.')
SCENE = 'a red cup on the kitchen table, a blue bottle on the shelf, a green apple on the counter'
REQUEST = 'Bring the red cup from the kitchen table to the sink.'
# the plan a planner expects for REQUEST: the demo says whether the model's calls are this one
EXPECTED_PLAN = [('navigate_to', {'place': 'kitchen table'}), ('pick', {'object': 'red cup'}),
                 ('navigate_to', {'place': 'sink'}), ('place', {'object': 'red cup', 'place': 'sink'})]
MAX_TURNS = 8   # model replies in one planner loop
TOOL_HINTS = '  python -m gemma_spec_ros client "def plan(robot):" --max-new-tokens 32\n  python -m gemma_spec_ros diag'
ROS2_CLI_HINTS = ('  ros2 action send_goal /gemma_spec/generate gemma_spec_msgs/action/Generate '
                  '"{prompt: \'def plan(robot):\', max_new_tokens: 32}" --feedback\n'
                  '  ros2 topic echo --once /diagnostics\n' + TOOL_HINTS)


# a held-out scene (never trained on) that train/corpora/scenes.py rendered, and its question with the right answer
DEMO_SCENE = os.path.join('models', 'gemma4-spec-vision', 'demo_scene')


def installed(relative: str) -> str:
    """Return a shipped file's path: in this repository when run from it, else in the installed share/."""
    if Path(relative).exists():
        return relative
    from ament_index_python.packages import get_package_share_directory
    return os.path.join(get_package_share_directory('gemma_spec_ros'), relative)


def default_params_file() -> str:
    return installed(os.path.join('config', 'orin.yaml'))


class NodeProcess:
    """The node subprocess; its log lines are echoed with a prefix (all while loading, then warnings only)."""

    def __init__(self, params_file, overrides):
        command = [sys.executable, '-m', 'gemma_spec_ros', 'node', '--ros-args', '--params-file', params_file]
        for override in overrides:
            command += ['-p', override]
        print('$ ' + ' '.join(command[1:] if command[0] == sys.executable else command), flush=True)
        self.quiet = False
        self._process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                         bufsize=1, env=dict(os.environ, PYTHONUNBUFFERED='1'))
        threading.Thread(target=self._echo, daemon=True).start()

    def _echo(self):
        for line in self._process.stdout:
            if not self.quiet or '[WARN]' in line or '[ERROR]' in line:
                sys.stderr.write('[node] ' + line)

    def alive(self):
        return self._process.poll() is None

    def stop(self, timeout=15.0) -> int:
        if self.alive():
            self._process.send_signal(signal.SIGINT)
            try:
                self._process.wait(timeout)
            except subprocess.TimeoutExpired:
                self._process.kill()
        return self._process.wait()


def run_goal(client, label, goal, stream):
    print('\n=== {} ==='.format(label), flush=True)
    on_feedback = (lambda f: (sys.stdout.write(f.text_delta), sys.stdout.flush())) if stream else None
    outcome = client.send(goal, on_feedback=on_feedback)
    if outcome.status != 'succeeded':
        raise RuntimeError('goal {}: {}'.format(outcome.status, outcome.result.error if outcome.result else ''))
    if not stream:
        print(outcome.result.text)
    print('\n--- {}: {} feedback messages, first after {:.3f} s, result after {:.3f} s'.format(
        label, len(outcome.feedback), outcome.first_feedback_latency, outcome.result_time))
    print(format_stats(outcome.result.stats), flush=True)
    return outcome


def compared_paths(speculative: str, plain: str) -> str:
    """Say what the two loops' decode steps ran on: a speedup across different paths is not like for like."""
    if speculative == plain:
        return 'both decoded on: {}'.format(speculative)
    return 'not like for like while the node warms up: speculative on {}, plain on {}'.format(speculative, plain)


def simulate(call) -> dict:
    """Answer a call as the robot would: here it always succeeds."""
    return {'ok': True}


def show_call(call) -> str:
    arguments = json.loads(call.arguments or '{}')
    return '{}({})'.format(call.name, ', '.join('{}={!r}'.format(key, value) for key, value in arguments.items()))


def planner_loop(client, label, tools, max_new_tokens, drafter='', stream=True):
    """
    Run the planner loop once: request, calls, simulated results, until the model answers (or MAX_TURNS).

    Returns (calls made, final answer, every reply's outcome).
    """
    print('\n=== {} ==='.format(label), flush=True)
    messages = [{'role': 'system', 'content': SYSTEM},
                {'role': 'user', 'content': 'Scene: {}.\n{}'.format(SCENE, REQUEST)}]
    calls, outcomes = [], []

    def on_feedback(feedback):
        sys.stdout.write(feedback.text_delta)
        for call in feedback.tool_calls_delta:
            sys.stdout.write('  -> {}'.format(show_call(call)))
        sys.stdout.flush()

    for _ in range(MAX_TURNS):
        goal = make_goal(messages=messages, tools=tools, tool_choice='auto', max_new_tokens=max_new_tokens,
                         drafter=drafter)
        outcome = client.send(goal, on_feedback=on_feedback if stream else None)
        if outcome.status != 'succeeded':
            raise RuntimeError('goal {}: {}'.format(outcome.status, outcome.result.error if outcome.result else ''))
        outcomes.append(outcome)
        result = outcome.result
        if result.finish_reason != 'tool_calls':
            return calls, result.text, outcomes
        messages.append({'role': 'assistant', 'content': result.text, 'tool_calls': [
            {'id': call.id, 'name': call.name, 'arguments': call.arguments} for call in result.tool_calls]})
        for call in result.tool_calls:
            calls.append((call.name, json.loads(call.arguments or '{}')))
            answer = simulate(call)
            if stream:
                sys.stdout.write('  <- {}\n'.format(json.dumps(answer)))
            messages.append({'role': 'tool', 'name': call.name, 'content': json.dumps(answer)})
    return calls, '', outcomes


def loop_figures(outcomes) -> dict:
    """Return a loop's tokens, decode seconds (after each first token), target passes and decode paths."""
    results = [outcome.result for outcome in outcomes]
    return {'tokens': [t for r in results for t in r.token_ids],
            'new_tokens': sum(r.stats.new_tokens for r in results),
            'decode_s': sum(max(r.stats.wall_time - r.stats.time_to_first_token, 0.0) for r in results),
            'passes': sum(r.stats.target_passes for r in results),
            'paths': ', '.join(sorted({r.stats.decode_path for r in results}))}


def print_plan(calls, answer):
    """Print the calls the loop made and the final answer, and whether the plan is the expected one."""
    print('\nplan ({} call{}):'.format(len(calls), '' if len(calls) == 1 else 's'))
    for number, (name, arguments) in enumerate(calls, 1):
        print('  {}. {}({})'.format(number, name, ', '.join('{}={!r}'.format(k, v) for k, v in arguments.items())))
    print('answer: {}'.format(answer or '(none within {} replies)'.format(MAX_TURNS)))
    print('the plan is {} for the request'.format('right' if calls == EXPECTED_PLAN else 'NOT the expected one'))


def image_support(latest) -> str:
    """Return what the node's /diagnostics say of image goals: 'accepted', or 'refused: why'."""
    entry = latest.get('{}: engine'.format(NODE_NAME)) if latest else None
    return entry[2].get('images', 'unknown (no images item on /diagnostics)') if entry else 'unknown (no /diagnostics)'


def run_image_goal(client, max_new_tokens):
    """Ask the question of the demo scene with its image; print the answer against the right one."""
    with open(installed(DEMO_SCENE + '.json'), encoding='utf-8') as stream:
        scene = json.load(stream)
    image = installed(DEMO_SCENE + '.png')
    print('\nimage goal: {} ({}: {})\nquestion: {}'.format(image, scene['split'], scene['layout'], scene['question']))
    goal = make_goal(messages=[('user', scene['question'], [0])], max_new_tokens=max_new_tokens,
                     compressed_images=[compressed_image_from_file(image)])
    outcome = run_goal(client, 'image goal (node default drafter)', goal, stream=True)
    answer = outcome.result.text.strip()
    print('right answer: {}  (the answer is {})'.format(
        scene['answer'], 'right' if answer.rstrip('.').lower() == scene['answer'].lower() else 'wrong'))
    stats = outcome.result.stats
    print('image prefill {:.1f} ms of time to first token {:.1f} ms'.format(
        stats.image_prefill_ms, 1000 * stats.time_to_first_token))


def print_diagnostics(latest):
    print('\n=== /diagnostics ({}) ==='.format(NODE_NAME))
    for name in sorted(latest):
        level, message, values, _ = latest[name]
        print('[{}] {}: {}'.format(level, name, message))
        for key in ('serving', 'graphs ready', 'warm-up s', 'speculation', 'K', 'draft cost ratio c',
                    'break-even tau', 'tau (window)', 'tau (lifetime)',
                    'acceptance rate (window)', 'images', 'decode tokens/s', 'time to first token p95 (s)',
                    'image prefill p50 (ms)', 'inter-token latency p95 (s)', 'process RSS (MiB)', 'MemAvailable (MiB)',
                    'CUDA reserved (MiB)'):
            if key in values:
                print('    {:<28} {}'.format(key, values[key]))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog='python -m gemma_spec_ros demo', description=__doc__.strip().split('\n')[0])
    parser.add_argument('--client', action='store_true',
                        help='only the planner client, against a node already running (e.g. from ros2 launch)')
    parser.add_argument('--params-file', default=None, help='node parameters (default config/orin.yaml)')
    parser.add_argument('-p', '--param', action='append', default=[], metavar='NAME:=VALUE',
                        help='extra node parameter, e.g. engine.device:=cpu (repeatable)')
    parser.add_argument('--max-new-tokens', type=int, default=96, help='per model reply')
    parser.add_argument('--no-compare', action='store_true', help='skip the plain-decoding comparison loop')
    parser.add_argument('--no-image', action='store_true', help='skip the image goal')
    parser.add_argument('--image-max-new-tokens', type=int, default=32)
    parser.add_argument('--once', action='store_true', help='stop the node after the demo goals (no serving)')
    parser.add_argument('--ready-timeout', type=float, default=600.0,
                        help='seconds to wait for the action server, and for each loading step of the node')
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.client and (args.params_file or args.param):
        parser.error('--params-file and --param configure the node this demo starts; --client starts none')
    params_file = None if args.client else os.path.abspath(args.params_file or default_params_file())
    if params_file is not None and not os.path.exists(params_file):
        print('demo: params file {} not found'.format(params_file), file=sys.stderr)
        return 2

    for signum in (signal.SIGINT, signal.SIGTERM):  # also when started with SIGINT ignored (background)
        signal.signal(signum, signal.default_int_handler)
    node = None if args.client else NodeProcess(params_file, args.param)
    rclpy.init(args=['demo'], signal_handler_options=SignalHandlerOptions.NO)
    client = GenerateClient('/{}/generate'.format(NODE_NAME), 'gemma_spec_demo')
    code = 0
    try:
        if not client.wait_for_server(args.ready_timeout) or (node is not None and not node.alive()):
            raise RuntimeError('the node did not start (see the [node] lines above)' if node is not None else
                               'no action server /{}/generate within {} s'.format(NODE_NAME, args.ready_timeout))
        started = time.monotonic()
        client.wait_until_ready(NODE_NAME, args.ready_timeout)
        print('node ready ({:.1f} s after the action server appeared)'.format(time.monotonic() - started))
        if node is not None:
            node.quiet = True
        with open(installed(TOOLS_FILE), encoding='utf-8') as stream:
            tools = stream.read()
        print('\nplanner request: {}\ntools: {}'.format(REQUEST, ', '.join(
            tool['function']['name'] for tool in json.loads(tools))))
        calls, answer, spec = planner_loop(client, 'planner loop, speculative (node default drafter)', tools,
                                           args.max_new_tokens)
        print_plan(calls, answer)
        spec_figures = loop_figures(spec)
        print('{} replies, {} tokens, tau {:.2f} over the loop; its last reply:'.format(
            len(spec), spec_figures['new_tokens'], spec_figures['new_tokens'] / max(spec_figures['passes'], 1)))
        print(format_stats(spec[-1].result.stats), flush=True)
        if not args.no_compare:
            _, _, plain = planner_loop(client, 'planner loop, plain decoding (drafter none)', tools,
                                       args.max_new_tokens, drafter='none', stream=False)
            plain_figures = loop_figures(plain)
            same = plain_figures['tokens'] == spec_figures['tokens']
            ratio = (spec_figures['new_tokens'] / spec_figures['decode_s']) / \
                (plain_figures['new_tokens'] / plain_figures['decode_s']) \
                if spec_figures['decode_s'] > 0 and plain_figures['decode_s'] > 0 else math.nan
            print('\nspeculative vs plain over the loop: {}x decode tokens/s ({}), identical tokens: {}'.format(
                format_figure(ratio, '{:.2f}'), compared_paths(spec_figures['paths'], plain_figures['paths']), same))
        if not args.no_image:
            images = image_support(client.diagnostics_sample(NODE_NAME, timeout=10.0))
            if images == 'accepted':
                run_image_goal(client, args.image_max_new_tokens)
            else:
                print('\nimage goal skipped: images {}'.format(images))
        latest = client.diagnostics_sample(NODE_NAME, timeout=10.0)
        if latest:
            print_diagnostics(latest)
        if not args.once:
            print('\nserving /{}/generate until Ctrl-C; try:\n{}'.format(
                NODE_NAME, ROS2_CLI_HINTS if node is None else TOOL_HINTS), flush=True)
            while node is None or node.alive():
                time.sleep(0.5)
            print('the node exited', file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        print('\nCtrl-C: stopping the ' + ('client' if node is None else 'node'), flush=True)
    except RuntimeError as error:
        print('demo: {}'.format(error), file=sys.stderr)
        code = 1
    finally:
        # a second Ctrl-C must not cut the teardown short: an executor thread left running aborts the interpreter
        # ('terminate called without an active exception'); it is bounded (node.stop escalates to SIGKILL)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        client.close()
        rclpy.try_shutdown()
        node_code = 0 if node is None else node.stop()
    if node_code not in (0, -signal.SIGINT):
        print('demo: the node exited with code {}'.format(node_code), file=sys.stderr)
        code = code or 1
    return code


if __name__ == '__main__':
    sys.exit(main())
