"""Command line: ``python -m gemma_spec_ros <command> [--help]``."""

import importlib
import os
import sys

# command -> (module with main(argv) -> int, one-line summary)
COMMANDS = {
    'generate': ('gemma_spec_ros.engine.cli', 'generate text with the speculative engine (no ROS)'),
    'node': ('gemma_spec_ros.ros.main', 'run the ROS 2 node (action ~/generate, /diagnostics)'),
    'client': ('gemma_spec_ros.tools.client_cli', 'send a Generate goal and stream the feedback'),
    'diag': ('gemma_spec_ros.tools.diag_monitor', "show the node's /diagnostics live"),
    'record': ('gemma_spec_ros.tools.bag', 'record planner requests and responses to a rosbag2 bag'),
    'replay': ('gemma_spec_ros.tools.bag', 'replay a recorded bag against the node and compare'),
    'train': ('gemma_spec_ros.train.cli', 'train the tokenizer, target, drafters (source checkout)'),
    'bench': ('gemma_spec_ros.benchmarks', 'benchmarks, peers and studies (source checkout; bench --help lists them)'),
    'demo': ('gemma_spec_ros.tools.demo', 'start the node and stream a planner-style goal (make run)'),
    'stress': ('gemma_spec_ros.tools.stress', 'load and soak the node with concurrent planners and cancels'),
}


# Commands that end with os._exit once they have shut down: the interpreter's teardown of torch and transformers
# (module garbage collection) takes seconds, past the 5 s ros2 launch waits after SIGINT before it sends SIGTERM.
FAST_EXIT_COMMANDS = ('node',)


def usage() -> str:
    lines = ['usage: python -m gemma_spec_ros <command> [args...]', '', 'commands:']
    lines += ['  {:<10} {}'.format(name, summary) for name, (_, summary) in COMMANDS.items()]
    lines += ['', "run 'python -m gemma_spec_ros <command> --help' for a command's options"]
    return '\n'.join(lines)


# The lab's commands: a robot's install leaves their packages out (setup.py), a source checkout has them.
LAB_COMMANDS = ('train', 'bench')


def run_command(name: str, argv: list) -> int:
    module_name, _ = COMMANDS[name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if name not in LAB_COMMANDS or not module_name.startswith(str(error.name)):
            raise
        print("'{}' runs from a source checkout of gemma_spec_ros (scripts/setup.sh): the robot install leaves the "
              'benchmarks and training out'.format(name), file=sys.stderr)
        return 2
    entry = getattr(module, name + '_main', None) or module.main
    return entry(argv) or 0


def exit_process(name: str, code: int):
    """Exit with code; without interpreter teardown for FAST_EXIT_COMMANDS (their main() shut everything down)."""
    if name in FAST_EXIT_COMMANDS:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ('-h', '--help', 'help'):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print('unknown command {!r}\n\n{}'.format(name, usage()), file=sys.stderr)
        return 2
    return run_command(name, rest)


def _console(name):
    def entry():
        exit_process(name, run_command(name, sys.argv[1:]))
    entry.__name__ = name + '_main'
    return entry


node_main = _console('node')
generate_main = _console('generate')
client_main = _console('client')
diag_main = _console('diag')
record_main = _console('record')
replay_main = _console('replay')

if __name__ == '__main__':
    args = sys.argv[1:]
    exit_process(args[0] if args else '', main(args))
