"""
Inject a fault into a launched node mid-goal and measure how it recovers: ``python -m gemma_spec_ros.tools.faults``.

``faults kill`` starts ``ros2 launch gemma_spec_ros orin.launch.py respawn:=true`` (on a ROS domain of its own),
sends a long goal and kills the node with SIGKILL at its first feedback, as a power cut or the OOM killer would. The
goal must end, 'lost' within the DDS lease, never hang; recovery is the time from the kill until a new goal succeeds
on the respawned node. ``faults stall`` stops the node with SIGSTOP for --stall-seconds at the first feedback, then
SIGCONT: the goal must finish; recovery is the time from SIGCONT to its next feedback. Each repeat prints a line;
the last line is a JSON summary (bench faults reads it). Exit code 1 when a goal hung or a recovery failed.
"""

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import rclpy
from rclpy.signals import SignalHandlerOptions

from gemma_spec_ros.tools.client import BackgroundSpinner, GenerateClient, make_goal

LONG_GOAL = make_goal('def parse(text):', max_new_tokens=1000)   # seconds of decoding: long enough to be hit
SHORT_GOAL = make_goal('The robot picked up the red cube and', max_new_tokens=4)
STARTED = re.compile(r'process started with pid \[(\d+)\]')


class Launch:
    """orin.launch.py with respawn as a process; the pids of the nodes it started, in order."""

    def __init__(self, domain: str, arguments: list[str]):
        env = dict(os.environ, ROS_DOMAIN_ID=domain, ROS_AUTOMATIC_DISCOVERY_RANGE='LOCALHOST', PYTHONUNBUFFERED='1')
        command = ['ros2', 'launch', 'gemma_spec_ros', 'orin.launch.py', 'respawn:=true', 'respawn_delay:=1.0',
                   'log_level:=warn'] + arguments
        self.pids: list[int] = []
        self._changed = threading.Condition()
        self.process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                        start_new_session=True)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.process.stdout:
            found = STARTED.search(line)
            if found:
                with self._changed:
                    self.pids.append(int(found.group(1)))
                    self._changed.notify_all()

    def node_pid(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        with self._changed:
            while not self.pids and time.monotonic() < deadline:
                self._changed.wait(0.5)
        if not self.pids:
            raise RuntimeError('the launch started no node within {} s'.format(timeout))
        return self.pids[-1]

    def stop(self):
        try:
            os.killpg(self.process.pid, signal.SIGINT)
            self.process.wait(30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(self.process.pid, signal.SIGKILL)


def hit(client: GenerateClient, pid: int, fault: str, stall_seconds: float, goal_timeout: float) -> dict:
    """Send LONG_GOAL, apply the fault at its first feedback; return its outcome and the times."""
    times = {}

    def on_feedback(_):
        if 'fault' in times:
            if 'resumed' in times:
                times.setdefault('streaming', time.monotonic())
            return
        times['fault'] = time.monotonic()
        if fault == 'kill':
            os.kill(pid, signal.SIGKILL)
            return
        os.kill(pid, signal.SIGSTOP)
        timer = threading.Timer(stall_seconds, lambda: (os.kill(pid, signal.SIGCONT), times.setdefault(
            'resumed', time.monotonic())))
        timer.daemon = True
        timer.start()

    outcome = client.send(LONG_GOAL, on_feedback=on_feedback, timeout=goal_timeout)
    ended = time.monotonic()
    if 'fault' not in times:
        raise RuntimeError('the goal ended ({}) before its first feedback'.format(outcome.status))
    row = {'status': outcome.status, 'ended_after_s': round(ended - times['fault'], 2),
           'hang': outcome.status == 'timeout'}
    if fault == 'stall':   # recovery: from SIGCONT to the next feedback
        row['recovery_s'] = round(times.get('streaming', ended) - times.get('resumed', ended), 2)
        row['ok'] = outcome.status == 'succeeded'
        return row
    row['ok'] = outcome.status == 'lost'
    while time.monotonic() - times['fault'] < goal_timeout:   # recovery: the respawned node serves a goal
        if client.wait_for_server(10.0) and client.send(SHORT_GOAL, timeout=60.0).status == 'succeeded':
            row['recovery_s'] = round(time.monotonic() - times['fault'], 2)
            return row
        time.sleep(0.5)
    row['ok'], row['recovery_s'] = False, float('nan')
    return row


def summary(fault: str, rows: list[dict]) -> dict:
    recoveries = sorted(row['recovery_s'] for row in rows if row['recovery_s'] == row['recovery_s'])
    return {'fault': fault, 'count': len(rows), 'ended': sum(not row['hang'] for row in rows),
            'hangs': sum(row['hang'] for row in rows), 'failed': sum(not row['ok'] for row in rows),
            'statuses': sorted({row['status'] for row in rows}),
            'recovery_s_p50': recoveries[len(recoveries) // 2] if recoveries else None,
            'recovery_s_max': recoveries[-1] if recoveries else None}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog='python -m gemma_spec_ros.tools.faults',
                                     description=__doc__.strip().split('\n')[0])
    parser.add_argument('fault', choices=('kill', 'stall'))
    parser.add_argument('--repeats', type=int, default=3)
    parser.add_argument('--stall-seconds', type=float, default=10.0, help='stall: seconds stopped (below the '
                                                                         'DDS lease of 20 s)')
    parser.add_argument('--goal-timeout', type=float, default=300.0, help='seconds without an end: a hang')
    parser.add_argument('--launch-arg', action='append', default=[], metavar='NAME:=VALUE',
                        help="orin.launch.py argument (default: device:=cpu compile:=eager warmup:=off drafter:=none)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    launch_args = args.launch_arg or ['device:=cpu', 'compile:=eager', 'warmup:=off', 'drafter:=none']
    domain = str(120 + os.getpid() % 80)
    launch = Launch(domain, launch_args)
    os.environ['ROS_DOMAIN_ID'] = domain
    rclpy.init(args=['faults'], signal_handler_options=SignalHandlerOptions.NO)
    node = rclpy.create_node('faults_monitor')
    spinner = BackgroundSpinner(node)
    client = GenerateClient('/gemma_spec/generate', 'faults_client')
    rows = []
    try:
        client.wait_until_ready('gemma_spec', timeout=600.0)
        for repeat in range(args.repeats):
            pid = launch.node_pid(60.0)
            if not client.wait_for_server(120.0) or client.send(SHORT_GOAL, timeout=120.0).status != 'succeeded':
                raise RuntimeError('the node does not serve before repeat {}'.format(repeat + 1))
            rows.append(hit(client, pid, args.fault, args.stall_seconds, args.goal_timeout))
            print('{} {}: {}'.format(args.fault, repeat + 1, rows[-1]), flush=True)
    except RuntimeError as error:
        print('faults: {}'.format(error), file=sys.stderr)
    finally:
        client.close()
        spinner.stop()
        node.destroy_node()
        rclpy.try_shutdown()
        launch.stop()
    result = summary(args.fault, rows)
    print(json.dumps(result), flush=True)
    return 0 if rows and len(rows) == args.repeats and not result['hangs'] and not result['failed'] else 1


if __name__ == '__main__':
    sys.exit(main())
