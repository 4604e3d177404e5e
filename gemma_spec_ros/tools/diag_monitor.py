"""
Show the node's /diagnostics live in the terminal, like rqt_runtime_monitor.

``python -m gemma_spec_ros diag`` redraws a table on every DiagnosticArray; ``--once`` prints one sample
and exits (1 with 'No diagnostics received' when none arrives in time).
"""

import argparse
import signal
import sys
import time

import rclpy
from rclpy.signals import SignalHandlerOptions

from gemma_spec_ros.tools.client import BackgroundSpinner, DiagnosticsListener


def format_table(latest, stale_after=5.0):
    now = time.monotonic()
    lines = []
    for name in sorted(latest):
        level, message, values, stamp = latest[name]
        if now - stamp > stale_after:
            level = 'STALE'
        lines.append('[{:<5}] {}: {}'.format(level, name, message))
        width = max((len(key) for key in values), default=0)
        lines += ['          {:<{}}  {}'.format(key, width, value) for key, value in values.items()]
    return '\n'.join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog='python -m gemma_spec_ros diag', description=__doc__.strip().split('\n')[0])
    parser.add_argument('--node', default='gemma_spec', help="node name prefix of the statuses ('' for all)")
    parser.add_argument('--once', action='store_true', help='print one sample and exit')
    parser.add_argument('--timeout', type=float, default=10.0, help='seconds to wait for a sample (--once)')
    args, ros_args = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    for signum in (signal.SIGINT, signal.SIGTERM):  # also when started with SIGINT ignored (background)
        signal.signal(signum, signal.default_int_handler)
    rclpy.init(args=['diag'] + ros_args, signal_handler_options=SignalHandlerOptions.NO)
    node = rclpy.create_node('gemma_spec_diag_monitor')
    listener = DiagnosticsListener(node, args.node)
    spinner = BackgroundSpinner(node)
    try:
        if args.once:
            latest = listener.wait(timeout=args.timeout)
            if latest is None:
                print('No diagnostics received on /diagnostics within {} s'.format(args.timeout), file=sys.stderr)
                return 1
            print(format_table(latest))
            return 0
        while True:
            latest = listener.wait(timeout=1.0) or listener.latest()
            sys.stdout.write('\x1b[H\x1b[2J/diagnostics ({})  Ctrl-C to quit\n\n{}\n'.format(
                time.strftime('%H:%M:%S'), format_table(latest) or 'waiting for diagnostics...'))
            sys.stdout.flush()
    except KeyboardInterrupt:
        return 0
    finally:
        spinner.stop()
        node.destroy_node()
        rclpy.try_shutdown()


if __name__ == '__main__':
    sys.exit(main())
