"""
The drafters against each other, auto among them: decode tokens/s per category, greedy, adaptive K.

``python -m gemma_spec_ros bench drafters [--drafters ngram,lookahead,mtp,draft,auto] [--per-category 4] [--threads 1]``

Plain decoding and each listed drafter (auto like any other: every round the loaded drafter expected to be
fastest) run on the held-out prompts. Two engines load the bundled target, MTP assistant and draft model: one runs
plain decoding and the single drafters (each drafter has a controller of its own there), the other auto, so that
the single drafters' goals never teach auto's members' controllers. Per repeat and
prompt every system runs once, in a shuffled order, so that drift on a shared machine hits them alike. Every output
is checked token by token against plain decoding.

Reported per category: decode tokens/s (the category's decode tokens over its decode seconds, median over repeats),
the speedup over plain, the best single drafter, auto against it, and the share of auto's rounds each drafter
drafted; once from wall time, once from the generating thread's CPU time (on a machine shared with other jobs the
wall time also counts the time the thread waited for a core; every system runs in the calling thread). Written to
--out as results.json and results.md.
"""

import argparse
import json
import random
import shlex
import statistics
import sys
import time
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path

from gemma_spec_ros.benchmarks.prompts import categories_of, default_prompts_path, load_prompts, take_per_category
from gemma_spec_ros.benchmarks.report import machine_description

BUNDLED = {'target': 'models/gemma4-spec-target', 'assistant': 'models/gemma4-spec-assistant',
           'draft': 'models/gemma4-spec-draft', 'eagle3': 'models/gemma4-spec-eagle3'}
AUTO = 'auto'


def load_engines(args, systems: list[str]) -> dict:
    """Each system's engine: auto's own, one for the others; every drafter's model loaded, warmed up."""
    from gemma_spec_ros.engine import Engine, EngineConfig

    loaded = {}
    for group in dict.fromkeys(AUTO if system == AUTO else 'single' for system in systems):
        print('drafters: loading the {} engine'.format(group), file=sys.stderr, flush=True)
        loaded[group] = Engine.from_config(EngineConfig(
            target_path=args.target, assistant_path=args.assistant, draft_model_path=args.draft,
            # the head makes every target pass tap its states: loaded only where it is measured
            eagle3_path=args.eagle3 if 'eagle3' in systems else '',
            drafter=AUTO if group == AUTO else 'none', device='cpu', dtype='float32', compile=args.compile,
            num_threads=args.threads, warmup='blocking', max_new_tokens_limit=max(2048, args.max_new_tokens)))
    return {system: loaded[AUTO if system == AUTO else 'single'] for system in systems}


def generate(engine, drafter: str, prompt_ids: list[int], max_new_tokens: int) -> dict:
    """One greedy generation with drafter and adaptive K: its figures."""
    from gemma_spec_ros.engine import GenerationRequest

    times = []  # (wall, thread CPU) seconds of the first and the latest delta with tokens

    def on_delta(delta) -> None:
        if delta.token_ids:
            times[1:] = [(time.perf_counter(), time.thread_time())]
            if len(times) == 1:
                times.insert(0, times[0])

    result = engine.generate(GenerationRequest(prompt_ids=prompt_ids, max_new_tokens=max_new_tokens,
                                               drafter=drafter), on_delta=on_delta)
    (first, first_cpu), (last, last_cpu) = times[0], times[-1]
    return {'token_ids': result.token_ids, 'decode_tokens': max(0, len(result.token_ids) - 1),
            'decode_s': last - first, 'decode_cpu_s': last_cpu - first_cpu, 'tau': result.stats.tau,
            'rounds_by_drafter': dict(result.stats.rounds_by_drafter), 'warnings': list(result.warnings)}


def rate(runs: list[dict], clock: str = 'decode_s') -> float:
    """Decode tokens over decode seconds of runs (clock: decode_s, wall, or decode_cpu_s; NaN without time)."""
    seconds = sum(run[clock] for run in runs)
    return sum(run['decode_tokens'] for run in runs) / seconds if seconds > 0 else float('nan')


def summarize(measurements: list[dict], systems: list[str], categories: list[str], repeats: int,
              clock: str) -> list[dict]:
    """Per category (and 'all'): each system's tokens/s (median over repeats), speedups, auto against the best."""
    rows = []
    for category in categories + ['all']:
        row = {'category': category, 'tokens_per_second': {}, 'speedup': {}, 'auto_rounds': {}}
        for system in systems:
            runs = [m for m in measurements if m['system'] == system and category in (m['category'], 'all')]
            row['tokens_per_second'][system] = statistics.median(
                rate([m for m in runs if m['repeat'] == repeat], clock) for repeat in range(repeats))
            if system == AUTO:
                rounds = sum((Counter(run['rounds_by_drafter']) for run in runs), Counter())
                total = sum(rounds.values()) or 1
                row['auto_rounds'] = {name: count / total for name, count in sorted(rounds.items())}
        plain = row['tokens_per_second'].get('none')
        row['speedup'] = {system: value / plain for system, value in row['tokens_per_second'].items()} if plain else {}
        singles = [system for system in systems if system not in ('none', AUTO)]
        if singles:
            best = max(singles, key=lambda system: row['tokens_per_second'][system])
            row['best_single'] = best
            if AUTO in systems:
                row['auto_over_best'] = row['tokens_per_second'][AUTO] / row['tokens_per_second'][best]
        rows.append(row)
    return rows


