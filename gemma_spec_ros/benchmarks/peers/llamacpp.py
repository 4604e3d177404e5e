"""
llama.cpp (the engine inside llama_ros) as peer rows, interleaved with our engine in one run (issue 40).

llama.cpp runs in its own venv (.venv-llamacpp, scripts/setup_llamacpp.sh) as one worker process,
scripts/llamacpp_worker.py, on the GGUFs of scripts/export_gguf.py. The worker times each generation itself
(call -> first token -> last token), so the pipe between the processes costs neither side. This module is the main
venv's side: it starts the worker, wraps each llama.cpp system as a bench Runner, probes the MTP assistant in a
process of its own (llama.cpp aborts on it), interleaves every system prompt by prompt, and computes the rows and
the ratios the issue asks for. benchmarks/peers/llamacpp_bench.py is the command.
"""

import json
import os
import random
import re
import statistics
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from gemma_spec_ros.benchmarks.harness import Measurement, Skipped, to_measurement
from gemma_spec_ros.benchmarks.prompts import Prompt
from gemma_spec_ros.benchmarks.systems import Outcome, Runner
from gemma_spec_ros.engine.stats import acceptance_rate, is_known, tau, tokens_per_second

REPO_ROOT = Path(__file__).resolve().parents[3]
DEFAULT_VENV = REPO_ROOT / '.venv-llamacpp'
DEFAULT_GGUF = REPO_ROOT / 'out' / 'gguf'
WORKER = REPO_ROOT / 'scripts' / 'llamacpp_worker.py'
OURS_PLAIN, OURS_INT8, OURS_FLOAT16 = 'ours/none', 'ours-int8/none', 'ours-f16/none'
WARM_UP_TOKENS = 8
# ratio goals of issue 40: (label, our system or 'best speculative', llama.cpp system or best, threshold)
PLAIN_GOALS = (('our plain float32 / llama.cpp plain f32', OURS_PLAIN, 'llamacpp-f32/none', 1.0),
               ('our plain int8 / llama.cpp plain Q8_0', OURS_INT8, 'llamacpp-q8_0/none', 1.0),
               ('our plain float16 / llama.cpp plain f16', OURS_FLOAT16, 'llamacpp-f16/none', 1.0))
SPECULATIVE_GOAL = 1.2
_ASSERT = re.compile(r'GGML_ASSERT\((.+)\) failed')


def llamacpp_systems(ngram_ks: list[int], draft_ks: list[int], precisions: tuple[str, ...] = ('f32', 'f16', 'q8_0')) \
        -> list[str]:
    """Plain at f32, f16, Q8_0; prompt lookup and the draft model per K at each of precisions (target = draft)."""
    systems = ['llamacpp-{}/none'.format(precision) for precision in ('f32', 'f16', 'q8_0')]
    for precision in precisions:
        systems += ['llamacpp-{}/ngram/K{}'.format(precision, k) for k in ngram_ks]
        systems += ['llamacpp-{}/draft/K{}'.format(precision, k) for k in draft_ks]
    return systems


def skip_message(venv: Path, gguf: Path) -> str:
    """Why the llama.cpp rows cannot run ('' when they can)."""
    if not (venv / 'bin' / 'python').exists():
        return 'no llama.cpp environment at {} (run scripts/setup_llamacpp.sh)'.format(venv)
    if not (gguf / 'gemma4-spec-target-f32.gguf').exists():
        return 'no GGUFs in {} (run .venv-llamacpp/bin/python scripts/export_gguf.py --out {})'.format(gguf, gguf)
    return ''


def mtp_refusal(venv: Path, gguf: Path, threads: int) -> str:
    """Create the assistant's MTP context in a process of its own; return why llama.cpp refused ('' if it did not)."""
    done = subprocess.run([str(venv / 'bin' / 'python'), str(WORKER), '--gguf', str(gguf), '--threads', str(threads),
                           '--probe-mtp'], capture_output=True, text=True, timeout=300,
                          env=os.environ | {'GGML_NO_BACKTRACE': '1'})
    if done.returncode == 0:
        return ''
    failed = _ASSERT.search(done.stderr)
    return 'llama.cpp {} creating the MTP context of the assistant (exit status {}){}'.format(
        'aborts' if done.returncode < 0 or done.returncode == 134 else 'fails', done.returncode,
        ': GGML_ASSERT({}) failed'.format(failed.group(1)) if failed else '')


