"""Writing a run: results.json (schema in docs/benchmark.md), results.md (tables) and the plots."""

import dataclasses
import json
import os
import platform
from pathlib import Path

from gemma_spec_ros.benchmarks.analysis import ALL, Cell, Summary
from gemma_spec_ros.engine.stats import format_figure

SCHEMA = 'gemma_spec_ros.bench/1'  # the results' format name (kept when the package was renamed)
# CPU flags that decide CPU matmul speed; the full list is long and mostly irrelevant here.
RELEVANT_FLAGS = ('sse4_2', 'avx', 'avx2', 'fma', 'f16c', 'avx512f', 'avx512bw', 'avx512_vnni', 'avx512_bf16',
                  'avx_vnni', 'amx_tile', 'amx_bf16', 'amx_int8')


def machine_description(threads: int) -> dict:
    """CPU model, cores, relevant flags, load and library versions."""
    import torch
    import transformers

    model, flags = platform.processor() or 'unknown', set()
    try:
        with open('/proc/cpuinfo') as cpuinfo:
            for line in cpuinfo:
                key, _, value = line.partition(':')
                if key.strip() == 'model name' and model == (platform.processor() or 'unknown'):
                    model = value.strip()
                elif key.strip() == 'flags' and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    return {
        'cpu_model': model, 'cores': os.cpu_count(), 'torch_threads': threads,
        'cpu_flags': [flag for flag in RELEVANT_FLAGS if flag in flags],
        'load_average': list(os.getloadavg()) if hasattr(os, 'getloadavg') else [],
        'python': platform.python_version(), 'torch': torch.__version__, 'transformers': transformers.__version__,
        'platform': platform.platform(),
    }


def write_json(path: Path, document: dict) -> None:
    path.write_text(json.dumps(document, indent=1, default=_jsonable) + '\n')


def _jsonable(value):
    if dataclasses.is_dataclass(value):
        return {f.name: getattr(value, f.name) for f in dataclasses.fields(value) if f.repr}
    raise TypeError('not JSON serializable: {!r}'.format(type(value)))


def _num(value: float | None, pattern: str = '{:.2f}') -> str:
    return format_figure(value, pattern)  # None (not applicable) and NaN (no data) read '-'


def _percent(value: float | None) -> str:
    return _num(None if value is None else value * 100, '{:.0f}%')


def _k(cell: Cell) -> str:
    if cell.drafter == 'none':
        return '–'
    if cell.k is None:
        return 'default'
    return 'adaptive' if cell.k == 0 else str(cell.k)


def _main_row(cell: Cell) -> str:
    pattern = '| {} | {} | {:.1f} ({:.1f}–{:.1f}) | {:.2f}x | {:.2f}x |' + ' {} |' * 8 + ' {:.0f} | {} | {} |'
    return pattern.format(
        cell.system, _k(cell), cell.tokens_per_s, cell.tokens_per_s_min, cell.tokens_per_s_max,
        cell.speedup_vs_ours_plain, cell.speedup_vs_hf_plain, _num(cell.tau), _num(cell.acceptance_rate if
                                                                                   cell.drafter != 'none' else None),
        _num(cell.alpha), _num(cell.draft_cost_ratio, '{:.3f}'), _num(cell.predicted_tau),
        _num(cell.predicted_speedup, '{:.2f}x'), _percent(cell.efficiency), _percent(cell.loop_efficiency),
        cell.ttft_ms, '–' if cell.family == 'vllm' else '{:.0f}'.format(cell.peak_rss_mib),
        'yes' if cell.parity else '**NO**')


