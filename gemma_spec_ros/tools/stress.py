"""
Load and soak the node with several planners at once, and report how it held up.

``python -m gemma_spec_ros stress --clients 8 --goals 25 --cancel 0.2 --minutes N`` starts the node from
``--params-file`` (default config/orin.yaml; ``--attach`` uses a running node instead), runs the clients, each on
its own ROS node: every client sends ``--goals`` goals one after another (and goes on until ``--minutes`` have
passed), cancels a ``--cancel`` share of them at a random moment, and retries a goal the node ended as busy.
``--mix text,json,image`` picks each goal's kind in turn at random: a text goal, a JSON plan under a schema, or a
question about the bundled scene image (needs a target with a vision tower, as config/orin.yaml has). Then it
prints the terminal states, hangs and busy goals per client, cancel latency, queue wait, time to first token and
inter-token latency, and the trend of the node's RSS (read from /diagnostics): over the whole run, and after the
warm-up (from AFTER_WARMUP_SETTLE seconds after /diagnostics first said 'warm-up done': the background warm-up
adopts its compiled graphs one by one, each adding to the RSS, which a whole-run trend counts as growth), with the
prefix cache's size and the node's idle heap trims at the end. Exit code 1 when a goal hung or its streamed text
differed from its result.
"""

import argparse
import json
import math
import os
import random
import signal
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import rclpy
from rclpy.signals import SignalHandlerOptions

from gemma_spec_ros.engine.stats import format_figure, percentile, slope
from gemma_spec_ros.tools.client import (
    BackgroundSpinner,
    DiagnosticsListener,
    GenerateClient,
    compressed_image_from_file,
    make_goal,
)
from gemma_spec_ros.tools.demo import DEMO_SCENE, NodeProcess, default_params_file, installed

PROMPTS = (
    'Write a Python function plan(robot) that picks up the red cup and places it in the sink.',
    'List the steps to dock the robot at its charger.',
    'def navigate(robot, goal):',
    'The robot sees a closed door. Next action:',
    'Summarise the battery and arm status for the operator in one sentence.',
)
RETRY_BACKOFF = (0.05, 0.3)   # seconds a client waits before resending a goal the node ended as busy
KINDS = ('text', 'json', 'image')
FEEDBACK_SETTLE = 15.0   # seconds a client waits for feedback still in flight after the result
AFTER_WARMUP_SETTLE = 60.0   # s after the warm-up's end before the trend after warm-up starts: the last graph's uses
AFTER_WARMUP_MIN = 120.0     # s of samples the trend after warm-up needs (its output says how many minutes)
PLAN_SCHEMA = json.dumps({'type': 'object', 'required': ['steps'], 'additionalProperties': False, 'properties': {
    'steps': {'type': 'array', 'maxItems': 4, 'items': {
        'type': 'object', 'required': ['action', 'target'], 'additionalProperties': False,
        'properties': {'action': {'enum': ['pick', 'place', 'move', 'open']}, 'target': {'type': 'string',
                                                                                          'maxLength': 24}}}}}})


def goal_of_kind(kind: str, rng: random.Random, max_new_tokens: int, sampled: bool):
    """Make a goal of one kind: text, a JSON plan under PLAN_SCHEMA, or a question about the bundled scene image."""
    sampling = dict(temperature=0.7 if sampled else 0.0, seed=rng.randint(0, 2 ** 31) if sampled else -1)
    if kind == 'json':
        return make_goal('Plan, as JSON: ' + rng.choice(PROMPTS), max_new_tokens=max_new_tokens,
                         json_schema=PLAN_SCHEMA, **sampling)
    if kind == 'image':
        with open(installed(DEMO_SCENE + '.json'), encoding='utf-8') as stream:
            question = json.load(stream)['question']
        return make_goal(messages=[('user', question, [0])], max_new_tokens=max_new_tokens,
                         compressed_images=[compressed_image_from_file(installed(DEMO_SCENE + '.png'))], **sampling)
    return make_goal(rng.choice(PROMPTS), max_new_tokens=max_new_tokens, **sampling)


