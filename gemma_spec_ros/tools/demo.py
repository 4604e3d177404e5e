"""
``make run``: stream a planner-style goal through the node's action, show the figures, keep serving until Ctrl-C.

``python -m gemma_spec_ros demo --client`` is the planner side only, against a node that is already running: make run
starts ``ros2 launch gemma_spec_ros orin.launch.py`` and this client as separate processes (scripts/run.sh).
Without --client it first starts the node itself as a subprocess, as orin.launch.py would
(``python -m gemma_spec_ros node --ros-args --params-file ...``). Either way it waits until /diagnostics say the
engine is ready, sends a chat goal for a JSON action plan (constrained by a JSON Schema), streams its
tokens and prints the parsed plan, sends the same goal with plain decoding for comparison, then one image goal (a
table scene rendered by the vision model's scene generator, with its right answer) when /diagnostics say the
backend accepts images (else it says why not), prints tau / latency / memory from the results and one /diagnostics
sample, then serves until Ctrl-C.
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
STEP_SCHEMA = {'type': 'object', 'properties': {'action': {'enum': ['navigate', 'pick', 'place']},
                                                'target': {'type': 'string', 'maxLength': 32}},
               'required': ['action', 'target']}
PLAN_SCHEMA = {'type': 'object', 'properties': {'steps': {'type': 'array', 'items': STEP_SCHEMA, 'minItems': 1,
                                                          'maxItems': 6}}, 'required': ['steps']}
SYSTEM = ('You are the task planner of a mobile manipulator. Answer with a JSON action plan matching this JSON '
          'Schema: ' + json.dumps(PLAN_SCHEMA))
REQUEST = 'Bring the red cup from the kitchen table to the sink.'
TOOL_HINTS = '  python -m gemma_spec_ros client "def plan(robot):" --max-new-tokens 32\n  python -m gemma_spec_ros diag'
ROS2_CLI_HINTS = ('  ros2 action send_goal /gemma_spec/generate gemma_spec_msgs/action/Generate '
                  '"{prompt: \'def plan(robot):\', max_new_tokens: 32}" --feedback\n'
                  '  ros2 topic echo --once /diagnostics\n' + TOOL_HINTS)


# a held-out scene (never trained on) that train/scenes.py rendered, and its question with the right answer
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
    """Say what the two goals' decode steps ran on: a speedup across different paths is not like for like."""
    if speculative == plain:
        return 'both decoded on: {}'.format(speculative)
    return 'not like for like while the node warms up: speculative on {}, plain on {}'.format(speculative, plain)


def print_plan(result):
    """Print the parsed action plan, or why the output holds none."""
    if not result.structure_complete:
        print('\nno complete action plan (finish {}): {}'.format(
            result.finish_reason, '; '.join(result.warnings) or 'the output stopped early'))
        return
    steps = json.loads(result.text)['steps']
    print('\nparsed action plan ({} step{}):'.format(len(steps), '' if len(steps) == 1 else 's'))
    for number, step in enumerate(steps, 1):
        print('  {}. {:<8} {}'.format(number, step['action'], step['target']))


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
    parser.add_argument('--max-new-tokens', type=int, default=192)
    parser.add_argument('--no-compare', action='store_true', help='skip the plain-decoding comparison goal')
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
        goal = dict(messages=[('system', SYSTEM), ('user', REQUEST)], max_new_tokens=args.max_new_tokens,
                    json_schema=json.dumps(PLAN_SCHEMA))
        print('\nplanner request: {}\nplan schema: {}'.format(REQUEST, json.dumps(PLAN_SCHEMA)))
        spec = run_goal(client, 'speculative (node default drafter)', make_goal(**goal), stream=True)
        print_plan(spec.result)
        if not args.no_compare:
            plain = run_goal(client, 'plain decoding (drafter none), same goal', make_goal(drafter='none', **goal),
                             stream=False)
            same = list(plain.result.token_ids) == list(spec.result.token_ids)
            plain_rate = plain.result.stats.tokens_per_second
            ratio = spec.result.stats.tokens_per_second / plain_rate if plain_rate > 0 else math.nan  # NaN: no rate
            print('\nspeculative vs plain: {}x decode tokens/s ({}), identical tokens: {}'.format(
                format_figure(ratio, '{:.2f}'),
                compared_paths(spec.result.stats.decode_path, plain.result.stats.decode_path), same))
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
        client.close()
        rclpy.try_shutdown()
        node_code = 0 if node is None else node.stop()
    if node_code not in (0, -signal.SIGINT):
        print('demo: the node exited with code {}'.format(node_code), file=sys.stderr)
        code = code or 1
    return code


if __name__ == '__main__':
    sys.exit(main())