def markdown(document: dict, summary: Summary, categories: list[str]) -> str:
    """Render the result tables as Markdown (what RESULTS.md embeds)."""
    settings, machine = document['settings'], document['machine']
    lines = ['# Benchmark run', '',
             'Command: `{}`'.format(document['command']), '',
             'Models: {}.'.format('; '.join('{} `{}` (weights sha256 {})'.format(role, model['path'],
                                                                              model['weights_sha256'])
                                           for role, model in document['models'].items())), '',
             'Machine: {} ({} cores, torch threads {}), flags {}; Python {}, torch {}, transformers {}; '
             'load average at start {}, at end {}.'.format(
                 machine['cpu_model'], machine['cores'], machine['torch_threads'],
                 ' '.join(machine['cpu_flags']) or 'none', machine['python'], machine['torch'],
                 machine['transformers'], _load(machine['load_average']), _load(document['load_average_end'])),
             '',
             'Settings: {} prompts ({}), max_new_tokens {}, repeats {}, greedy, systems interleaved in a shuffled '
             'order per prompt and repeat; warm-up and calibration runs excluded. Started {}, took {:.0f} s.'.format(
                 len(document['prompts']), ', '.join(categories), settings['max_new_tokens'], settings['repeats'],
                 document['created_utc'], document['duration_s']), '']
    lines += ['## Parity with plain greedy decoding', '']
    if summary.parity_failures:
        lines += ['**PARITY FAILURES** (output differs from transformers plain greedy generate; '
                  'prompt#repeat@first differing position):', '']
        lines += ['- **{}**'.format(failure) for failure in summary.parity_failures]
    else:
        lines.append("Every system produced exactly the tokens of transformers' plain greedy generate on every "
                     'prompt and repeat.')
    lines += ['', '## Goals', '', '| Goal | Threshold | Measured | Met | Detail |', '|---|---|---|---|---|']
    for goal in summary.goals:
        lines.append('| {} | {:.2f} | {} | {} | {} |'.format(goal.name, goal.threshold, _num(goal.value),
                                                             'yes' if goal.met else '**no**', goal.detail))
    lines += ['', '## Peers', '',
              "Decode tok/s ratios on all prompts. Transformers' best with a drafter is the faster of eager and "
              'static+compile. vLLM servers run one after another after the interleaved run (a server fixes its '
              'speculation at start, so they cannot be interleaved), on the same prompts and token counts.', '',
              '| Comparison | Ratio | Systems |', '|---|---|---|']
    for ratio in summary.ratios:
        lines.append('| {} | {} | {} |'.format(ratio.name, _num(ratio.value, '{:.2f}x'), '{} / {}'.format(
            ratio.numerator or 'not measured', ratio.denominator or 'not measured')))
    lines += ['', '## Startup', '',
              'Load: engine load, model loading, or a vLLM server from start until it answers. First call: the first '
              'full-length generation (compile, capture, one-time set-up), before any measured run.', '',
              '| Family | Load s | First call s | Note |', '|---|---|---|---|']
    lines += ['| {} | {:.1f} | {:.1f} | {} |'.format(startup['name'], startup['load_s'], startup['first_call_s'],
                                                     startup['note']) for startup in document['startup']]
    slow = {name: s for name, s in document['warm_up_s'].items() if s >= 1.0}
    if slow:
        lines += ['', 'Warm-up runs of 1 s or more (recompiles for new shapes or cache states): ' +
                  ', '.join('{} {:.1f} s'.format(name, s) for name, s in slow.items()) + '.']
    if document['skipped']:
        lines += ['', 'Not measured:', '']
        lines += ['- {}: {}'.format(item['system'], item['reason']) for item in document['skipped']]
    lines += ['', '## All prompts', '',
              'tok/s: decode tokens per second after the first token, median (min–max) over repeats. '
              'tau: tokens per decode target pass, bonus token included (the prefill pass and its token '
              "left out, as in /diagnostics). '-': no data. alpha: i.i.d. acceptance fitted to the "
              "engine's per-position acceptance. c: drafter step / target step (engine-measured for ours, probe "
              'for transformers). Predicted: Leviathan speedup from alpha, c and the verify-cost curve of our decode '
              'steps (cost probe); '
              'efficiency = measured speedup vs our plain / predicted. Loop eff. = measured speedup / (measured '
              'tau / predicted round cost): the same model with the measured tau, so it isolates loop '
              'overhead from '
              'the i.i.d.-acceptance assumption.', '',
              '| System | K | tok/s | vs ours plain | vs HF plain | tau | accept | alpha | c | '
              'pred. tau | pred. speedup | efficiency | loop eff. | TTFT ms | peak RSS MiB | parity |',
              '|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|']
    lines += [_main_row(c) for c in summary.cells if c.category == ALL]
    lines += ['', '## Speedup vs our plain decoding by category (tau in brackets)', '',
              '| System | ' + ' | '.join(categories) + ' |', '|---|' + '---|' * len(categories)]
    for cell in (c for c in summary.cells if c.category == ALL):
        row = []
        for category in categories:
            other = summary.cell(cell.system, category)
            row.append('–' if other is None else '{:.2f}x ({}){}'.format(
                other.speedup_vs_ours_plain, _num(other.tau), '' if other.parity else ' **MISMATCH**'))
        lines.append('| {} | {} |'.format(cell.system, ' | '.join(row)))
    if summary.adaptive:
        lines += ['', '## Adaptive K against the best fixed K', '',
                  'Per category, the fixed K best in hindsight (of the K values run) against adaptive K, both as '
                  'speedup over our plain decoding; mean: over categories, against the single fixed K best on '
                  'average. By repeat: the ratio within each repeat (lowest-highest), the noise a ratio carries. '
                  'Paused: rounds the profit gate ran plain.', '',
                  '| System | category | best fixed K | its speedup | adaptive | ratio | by repeat | paused rounds |',
                  '|---|---|---|---|---|---|---|---|']
        lines += ['| {} | {} | K{} | {:.2f}x | {:.2f}x | {:.0%} | {} | {} |'.format(
            row.system, row.category, row.best_k, row.best_speedup, row.adaptive_speedup, row.ratio,
            '{:.0%}–{:.0%}'.format(min(row.repeat_ratios), max(row.repeat_ratios)) if row.repeat_ratios else '–',
            row.paused_rounds) for row in summary.adaptive]
    probe = document['cost_probe']
    lines += ['', '## Cost probe', '',
              'Medians of {} probe rounds spread over the run. Target forward at a {}-token context: {}. '
              'Drafter step: draft model {:.2f} ms (c = {:.3f}), assistant {:.2f} ms (c = {:.3f}).'.format(
                  probe['rounds'], probe['context_tokens'], ', '.join('{} tok {:.2f} ms (v = {:.2f})'.format(
                      n, ms, probe['verify_cost'][n]) for n, ms in probe['target_forward_ms'].items()),
                  probe['draft_step_ms'], probe['draft_cost_ratio']['draft'], probe['assistant_step_ms'],
                  probe['draft_cost_ratio']['mtp'])]
    for mode, forward_ms in probe.get('engine_forward_ms', {}).items():
        lines += ['', 'Our verify passes (engine.compile {}, the curve of our predictions): {}.'.format(
            mode, ', '.join('{} tok {:.2f} ms (v = {:.2f})'.format(n, ms, probe['engine_verify_cost'][mode][n])
                            for n, ms in forward_ms.items()))]
    ours, hf = summary.cell(summary.ours_plain), summary.cell('hf/none')
    if ours and hf and ours.tokens_per_s and hf.tokens_per_s:
        ours_pass = next(iter(probe.get('engine_forward_ms', {}).values()), {})  # the first mode's: ours
        lines += ['', 'Plain decoding per token: ours {:.2f} ms, transformers generate {:.2f} ms; a bare 1-token '
                  "target forward: transformers' {:.2f} ms{}.".format(
                      1000.0 / ours.tokens_per_s, 1000.0 / hf.tokens_per_s, probe['target_forward_ms'][1],
                      ", our engine's {:.2f} ms".format(ours_pass[1]) if ours_pass else '')]
    for key, label in (('hf_calibration', 'transformers eager'), ('hf_static_calibration', 'transformers static')):
        calibration = document[key]
        if calibration['tokens_per_s']:
            lines += ['', 'K chosen for {} on the calibration prompts (decode tok/s per K): '.format(label) + '; '.join(
                '{} K={} ({})'.format(drafter, calibration['chosen_k'][drafter], ', '.join(
                    'K{} {}'.format(k, _num(rate, '{:.1f}')) for k, rate in by_k.items()))
                for drafter, by_k in calibration['tokens_per_s'].items()) + '.']
    defaults = [s for s in document['systems'] if s['hf_settings']]
    if defaults:
        lines += ['', 'transformers settings: ' + '; '.join('{} {}'.format(s['name'], json.dumps(
            s['hf_settings'])) for s in defaults) + '.']
    return '\n'.join(lines) + '\n'


def _load(values: list[float]) -> str:
    return '/'.join('{:.2f}'.format(v) for v in values) if values else 'unknown'
