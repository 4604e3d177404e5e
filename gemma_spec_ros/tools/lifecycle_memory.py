"""
Measure what the managed node holds in each lifecycle state: ``python -m gemma_spec_ros.tools.lifecycle_memory``.

Starts the node as a process (lifecycle.autostart false, on a ROS domain of its own, localhost only), drives it
through configure, activate (one goal), deactivate and cleanup for --cycles rounds with the lifecycle services,
and prints the node process's resident memory (and its compile process's) after each step. Whether cleanup gives
the memory back, and whether a second cycle ends where the first did, is what it shows.
"""

import argparse
import os
import subprocess
import sys
import tempfile
import time

import psutil
import rclpy
from lifecycle_msgs.msg import Transition
from lifecycle_msgs.srv import ChangeState, GetState

from gemma_spec_ros.tools.client import BackgroundSpinner, GenerateClient, make_goal

NODE_NAME = 'gemma_spec_memory'
SETTLE_SECONDS = 1.0  # after a transition, before reading the memory: the process finishes freeing


def _mib(process: psutil.Process) -> float:
    try:
        return process.memory_info().rss / 2**20
    except psutil.NoSuchProcess:
        return 0.0


def _children_mib(process: psutil.Process) -> float:
    return sum(_mib(child) for child in process.children(recursive=True))


class LifecycleDriver:
    """The node's change_state and get_state services, called from this process."""

    def __init__(self, node, name: str, process: subprocess.Popen):
        self._change = node.create_client(ChangeState, '/{}/change_state'.format(name))
        self._get = node.create_client(GetState, '/{}/get_state'.format(name))
        self._process = process

    def wait(self, timeout: float) -> bool:
        return self._change.wait_for_service(timeout_sec=timeout) and self._get.wait_for_service(timeout_sec=timeout)

    def change(self, transition_id: int, timeout: float = 900.0) -> None:
        response = self._call(self._change, ChangeState.Request(transition=Transition(id=transition_id)), timeout)
        if not response.success:
            raise RuntimeError('transition {} failed'.format(transition_id))

    def state(self) -> str:
        return self._call(self._get, GetState.Request(), 30.0).current_state.label

    def _call(self, client, request, timeout: float):
        future = client.call_async(request)
        deadline = time.monotonic() + timeout
        while not future.done():
            if self._process.poll() is not None:
                raise RuntimeError('the node exited with code {}'.format(self._process.returncode))
            if time.monotonic() > deadline:
                raise TimeoutError('no answer from {} within {} s'.format(client.srv_name, timeout))
            time.sleep(0.02)
        return future.result()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog='python -m gemma_spec_ros.tools.lifecycle_memory',
                                     description=__doc__.strip().split('\n')[0])
    parser.add_argument('--params-file', default='config/orin.yaml', help='the node parameters')
    parser.add_argument('--cycles', type=int, default=2, help='configure ... cleanup rounds')
    parser.add_argument('--max-new-tokens', type=int, default=32, help='tokens of the goal run while active')
    parser.add_argument('--node-arg', action='append', default=[], help='extra -p NAME:=VALUE for the node')
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.cycles < 1 or args.max_new_tokens < 1:
        parser.error('--cycles and --max-new-tokens must be at least 1')

    domain = str(100 + os.getpid() % 100)
    env = dict(os.environ, ROS_DOMAIN_ID=domain, ROS_AUTOMATIC_DISCOVERY_RANGE='LOCALHOST')
    command = [sys.executable, '-m', 'gemma_spec_ros', 'node', '--ros-args', '--params-file', args.params_file,
               '-p', 'lifecycle.autostart:=false', '-r', '__node:=' + NODE_NAME]
    for extra in args.node_arg:
        command += ['-p', extra]
    log_path = os.path.join(tempfile.mkdtemp(prefix='lifecycle_memory_'), 'node.log')
    log = open(log_path, 'w')  # noqa: SIM115 (open while the node runs)
    node_process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    print('node log: {}'.format(log_path), flush=True)
    process = psutil.Process(node_process.pid)
    os.environ['ROS_DOMAIN_ID'] = domain
    rclpy.init()
    node = rclpy.create_node('lifecycle_memory_driver')
    spinner = BackgroundSpinner(node)
    driver = LifecycleDriver(node, NODE_NAME, node_process)
    client = GenerateClient('/{}/generate'.format(NODE_NAME), 'lifecycle_memory_client')
    rows = []

    def measure(step: str) -> None:
        time.sleep(SETTLE_SECONDS)
        rows.append((step, driver.state(), _mib(process), _children_mib(process)))
        print('{:<34} {:<13} node RSS {:8.1f} MiB   compile process {:8.1f} MiB'.format(*rows[-1]), flush=True)

    try:
        if not driver.wait(120):
            raise RuntimeError('the node did not come up')
        measure('started')
        for cycle in range(1, args.cycles + 1):
            started = time.monotonic()
            driver.change(Transition.TRANSITION_CONFIGURE)
            measure('cycle {}: configured ({:.1f} s)'.format(cycle, time.monotonic() - started))
            driver.change(Transition.TRANSITION_ACTIVATE)
            outcome = client.send(make_goal('The robot picked up the red cube and',
                                            max_new_tokens=args.max_new_tokens))
            measure('cycle {}: active, after a goal ({})'.format(cycle, outcome.status))
            driver.change(Transition.TRANSITION_DEACTIVATE)
            driver.change(Transition.TRANSITION_CLEANUP)
            measure('cycle {}: cleaned up'.format(cycle))
        driver.change(Transition.TRANSITION_UNCONFIGURED_SHUTDOWN)
        measure('shut down')
        return 0
    except (RuntimeError, TimeoutError) as error:
        print('lifecycle_memory: {} (node log: {})'.format(error, log_path), file=sys.stderr)
        return 1
    finally:
        client.close()
        spinner.stop()
        node.destroy_node()
        rclpy.try_shutdown()
        node_process.terminate()
        try:
            node_process.wait(30)
        except subprocess.TimeoutExpired:
            node_process.kill()
        log.close()


if __name__ == '__main__':
    sys.exit(main())
