"""``python -m gemma_spec_ros node``: run the node until SIGINT or SIGTERM, then let its last results go out."""

import ctypes
import os
import signal
import sys
import threading
import time

import rclpy
from rclpy.exceptions import ParameterException
from rclpy.executors import MultiThreadedExecutor
from rclpy.signals import SignalHandlerOptions
from rclpy.utilities import remove_ros_args

from gemma_spec_ros.ros import diagnostics, parameters
from gemma_spec_ros.ros.node import EXECUTOR_THREADS, GemmaSpecNode

RESULT_GRACE = 0.3  # seconds the executor keeps serving after shutdown: result requests already on their way
HEAP_ARENAS = 2  # glibc malloc arenas of the node process (bound_heap_arenas); MALLOC_ARENA_MAX in the environment wins
M_ARENA_MAX = -8  # glibc's mallopt parameter number (malloc.h)


def bound_heap_arenas(arenas: int = HEAP_ARENAS) -> bool:
    """
    Cap glibc's malloc arenas of this process before the node starts its threads; True when set.

    glibc gives each thread that allocates an arena of its own, up to 8 per core, and each arena keeps resident what
    its thread freed. The node's threads (the executor's pool, which grows to its peak concurrency, the goal workers,
    the batch scheduler) each kept their goals' freed memory, so a soak's RSS crept up as rarer peaks came by on
    other threads; two arenas bound that (the soak row of bench faults). Nothing where the C library is not glibc,
    or where MALLOC_ARENA_MAX is set (glibc read it at start).
    """
    if 'MALLOC_ARENA_MAX' in os.environ:
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    return mallopt(M_ARENA_MAX, arenas) == 1


def main(argv=None) -> int:
    """Run the node: ``python -m gemma_spec_ros node --ros-args ...``; exit code 2 for invalid parameters."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if any(arg in ('-h', '--help') for arg in remove_ros_args(['gemma_spec_node'] + argv)[1:]):
        print('usage: python -m gemma_spec_ros node [--ros-args --params-file config/orin.yaml '
              '-p engine.device:=cpu ...]\n\nParameters:')
        print('\n'.join(parameters.usage_lines()))
        print('  {:<41} {}'.format(diagnostics.PERIOD_PARAMETER, 'seconds between /diagnostics updates'))
        return 0
    bound_heap_arenas()  # before any thread of the node allocates
    # the node's own handlers: a signal ends the goals with results before the context goes down
    rclpy.init(args=['gemma_spec_node'] + argv, signal_handler_options=SignalHandlerOptions.NO)
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    try:
        node = GemmaSpecNode()
    except Exception as error:  # noqa: BLE001 (a clear message, exit code 2)
        invalid = isinstance(error, ValueError | ParameterException)
        print('gemma_spec_node: {}: {}'.format('invalid parameters' if invalid else 'cannot create the node', error),
              file=sys.stderr)
        rclpy.try_shutdown()
        return 2
    executor = MultiThreadedExecutor(num_threads=EXECUTOR_THREADS)
    executor.add_node(node)
    spinner = threading.Thread(target=executor.spin, name='gemma_spec_executor', daemon=True)
    spinner.start()
    while not stop.wait(0.5) and spinner.is_alive():  # a timeout: Python runs signal handlers between waits
        pass
    node.get_logger().info('shutting down')
    node.shutdown()  # ends every goal with a result while the executor still serves
    time.sleep(RESULT_GRACE)
    executor.shutdown(timeout_sec=1.0)
    spinner.join(1.0)
    node.destroy_node()
    rclpy.try_shutdown()
    return 0


if __name__ == '__main__':
    sys.exit(main())