@dataclass
class ClientTally:
    """What one client saw."""

    sent: int = 0                                      # goals, each counted once however often it was retried
    states: Counter = field(default_factory=Counter)   # terminal status (busy retries excluded) -> count
    busy: int = 0                                      # goals the node ended as busy (each retry counts)
    gave_up: int = 0                                   # goals still busy after --max-retries
    hangs: int = 0                                     # no result within --goal-timeout
    mismatches: int = 0                                # streamed text != result text
    cancel_latencies: list = field(default_factory=list)   # seconds from cancel request to result
    tokens_after_cancel: list = field(default_factory=list)
    first_feedback: list = field(default_factory=list)     # seconds from sending to the first feedback
    token_gaps: list = field(default_factory=list)         # seconds between feedbacks, per token they carried
    kinds: Counter = field(default_factory=Counter)        # goals sent per kind
    mismatch_examples: list = field(default_factory=list)  # (result text, streamed text) of the first mismatches
    errors: Counter = field(default_factory=Counter)       # aborted (not busy): error -> count
    served_at: list = field(default_factory=list)          # monotonic time each goal not ended busy was served:
                                                           # its first feedback, else its result


def run_client(client, index, args, deadline, tally: ClientTally, stop: threading.Event):
    rng = random.Random(args.seed * 1000 + index)
    while not stop.is_set() and (tally.sent < args.goals or time.monotonic() < deadline):
        tally.sent += 1
        kind = rng.choice(args.mix)
        tally.kinds[kind] += 1
        goal = goal_of_kind(kind, rng, rng.randint(8, args.max_new_tokens), rng.random() < 0.3)
        cancel_after = rng.uniform(0.05, args.cancel_window) if rng.random() < args.cancel else 0.0
        for _ in range(args.max_retries + 1):
            sent_at = time.monotonic()
            outcome = client.send(goal, cancel_after_seconds=cancel_after, timeout=args.goal_timeout)
            if not outcome.busy:
                break
            tally.busy += 1
            time.sleep(rng.uniform(*RETRY_BACKOFF))
        else:
            tally.gave_up += 1
            continue
        if outcome.status == 'timeout':
            tally.hangs += 1
            continue
        tally.states[outcome.status] += 1
        tally.served_at.append(sent_at + (outcome.feedback_times[0] if outcome.feedback_times else outcome.result_time))
        if outcome.result is not None and outcome.result.text != outcome.streamed_text:
            tally.mismatches += 1
            if len(tally.mismatch_examples) < 2:
                tally.mismatch_examples.append((outcome.status, outcome.result.text, outcome.streamed_text))
        if outcome.status == 'aborted':
            tally.errors[outcome.result.error[:80]] += 1
        if outcome.feedback_times:
            tally.first_feedback.append(outcome.first_feedback_latency)
        times = outcome.feedback_times
        for before, after, feedback in zip(times, times[1:], outcome.feedback[1:], strict=False):
            tokens = max(1, len(feedback.token_ids_delta))   # a round that emits n tokens adds n gaps of g / n
            tally.token_gaps.extend([(after - before) / tokens] * tokens)
        if outcome.cancel_time and outcome.status == 'canceled':
            tally.cancel_latencies.append(outcome.cancel_latency)
            tally.tokens_after_cancel.append(sum(len(f.token_ids_delta) for f, t in zip(
                outcome.feedback, outcome.feedback_times, strict=True) if t > outcome.cancel_time))