class LlamaCppWorker:
    """scripts/llamacpp_worker.py in .venv-llamacpp, one JSON line per request and per answer."""

    def __init__(self, venv: Path, gguf: Path, threads: int, log: Path):
        self._log = open(log, 'w')
        self._process = subprocess.Popen(
            [str(venv / 'bin' / 'python'), str(WORKER), '--gguf', str(gguf), '--threads', str(threads)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True,
            env=os.environ | {'GGML_NO_BACKTRACE': '1', 'OMP_NUM_THREADS': str(threads)})
        self.info = self._answer()

    def _answer(self) -> dict:
        line = self._process.stdout.readline()
        if not line:
            raise RuntimeError('the llama.cpp worker exited (log: {})'.format(self._log.name))
        answer = json.loads(line)
        if 'error' in answer:
            raise RuntimeError('llama.cpp worker: {}'.format(answer['error']))
        return answer

    def generate(self, system: str, prompt_ids: list[int], max_new_tokens: int) -> dict:
        self._process.stdin.write(json.dumps({'system': system, 'prompt_ids': list(prompt_ids),
                                              'max_new_tokens': max_new_tokens}) + '\n')
        self._process.stdin.flush()
        return self._answer()

    def close(self) -> None:
        self._process.stdin.close()
        self._process.wait(timeout=60)
        self._log.close()


class LlamaCppRunner:
    """One llama.cpp system as a bench Runner: greedy, timed inside the worker."""

    def __init__(self, worker: LlamaCppWorker, system: str):
        self._worker, self._system = worker, system
        self._drafter = system.split('/')[1]

    def __call__(self, prompt_ids: list[int], max_new_tokens: int) -> Outcome:
        answer = self._worker.generate(self._system, prompt_ids, max_new_tokens)
        return Outcome(token_ids=answer['token_ids'], ttft_s=answer['ttft_s'], decode_s=answer['decode_s'],
                       wall_s=answer['wall_s'], target_passes=answer['target_passes'],
                       drafted_tokens=answer['drafted_tokens'], accepted_tokens=answer['accepted_tokens'],
                       drafter_used=self._drafter, decode_cpu_s=answer['decode_cpu_s'])


def plain_of(system: str) -> str:
    """Return the plain system a speculative one must reproduce: its own family and precision, no drafter."""
    return system.split('/')[0] + '/none'


def interleave(runners: dict[str, Runner], prompts: list[Prompt], encoded: dict[str, list[int]], repeats: int,
               max_new_tokens: int, seed: int, on_step: Callable[[str], None]) -> list[Measurement]:
    """
    One warm-up per system, then per repeat and prompt every system once, in a shuffled order (seeded).

    Parity is against our plain float32 decoding (OURS_PLAIN, which equals transformers' greedy generate).
    """
    if OURS_PLAIN not in runners:
        raise ValueError('the interleaved run needs {} as the parity reference'.format(OURS_PLAIN))
    for name, runner in runners.items():
        runner(encoded[prompts[0].id], min(WARM_UP_TOKENS, max_new_tokens))
        on_step(name)
    order = random.Random(seed)
    measurements = []
    for repeat in range(repeats):
        for prompt in prompts:
            names = list(runners)
            order.shuffle(names)
            outcomes = {}
            for name in names:
                outcomes[name] = runners[name](encoded[prompt.id], max_new_tokens)
                on_step(name)
            reference = outcomes[OURS_PLAIN].token_ids
            measurements += [to_measurement(name, prompt, repeat, outcomes[name], 0, 0, reference) for name in runners]
    return measurements


@dataclass(frozen=True)
class Row:
    """One system over all prompts."""

    system: str
    tokens_per_s: float            # median over repeats of decode tokens / decode seconds (all prompts)
    tokens_per_cpu_s: float        # the same over the decoding thread's CPU seconds: what other processes' load
                                   # takes from the wall clock does not count
    ttft_ms: float                 # median over generations
    tau: float              # tokens per decode pass; 1.0 for plain decoding
    acceptance_rate: float         # accepted / drafted (NaN: nothing drafted)
    same_as_reference: int         # generations token-identical to our plain float32 decoding
    same_as_own_plain: int         # ... to plain decoding of the same engine and precision
    generations: int


@dataclass(frozen=True)
class Comparison:
    name: str
    ours: str
    theirs: str
    ratio: float                   # ours / theirs, the rows' tokens per second; NaN when a side was not measured
    paired_ratio: float            # median over (prompt, repeat) of ours / theirs: robust to the machine's drift
    threshold: float


def _median_rate(by_repeat: dict[int, list[Measurement]], seconds: str) -> float:
    """Median over repeats of decode tokens / the seconds field (decode_s or decode_cpu_s) over all prompts."""
    return statistics.median(tokens_per_second(sum(max(0, m.new_tokens - 1) for m in group),
                                               sum(getattr(m, seconds) for m in group)) for group in by_repeat.values())


def rows_of(measurements: list[Measurement]) -> list[Row]:
    """Return a Row per system, in the order the systems first appear."""
    tokens = {(m.system, m.prompt_id, m.repeat): m.token_ids for m in measurements}
    rows = []
    for system in dict.fromkeys(m.system for m in measurements):
        samples = [m for m in measurements if m.system == system]
        by_repeat: dict[int, list[Measurement]] = {}
        for sample in samples:
            by_repeat.setdefault(sample.repeat, []).append(sample)
        own_plain = plain_of(system)
        rows.append(Row(
            system=system, tokens_per_s=_median_rate(by_repeat, 'decode_s'),
            tokens_per_cpu_s=_median_rate(by_repeat, 'decode_cpu_s'),
            ttft_ms=statistics.median(s.ttft_s for s in samples) * 1000.0,
            tau=tau([s.new_tokens for s in samples], [s.target_passes for s in samples]),
            acceptance_rate=acceptance_rate(sum(s.accepted_tokens for s in samples),
                                            sum(s.drafted_tokens for s in samples)),
            same_as_reference=sum(s.parity for s in samples),
            same_as_own_plain=sum(tokens.get((own_plain, s.prompt_id, s.repeat)) == s.token_ids for s in samples),
            generations=len(samples)))
    return rows


def _best(rows: list[Row], *prefixes: str) -> Row | None:
    """Return the fastest speculative row among the systems named with one of prefixes (None without one)."""
    speculative = [row for row in rows if row.system.startswith(prefixes) and not row.system.endswith('/none') and
                   is_known(row.tokens_per_s)]
    return max(speculative, key=lambda row: row.tokens_per_s, default=None)


def paired_ratio(measurements: list[Measurement], ours: str, theirs: str) -> float:
    """Median over the (prompt, repeat) pairs of ours / theirs decode tokens per second (NaN without a pair)."""
    rates = {(m.system, m.prompt_id, m.repeat): tokens_per_second(max(0, m.new_tokens - 1), m.decode_s)
             for m in measurements if m.system in (ours, theirs)}
    ratios = [rate / rates[theirs, prompt, repeat] for (system, prompt, repeat), rate in rates.items()
              if system == ours and rates.get((theirs, prompt, repeat))]
    return statistics.median(ratios) if ratios else float('nan')


def comparisons(rows: list[Row], measurements: list[Measurement]) -> list[Comparison]:
    """Issue 40's ratios: plain against plain at the same precision, and best speculative against best."""
    by_name = {row.system: row for row in rows}
    nan = float('nan')

    def compare(name: str, ours: Row | None, theirs: Row | None, threshold: float) -> Comparison:
        if not (ours and theirs):
            return Comparison(name, ours.system if ours else '-', theirs.system if theirs else '-', nan, nan,
                              threshold)
        return Comparison(name, ours.system, theirs.system, _divide(ours.tokens_per_s, theirs.tokens_per_s),
                          paired_ratio(measurements, ours.system, theirs.system), threshold)

    result = [compare(name, by_name.get(ours), by_name.get(theirs), threshold)
              for name, ours, theirs, threshold in PLAIN_GOALS]
    for name, ours, theirs in (('any precision', ('ours/', 'ours-int8/', 'ours-f16/'), ('llamacpp-',)),
                               ('float32 against f32', ('ours/',), ('llamacpp-f32/',)),
                               ('int8 against Q8_0', ('ours-int8/',), ('llamacpp-q8_0/',)),
                               ('float16 against f16', ('ours-f16/',), ('llamacpp-f16/',))):
        result.append(compare("our best speculative / llama.cpp's best speculative, {}".format(name),
                              _best(rows, *ours), _best(rows, *theirs), SPECULATIVE_GOAL))
    return result


def _divide(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator else float('nan')


def _figure(value: float, pattern: str) -> str:
    return pattern.format(value) if is_known(value) else '-'


def markdown(rows: list[Row], ratios: list[Comparison], skipped: list[Skipped]) -> str:
    """Return the rows, the ratios against their goals and the skipped systems as Markdown tables."""
    lines = ['| system | decode tok/s | per CPU s | TTFT ms | τ (decode) | acceptance | = our float32 plain | '
             '= own plain |', '|---|---|---|---|---|---|---|---|']
    for row in rows:
        lines.append('| {} | {} | {} | {} | {} | {} | {} of {} | {} of {} |'.format(
            row.system, _figure(row.tokens_per_s, '{:.1f}'), _figure(row.tokens_per_cpu_s, '{:.1f}'),
            _figure(row.ttft_ms, '{:.1f}'),
            _figure(row.tau, '{:.2f}'), _figure(row.acceptance_rate, '{:.2f}'), row.same_as_reference,
            row.generations, row.same_as_own_plain, row.generations))
    lines += ['', '| comparison | ours | llama.cpp | ratio | median of pairs | goal |', '|---|---|---|---|---|---|']
    for ratio in ratios:
        lines.append('| {} | {} | {} | {} | {} | ≥ {:.1f}× |'.format(
            ratio.name, ratio.ours, ratio.theirs, _figure(ratio.ratio, '{:.2f}×'),
            _figure(ratio.paired_ratio, '{:.2f}×'), ratio.threshold))
    if skipped:
        lines += ['', 'Not measured:', ''] + ['- {}: {}'.format(item.system, item.reason) for item in skipped]
    return '\n'.join(lines) + '\n'
