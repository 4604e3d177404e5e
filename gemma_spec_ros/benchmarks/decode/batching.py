"""
Continuous batching: aggregate and per-goal decode speed of 1, 2, 4 and 8 concurrent goals, one engine.

``python -m gemma_spec_ros bench batching [--concurrency 1,2,4,8] [--drafters none,ngram,mtp]``

Each level sends that many goals at once, each from a thread of its own, over the held-out prompts (one prompt per
goal, in turn), and waits for all of them before the next wave. Two engines on the same weights files: "one at a
time" (engine.max_batch 1, the single-goal path, concurrency 1) and "batched" (max_batch = the highest level, every
level, 1 included). Reported per engine, level and drafter: aggregate decode tokens/s (all goals' new tokens over
the wave's wall time), per-goal decode tokens/s (median), TTFT p50 and p95 (from the call to the first token: it
includes the wait for a slot) and the mean tau. Levels and engines are interleaved over --repeats, so that drift
hits them alike.
"""

import argparse
import dataclasses
import json
import tempfile
import threading
import time

from gemma_spec_ros.benchmarks.decode.fast_measure import write_random_models
from gemma_spec_ros.benchmarks.prompts import default_prompts_path, load_prompts
from gemma_spec_ros.engine.stats import percentile


@dataclasses.dataclass
class Wave:
    """One level's goals sent at once: their results and first-token times."""

    concurrency: int
    drafter: str
    seconds: float
    new_tokens: list[int]
    decode_tokens_per_second: list[float]
    ttft: list[float]
    tau: list[float]