class RssTrend:
    """The node's RSS from its /diagnostics memory status, sampled every second, and when its warm-up ended."""

    def __init__(self, listener: DiagnosticsListener, node_name: str):
        self.samples = []   # (monotonic seconds, MiB)
        self.warm_at = None   # monotonic seconds of the first sample with the warm-up done (no warm-up: the first)
        self.graphs = ''      # 'graphs ready' at the latest engine status, e.g. '19 of 60'
        self.prefix_cache = ''   # 'prefix cache MiB' at the latest engine status, e.g. '1.0 of 256.0'
        self.trims = ''          # 'heap trims when idle' at the latest memory status
        self._listener, self._memory, self._engine = listener, node_name + ': memory', node_name + ': engine'
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self):
        while not self._stop.wait(1.0):
            latest = self._listener.latest()
            entry, engine = latest.get(self._memory), latest.get(self._engine)
            if not entry or 'process RSS (MiB)' not in entry[2]:
                continue
            now = time.monotonic()
            self.samples.append((now, float(entry[2]['process RSS (MiB)'])))
            self.trims = entry[2].get('heap trims when idle', self.trims)
            values = engine[2] if engine else {}
            self.graphs = values.get('graphs ready', self.graphs)
            self.prefix_cache = values.get('prefix cache MiB', self.prefix_cache)
            if self.warm_at is None and values.get('state') == 'ready' and values.get('warm-up done', 'true') == 'true':
                self.warm_at = now   # a server backend has no warm-up

    def stop(self):
        self._stop.set()
        self._thread.join()

    def slope_mib_per_minute(self, since: float = -math.inf) -> float:
        """Least-squares slope of RSS over time, in MiB per minute, of the samples from `since` (monotonic s)."""
        samples = [(t, v) for t, v in self.samples if t >= since]
        trend = slope([t for t, _ in samples], [v for _, v in samples])
        return 0.0 if math.isnan(trend) else 60.0 * trend

    def after_warmup(self) -> str:
        """Say the RSS and its trend after the warm-up, or why there is none."""
        if not self.samples:
            return 'no samples'
        start = self.samples[0][0]
        if self.warm_at is None:
            return 'none: the warm-up was not done at the end ({} graphs ready)'.format(self.graphs or '?')
        since = self.warm_at + AFTER_WARMUP_SETTLE
        samples = [(t, v) for t, v in self.samples if t >= since]
        if not samples or samples[-1][0] - samples[0][0] < AFTER_WARMUP_MIN:
            return 'none: the warm-up was done after {:.1f} min, too late for {:.0f} min of samples'.format(
                (self.warm_at - start) / 60.0, AFTER_WARMUP_MIN / 60.0)
        return 'from {:.1f} min (warm-up done after {:.1f} min): {:.1f} -> {:.1f} MiB, trend {:+.3f} MiB/min ' \
            'over {:.1f} min ({} samples)'.format(
                (since - start) / 60.0, (self.warm_at - start) / 60.0, samples[0][1], samples[-1][1],
                self.slope_mib_per_minute(since), (samples[-1][0] - samples[0][0]) / 60.0, len(samples))


def p50_p95(values) -> str:
    return '{} / {} s'.format(*(format_figure(percentile(values, q)) for q in (50, 95)))