def markdown(document: dict) -> str:
    """Return the results as markdown tables (wall, CPU): tok/s and speedup per system and category, auto vs best."""
    lines = ['# bench drafters', '', '`{}`'.format(document['command']), '',
             '{} ({} s); parity failures: {}'.format(document['created_utc'], round(document['duration_s']),
                                                   len(document['parity_failures']) or 'none')]
    for title, key in (('wall time', 'summary'), ("the generating thread's CPU time", 'summary_cpu')):
        lines += ['', 'Decode tok/s from {}:'.format(title), ''] + table(document['systems'], document[key])
    return '\n'.join(lines) + '\n'


def table(systems: list[str], rows: list[dict]) -> list[str]:
    """Return the markdown lines of one summary."""
    lines = ['| category | ' + ' | '.join('{} tok/s (×plain)'.format(system) for system in systems) +
             ' | best single | auto / best | auto rounds |',
             '|---|' + '---|' * (len(systems) + 3)]
    for row in rows:
        cells = ['{:.0f} ({:.2f}×)'.format(row['tokens_per_second'][system], row['speedup'].get(system, float('nan')))
                 for system in systems]
        share = ', '.join('{} {:.0%}'.format(name, value) for name, value in row['auto_rounds'].items())
        lines.append('| {} | {} | {} | {} | {} |'.format(
            row['category'], ' | '.join(cells), row.get('best_single', '-'),
            '{:.1%}'.format(row['auto_over_best']) if 'auto_over_best' in row else '-', share or '-'))
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog='python -m gemma_spec_ros bench drafters', description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--target', default=BUNDLED['target'])
    parser.add_argument('--assistant', default=BUNDLED['assistant'], help='MTP assistant (drafter mtp)')
    parser.add_argument('--draft', default=BUNDLED['draft'], help='draft model (drafter draft)')
    parser.add_argument('--eagle3', default=BUNDLED['eagle3'], help='EAGLE-3 head (drafter eagle3)')
    parser.add_argument('--drafters', default='ngram,lookahead,mtp,draft,auto',
                        help='drafters to measure besides plain decoding (none, ngram, lookahead, mtp, draft, '
                             'eagle3, auto)')
    parser.add_argument('--prompts', default=None, help='JSONL prompts (default: the held-out set)')
    parser.add_argument('--per-category', type=int, default=4, help='prompts per category (0: all)')
    parser.add_argument('--max-new-tokens', type=int, default=96)
    parser.add_argument('--repeats', type=int, default=2, help='measured repeats, interleaved')
    parser.add_argument('--compile', default='auto')
    parser.add_argument('--threads', type=int, default=1)
    parser.add_argument('--seed', type=int, default=0, help='seed of the interleaving order')
    parser.add_argument('--out', default='', help='output directory (default bench/results/DATE-drafters)')
    args = parser.parse_args(argv)
    from gemma_spec_ros.engine.types import DRAFTERS

    systems = ['none'] + [name for name in dict.fromkeys(args.drafters.split(',')) if name and name != 'none']
    if any(system not in DRAFTERS for system in systems) or args.repeats < 1:
        parser.error('--drafters: choose from {}; --repeats >= 1'.format(', '.join(DRAFTERS)))
    started = time.time()
    prompts = take_per_category(load_prompts(args.prompts or default_prompts_path()), args.per_category)
    engines = load_engines(args, systems)
    tokenizer = engines['none'].tokenizer
    encoded = {prompt.id: tokenizer(prompt.text).input_ids for prompt in prompts}
    for system in systems:  # untimed: first calls, caches touched
        generate(engines[system], system, encoded[prompts[0].id], 8)
    order, measurements, references, failures = random.Random(args.seed), [], {}, []
    for repeat in range(args.repeats):
        for prompt in prompts:
            names = list(systems)
            order.shuffle(names)
            runs = {name: generate(engines[name], name, encoded[prompt.id], args.max_new_tokens) for name in names}
            reference = references.setdefault(prompt.id, runs['none']['token_ids'])
            for name, run in runs.items():
                if run['token_ids'] != reference:
                    failures.append({'system': name, 'prompt_id': prompt.id, 'repeat': repeat})
                measurements.append({'system': name, 'prompt_id': prompt.id, 'category': prompt.category,
                                     'repeat': repeat, **{key: value for key, value in run.items()
                                                          if key != 'token_ids'}})
            print('repeat {} {}: {}'.format(repeat + 1, prompt.id, ', '.join(
                '{} {:.0f}'.format(name, rate([runs[name]])) for name in systems)), file=sys.stderr, flush=True)
    for engine in {id(engine): engine for engine in engines.values()}.values():
        engine.close()
    document = {
        'created_utc': datetime.fromtimestamp(started, UTC).strftime('%Y-%m-%dT%H:%M:%SZ'),
        'duration_s': time.time() - started,
        'command': 'python -m gemma_spec_ros bench drafters ' + shlex.join(sys.argv[2:] if argv is None else argv),
        'machine': machine_description(args.threads), 'settings': vars(args), 'systems': systems,
        'prompts': [{'id': prompt.id, 'category': prompt.category, 'prompt_tokens': len(encoded[prompt.id])}
                    for prompt in prompts],
        'summary': summarize(measurements, systems, categories_of(prompts), args.repeats, 'decode_s'),
        'summary_cpu': summarize(measurements, systems, categories_of(prompts), args.repeats, 'decode_cpu_s'),
        'parity_failures': failures, 'measurements': measurements}
    out = Path(args.out or 'bench/results/{}-drafters'.format(datetime.now(UTC).strftime('%Y-%m-%d')))
    out.mkdir(parents=True, exist_ok=True)
    (out / 'results.json').write_text(json.dumps(document, indent=1, default=str) + '\n')
    (out / 'results.md').write_text(markdown(document))
    print(markdown(document))
    return 1 if failures else 0


if __name__ == '__main__':
    raise SystemExit(main())