def send_at_once(generate, count: int) -> tuple[list, list[float], float]:
    """
    Run count goals at once, each in a thread of its own, and wait for all of them.

    generate(index, on_delta) runs goal index. Returns the results, each goal's first-token time from the start
    (it includes the wait for a slot), and the wall time.
    """
    results, first_token = [None] * count, [0.0] * count
    started = time.perf_counter()

    def run(index):
        def on_delta(delta):
            if not first_token[index]:
                first_token[index] = time.perf_counter()
        results[index] = generate(index, on_delta)

    threads = [threading.Thread(target=run, args=(index,)) for index in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results, [moment - started for moment in first_token], time.perf_counter() - started


def run_wave(engine, prompts: list[list[int]], concurrency: int, drafter: str, k: int,
             max_new_tokens: int) -> Wave:
    """Send concurrency goals at once (prompts taken in turn) and wait for them."""
    from gemma_spec_ros.engine import GenerationRequest

    def generate(index, on_delta):
        request = GenerationRequest(prompt_ids=prompts[index % len(prompts)], max_new_tokens=max_new_tokens,
                                    drafter=drafter, num_draft_tokens=k if drafter != 'none' else 0)
        return engine.generate(request, on_delta=on_delta)

    results, ttft, seconds = send_at_once(generate, concurrency)
    return Wave(concurrency, drafter, seconds, [len(result.token_ids) for result in results],
                [result.stats.tokens_per_second for result in results], ttft,
                [result.stats.tau for result in results])


def summarize(waves: list[Wave]) -> dict:
    """Aggregate tokens/s, per-goal tokens/s (median), TTFT p50/p95 and tau over a level's waves."""
    tokens = sum(sum(wave.new_tokens) for wave in waves)
    seconds = sum(wave.seconds for wave in waves)
    per_goal = [value for wave in waves for value in wave.decode_tokens_per_second]
    ttft = [value for wave in waves for value in wave.ttft]
    tau = [value for wave in waves for value in wave.tau]
    return {'concurrency': waves[0].concurrency, 'drafter': waves[0].drafter,
            'aggregate_tokens_per_second': tokens / seconds, 'per_goal_tokens_per_second_p50': percentile(per_goal, 50),
            'ttft_p50_s': percentile(ttft, 50), 'ttft_p95_s': percentile(ttft, 95), 'tau_mean': sum(tau) / len(tau),
            'waves': len(waves)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog='python -m gemma_spec_ros bench batching', description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--target', default='models/gemma4-spec-target')
    parser.add_argument('--assistant', default='models/gemma4-spec-assistant', help='MTP assistant (drafter mtp)')
    parser.add_argument('--concurrency', default='1,2,4,8', help='goals sent at once, per level')
    parser.add_argument('--drafters', default='none,ngram,mtp', help='drafters of the goals (none, ngram, mtp)')
    parser.add_argument('--num-draft-tokens', type=int, default=4, help='K of the speculating goals')
    parser.add_argument('--max-new-tokens', type=int, default=64)
    parser.add_argument('--prompts', default=None, help='JSONL prompts (default: the held-out set)')
    parser.add_argument('--repeats', type=int, default=2, help='waves per level, interleaved')
    parser.add_argument('--compile', default='auto')
    parser.add_argument('--threads', type=int, default=1)
    parser.add_argument('--warmup', default='blocking', choices=('blocking', 'off'),
                        help='off: each graph compiles when first used, in an untimed wave (fewer graphs: only the '
                             'steps the levels use)')
    parser.add_argument('--random-target', default='', metavar='LAYERSxHIDDENxINTERMEDIATE',
                        help='instead of --target/--assistant: random-weight models of this shape (e.g. 12x1536x6144, '
                             'about 1.8 GB in float32: memory-bound decoding), written to a temporary folder')
    parser.add_argument('--out', default='', help='write the summary as JSON here')
    args = parser.parse_args(argv)
    levels = [int(value) for value in args.concurrency.split(',')]
    drafters = args.drafters.split(',')
    if min(levels) < 1:
        parser.error('--concurrency levels must be >= 1')

    from gemma_spec_ros.engine import Engine, EngineConfig

    scratch = tempfile.TemporaryDirectory(prefix='gemma-spec-batching-')
    if args.random_target:
        print('batching: writing random-weight models of shape {}'.format(args.random_target), flush=True)
        args.target, args.assistant = write_random_models(args.random_target, scratch.name)
    max_batch = max(levels)
    engines = {}
    for name, batch in (('one at a time', 1), ('batched', max_batch)):
        config = EngineConfig(target_path=args.target, assistant_path=args.assistant if 'mtp' in drafters else '',
                              drafter=drafters[0], compile=args.compile, num_threads=args.threads,
                              warmup=args.warmup, max_batch=batch)
        print('batching: loading {} engine (max_batch {}, compile {}, warm-up {})'.format(
            name, batch, args.compile, args.warmup), flush=True)
        engines[name] = Engine.from_config(config, progress=lambda message: print('  ' + message, flush=True))
    tokenizer = engines['batched'].tokenizer
    prompts = [tokenizer(prompt.text).input_ids for prompt in load_prompts(args.prompts or default_prompts_path())]
    plan = [('one at a time', 1)] + [('batched', level) for level in levels]
    for drafter in drafters:  # an untimed wave each: steps compiled on first use (warm-up off), caches touched
        for name, level in plan:
            run_wave(engines[name], prompts, level, drafter, args.num_draft_tokens, args.max_new_tokens)
    waves: dict[tuple[str, int, str], list[Wave]] = {}
    for repeat in range(args.repeats):
        for drafter in drafters:
            for name, level in plan:
                wave = run_wave(engines[name], prompts[repeat * max_batch:] + prompts, level, drafter,
                                args.num_draft_tokens, args.max_new_tokens)
                waves.setdefault((name, level, drafter), []).append(wave)
                print('repeat {} drafter {:<6} {:<13} {} at once: {:.0f} tok/s aggregate in {:.1f} s'.format(
                    repeat + 1, drafter, name, level, sum(wave.new_tokens) / wave.seconds, wave.seconds), flush=True)
    for engine in engines.values():
        engine.close()
    scratch.cleanup()
    rows = [{'engine': key[0], **summarize(level_waves)} for key, level_waves in waves.items()]
    print('\n| drafter | engine | goals at once | aggregate tok/s | x one at a time | per-goal tok/s p50 | '
          'TTFT p50 / p95 | tau |')
    print('|---|---|---|---|---|---|---|---|')
    for row in rows:
        alone = next(other for other in rows if other['drafter'] == row['drafter'] and
                     other['engine'] == 'one at a time')
        print('| {} | {} | {} | {:.0f} | {:.2f} | {:.0f} | {:.2f} / {:.2f} s | {:.2f} |'.format(
            row['drafter'], row['engine'], row['concurrency'], row['aggregate_tokens_per_second'],
            row['aggregate_tokens_per_second'] / alone['aggregate_tokens_per_second'],
            row['per_goal_tokens_per_second_p50'], row['ttft_p50_s'], row['ttft_p95_s'], row['tau_mean']))
    if args.out:
        with open(args.out, 'w', encoding='utf-8') as out:
            json.dump({'config': vars(args), 'rows': rows}, out, indent=2)
    return 0


if __name__ == '__main__':
    raise SystemExit(main())