def fair_shares(tallies) -> tuple[list[int], float]:
    """Each client's goals among the first half of all served goals (by when each was served), and the fair share."""
    served = sorted((at, index) for index, tally in enumerate(tallies) for at in tally.served_at)
    first_half = [index for _, index in served[:len(served) // 2]]
    return [first_half.count(index) for index in range(len(tallies))], len(first_half) / max(1, len(tallies))


def report(tallies, rss: RssTrend, latest, node_name, elapsed) -> bool:
    """Print the figures; True when every goal ended and every streamed text matched its result."""
    print('\n=== stress: {} clients, {:.1f} min ==='.format(len(tallies), elapsed / 60.0))
    print('{:<8} {:>5} {:>9} {:>8} {:>7} {:>5} {:>7} {:>5} {:>10}'.format(
        'client', 'goals', 'succeeded', 'canceled', 'aborted', 'busy', 'gave up', 'hangs', 'mismatches'))
    for index, tally in enumerate(tallies):
        print('{:<8} {:>5} {:>9} {:>8} {:>7} {:>5} {:>7} {:>5} {:>10}'.format(
            index, tally.sent, tally.states['succeeded'], tally.states['canceled'], tally.states['aborted'],
            tally.busy, tally.gave_up, tally.hangs, tally.mismatches))
    total = ClientTally()
    for tally in tallies:
        for name in ('sent', 'busy', 'gave_up', 'hangs', 'mismatches'):
            setattr(total, name, getattr(total, name) + getattr(tally, name))
        total.states.update(tally.states)
        total.errors.update(tally.errors)
        for name in ('cancel_latencies', 'tokens_after_cancel', 'first_feedback', 'token_gaps'):
            getattr(total, name).extend(getattr(tally, name))
        total.kinds.update(tally.kinds)
        total.mismatch_examples.extend(tally.mismatch_examples)
    print('{:<8} {:>5} {:>9} {:>8} {:>7} {:>5} {:>7} {:>5} {:>10}'.format(
        'all', total.sent, total.states['succeeded'], total.states['canceled'], total.states['aborted'],
        total.busy, total.gave_up, total.hangs, total.mismatches))
    busy = [tally.busy for tally in tallies]
    mean_busy = sum(busy) / len(busy)
    print('busy per client: mean {:.1f}, max {} ({:.2f}x the mean)'.format(
        mean_busy, max(busy), max(busy) / mean_busy if mean_busy else 0.0))
    shares, fair = fair_shares(tallies)
    if fair:
        print('first half of the served goals per client: {} to {} of a fair {:.1f} (at most {:.0f} % off)'.format(
            min(shares), max(shares), fair, 100 * max(abs(share - fair) for share in shares) / fair))
    for error, count in total.errors.most_common(5):
        print('aborted x{}: {}'.format(count, error))
    print('cancel -> result p50 / p95: {} ({} cancels, at most {} tokens after the cancel)'.format(
        p50_p95(total.cancel_latencies), len(total.cancel_latencies), max(total.tokens_after_cancel, default=0)))
    for status, text, streamed in total.mismatch_examples[:3]:
        print('streamed != result ({}): result {!r}, streamed {!r}'.format(status, text, streamed))
    print('goals by kind: {}'.format(', '.join('{} {}'.format(k, n) for k, n in sorted(total.kinds.items()))))
    print('send -> first feedback p50 / p95 (client side, queue included): {}'.format(
        p50_p95(total.first_feedback)))
    print('inter-token latency p50 / p95 (client side): {}'.format(p50_p95(total.token_gaps)))
    generation = (latest or {}).get(node_name + ': generation')
    if generation:
        values = generation[2]
        print('node /diagnostics (last {} goals): queue wait p50 / p95 {} / {} s, time to first token from '
              'acceptance p50 / p95 {} / {} s, [{}] {}'.format(
                  values.get('goals in window'), values.get('queue wait p50 (s)'), values.get('queue wait p95 (s)'),
                  values.get('time to first token p50 (s)'), values.get('time to first token p95 (s)'),
                  generation[0], generation[1]))
    if rss.samples:
        print('node RSS: {:.1f} MiB at start, {:.1f} MiB at end, max {:.1f} MiB, trend {:+.3f} MiB/min '
              '({} samples)'.format(rss.samples[0][1], rss.samples[-1][1], max(v for _, v in rss.samples),
                                    rss.slope_mib_per_minute(), len(rss.samples)))
        print('node RSS after warm-up: {}'.format(rss.after_warmup()))
    if rss.prefix_cache or rss.trims:
        print('node at the end: prefix cache {} MiB, heap trims when idle {}'.format(rss.prefix_cache or '-',
                                                                                    rss.trims or '-'))
    ended = sum(total.states.values())
    print('terminal: {} of {} goals ended ({} gave up busy), hangs {}, streamed != result {}'.format(
        ended, total.sent, total.gave_up, total.hangs, total.mismatches))
    return total.hangs == 0 and total.mismatches == 0


def build_parser():
    parser = argparse.ArgumentParser(prog='python -m gemma_spec_ros stress',
                                     description=__doc__.strip().split('\n')[0])
    parser.add_argument('--clients', type=int, default=8, help='concurrent planners, each its own ROS node')
    parser.add_argument('--goals', type=int, default=25, help='goals each client sends at least')
    parser.add_argument('--cancel', type=float, default=0.2, help='share of goals cancelled at a random moment')
    parser.add_argument('--cancel-window', type=float, default=1.5, help='cancel within this many seconds')
    parser.add_argument('--minutes', type=float, default=0.0, help='keep sending until this many minutes (soak)')
    parser.add_argument('--max-new-tokens', type=int, default=48, help='goals ask for 8..N tokens')
    parser.add_argument('--max-retries', type=int, default=200, help='busy retries before a client gives a goal up')
    parser.add_argument('--goal-timeout', type=float, default=300.0, help='seconds without a result = a hang')
    parser.add_argument('--mix', default='text', help='goal kinds, comma-separated: text, json, image '
                                                       '(default %(default)s)')
    parser.add_argument('--seed', type=int, default=1)
    parser.add_argument('--params-file', default=None, help='node parameters (default config/orin.yaml)')
    parser.add_argument('-p', '--param', action='append', default=[], metavar='NAME:=VALUE',
                        help='extra node parameter, e.g. engine.num_threads:=1 (repeatable)')
    parser.add_argument('--attach', action='store_true', help='use a running node instead of starting one')
    parser.add_argument('--node-name', default='gemma_spec', help='name of the node (default %(default)s)')
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    if args.clients < 1 or args.goals < 0 or not 0.0 <= args.cancel <= 1.0:
        print('stress: need --clients >= 1, --goals >= 0 and --cancel in [0, 1]', file=sys.stderr)
        return 2
    args.mix = [kind.strip() for kind in args.mix.split(',') if kind.strip()]
    if not args.mix or set(args.mix) - set(KINDS):
        print('stress: --mix takes {}, got {!r}'.format(', '.join(KINDS), ','.join(args.mix)), file=sys.stderr)
        return 2
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.default_int_handler)
    if not args.attach:   # a node of its own on a ROS domain of its own: another node of that name must not answer
        os.environ['ROS_DOMAIN_ID'] = str(140 + os.getpid() % 90)
    node = None if args.attach else NodeProcess(args.params_file or default_params_file(), args.param)
    rclpy.init(args=['stress'], signal_handler_options=SignalHandlerOptions.NO)
    action = '/{}/generate'.format(args.node_name)
    monitor = rclpy.create_node('stress_monitor')
    listener = DiagnosticsListener(monitor, args.node_name)
    monitor_spinner = BackgroundSpinner(monitor)
    # every client here receives every goal's feedback (one topic) and filters it on one interpreter: under a flood
    # its feedback can trail the result by seconds, which is this process's backlog, not the node's
    clients = [GenerateClient(action, 'stress_client_{}'.format(i), feedback_settle=FEEDBACK_SETTLE)
               for i in range(args.clients)]
    tallies = [ClientTally() for _ in clients]
    stop = threading.Event()
    ok = False
    try:
        clients[0].wait_until_ready(args.node_name, timeout=600.0)
        for client in clients:
            if not client.wait_for_server(60.0):
                raise RuntimeError('no action server {}'.format(action))
        if node is not None:
            node.quiet = True
        rss = RssTrend(listener, args.node_name)
        started = time.monotonic()
        deadline = started + 60.0 * args.minutes
        threads = [threading.Thread(target=run_client, args=(client, i, args, deadline, tally, stop), daemon=True)
                   for i, (client, tally) in enumerate(zip(clients, tallies, strict=True))]
        for thread in threads:
            thread.start()
        for thread in threads:
            while thread.is_alive():
                thread.join(0.5)
        time.sleep(1.5)   # one more /diagnostics period with every goal counted
        rss.stop()
        ok = report(tallies, rss, listener.latest(), args.node_name, time.monotonic() - started)
    except KeyboardInterrupt:
        stop.set()
        print('\nstress: interrupted', file=sys.stderr)
    except RuntimeError as error:
        print('stress: {}'.format(error), file=sys.stderr)
    finally:
        for client in clients:
            client.close()
        monitor_spinner.stop()
        monitor.destroy_node()
        rclpy.try_shutdown()
        if node is not None:
            stopping = time.monotonic()
            code = node.stop()
            print('node stopped with SIGINT: exit code {} after {:.1f} s'.format(code, time.monotonic() - stopping))
    return 0 if ok else 1


if __name__ == '__main__':
    sys.exit(main())
