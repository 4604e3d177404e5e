"""
Measure what the managed node holds in each lifecycle state: ``python -m gemma_spec_ros.tools.lifecycle_memory``.

Starts the node as a process (lifecycle.autostart false, on a ROS domain of its own, localhost only), drives it
through configure, activate (one goal), deactivate and cleanup for --cycles rounds with the lifecycle services,
and prints the node process's resident memory (and its compile process's) after each step. Whether cleanup gives
the memory back, and whether a second cycle ends where the first did, is what it shows.

With ``--clients N`` that many planners send goals the whole time, whatever the state (lifecycle under load). The
summary counts their goals by how they ended: each must end with a reason (succeeded, or aborted / cancelled with
its error or finish reason), none may hang (no result within --goal-timeout) or be lost, and after the first
cycles the memory a cycle leaves behind must stay within --max-growth-mib; the exit status says whether it held.
"""

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter

import psutil
import rclpy
from lifecycle_msgs.msg import Transition
from lifecycle_msgs.srv import ChangeState, GetState

from gemma_spec_ros.engine.stats import slope
from gemma_spec_ros.tools.client import BackgroundSpinner, GenerateClient, make_goal

NODE_NAME = 'gemma_spec_memory'
SETTLE_SECONDS = 1.0  # after a transition, before reading the memory: the process finishes freeing
WARM_CYCLES = 3       # cycles before the memory is judged: allocator pools and caches fill during the first ones
PROMPT = 'The robot picked up the red cube and'


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


class LoadClients:
    """Planners that send goals one after another from threads of their own until stopped; every outcome kept."""

    def __init__(self, action: str, count: int, max_new_tokens: int, goal_timeout: float):
        self.outcomes: list[tuple[str, str]] = []   # (status, reason)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._clients = [GenerateClient(action, 'lifecycle_load_{}'.format(index)) for index in range(count)]
        self._threads = [threading.Thread(target=self._run, args=(client, max_new_tokens, goal_timeout), daemon=True)
                         for client in self._clients]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def _run(self, client, max_new_tokens: int, goal_timeout: float) -> None:
        while not self._stop.is_set():
            outcome = client.send(make_goal(PROMPT, max_new_tokens=max_new_tokens), timeout=goal_timeout)
            result = outcome.result
            reason = '' if result is None else (result.error or result.finish_reason)
            with self._lock:
                self.outcomes.append((outcome.status, reason))
            if outcome.status != 'succeeded':
                self._stop.wait(0.05)   # refused at once while inactive: no busy loop

    def stop(self, timeout: float) -> int:
        """Stop sending; return how many senders did not finish their last goal within timeout (hung)."""
        self._stop.set()
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            if thread.ident is not None:   # started
                thread.join(max(0.0, deadline - time.monotonic()))
        hung = sum(thread.is_alive() for thread in self._threads)
        if not hung:   # a sender still waiting keeps its client
            for client in self._clients:
                client.close()
            self._clients = []
        return hung


def growth_per_cycle(cleaned_up: list[float]) -> float:
    """MiB per cycle after the warm cycles: the least-squares slope of the RSS left after each cleanup (NaN: few)."""
    kept = cleaned_up[WARM_CYCLES - 1:]
    return slope(range(len(kept)), kept)


def summarize(outcomes: list[tuple[str, str]], hung: int, cleaned_up: list[float], max_growth: float) -> bool:
    """Print the load's outcomes and the memory trend; whether every goal ended with a reason and memory held."""
    statuses = Counter(status for status, _ in outcomes)
    unexplained = sum(status in ('aborted', 'canceled') and not reason for status, reason in outcomes)
    hangs = statuses['timeout'] + hung
    growth = growth_per_cycle(cleaned_up)
    print('goals {}: {}; without a reason {}, hangs {}, lost {}'.format(
        len(outcomes), ', '.join('{} {}'.format(status, count) for status, count in sorted(statuses.items())),
        unexplained, hangs, statuses['lost']))
    reasons = Counter(reason.split(':')[0][:60] for status, reason in outcomes if status != 'succeeded')
    for reason, count in reasons.most_common(5):
        print('  {:>5}  {}'.format(count, reason))
    held = growth != growth or growth <= max_growth   # NaN: too few cycles to judge
    print('RSS after cleanup, cycles {}..{}: {} MiB per cycle (limit {} MiB)'.format(
        WARM_CYCLES, len(cleaned_up), 'too few cycles' if growth != growth else '{:+.2f}'.format(growth), max_growth))
    return not unexplained and not hangs and not statuses['lost'] and held


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog='python -m gemma_spec_ros.tools.lifecycle_memory',
                                     description=__doc__.strip().split('\n')[0])
    parser.add_argument('--params-file', default='config/orin.yaml', help='the node parameters')
    parser.add_argument('--cycles', type=int, default=2, help='configure ... cleanup rounds')
    parser.add_argument('--max-new-tokens', type=int, default=32, help='tokens of the goal run while active')
    parser.add_argument('--node-arg', action='append', default=[], help='extra -p NAME:=VALUE for the node')
    parser.add_argument('--clients', type=int, default=0, help='planners sending goals the whole time (load)')
    parser.add_argument('--goal-timeout', type=float, default=300.0, help='seconds without a result: a hang')
    parser.add_argument('--max-growth-mib', type=float, default=5.0,
                        help='most MiB a cycle may leave behind after the first {}'.format(WARM_CYCLES))
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.cycles < 1 or args.max_new_tokens < 1 or args.clients < 0:
        parser.error('--cycles and --max-new-tokens must be at least 1, --clients at least 0')

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
    load = LoadClients('/{}/generate'.format(NODE_NAME), args.clients, args.max_new_tokens, args.goal_timeout)
    rows, cleaned_up = [], []

    def measure(step: str) -> None:
        time.sleep(SETTLE_SECONDS)
        rows.append((step, driver.state(), _mib(process), _children_mib(process)))
        print('{:<34} {:<13} node RSS {:8.1f} MiB   compile process {:8.1f} MiB'.format(*rows[-1]), flush=True)

    try:
        if not driver.wait(120):
            raise RuntimeError('the node did not come up')
        measure('started')
        load.start()
        for cycle in range(1, args.cycles + 1):
            started = time.monotonic()
            driver.change(Transition.TRANSITION_CONFIGURE)
            measure('cycle {}: configured ({:.1f} s)'.format(cycle, time.monotonic() - started))
            driver.change(Transition.TRANSITION_ACTIVATE)
            outcome = client.send(make_goal(PROMPT, max_new_tokens=args.max_new_tokens))
            measure('cycle {}: active, after a goal ({})'.format(cycle, outcome.status))
            driver.change(Transition.TRANSITION_DEACTIVATE)
            driver.change(Transition.TRANSITION_CLEANUP)
            measure('cycle {}: cleaned up'.format(cycle))
            cleaned_up.append(rows[-1][2])
        hung = load.stop(args.goal_timeout)
        driver.change(Transition.TRANSITION_UNCONFIGURED_SHUTDOWN)
        measure('shut down')
        if not args.clients:
            return 0
        return 0 if summarize(load.outcomes, hung, cleaned_up, args.max_growth_mib) else 1
    except (RuntimeError, TimeoutError) as error:
        print('lifecycle_memory: {} (node log: {})'.format(error, log_path), file=sys.stderr)
        return 1
    finally:
        load.stop(0.0)
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
