"""``python -m gemma_spec_ros node``: run the node until SIGINT or SIGTERM, then let its last results go out."""

import signal
import sys
import threading
import time

import rclpy
from rclpy.exceptions import ParameterException
from rclpy.executors import MultiThreadedExecutor
from rclpy.signals import SignalHandlerOptions
from rclpy.utilities import remove_ros_args

from gemma_spec_ros.engine.backend import bound_heap_arenas
from gemma_spec_ros.ros import diagnostics, parameters
from gemma_spec_ros.ros.node import EXECUTOR_THREADS, GemmaSpecNode

RESULT_GRACE = 0.3  # seconds the executor keeps serving after shutdown: result requests already on their way
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
