r"""
The prefix cache's figures: time to first token with a long fixed system prompt, cold against a hit.

And a planner loop of calls that share it, end to end, with the cache on and off (one interleaved run).

    python -m gemma_spec_ros bench prefix                                   # bundled target, 1 thread
    python -m gemma_spec_ros bench prefix --target /tmp/gemma_spec_e2b/target --quantization int8 \\
        --compile eager --repeats 1 --calls 2 --no-off --threads 2                 # the E2B shape (e2b-write)

Each call is a chat turn: the system prompt (--system-tokens of held-out text, the same on every call) and a
user turn of about --state-tokens (a robot state that changes per call). Cold: the cache cleared first; hit: the
same system prompt cached by the call before; off: an engine with engine.prefix_cache_mb 0 (one-pass prefill).
Greedy outputs of a hit and a cold call of the same prompt are compared.
"""

import argparse
import json
import statistics
import time
from datetime import UTC, datetime
from pathlib import Path

from gemma_spec_ros.benchmarks.report import machine_description

REPO = Path(__file__).resolve().parents[3]
SCENES = ('a red cup on the kitchen table', 'a blue book on the sofa', 'a green mug on the counter',
          'a yellow sponge by the sink', 'a black remote on the shelf')


def _say(message: str) -> None:
    print(message, flush=True)


def system_prompt(tokenizer, tokens: int) -> str:
    """Held-out prompts of bench/prompts.jsonl joined, cut to about tokens tokens: the fixed system turn."""
    texts = [json.loads(line)['prompt'] for line in (REPO / 'bench' / 'prompts.jsonl').read_text().splitlines()]
    ids = tokenizer('\n\n'.join(texts * 8), add_special_tokens=False).input_ids[:tokens]
    return tokenizer.decode(ids)


def state(call: int, tokens: int) -> str:
    """Return a robot state of about tokens tokens, different on every call."""
    words = []
    while len(' '.join(words)) < tokens * 4:
        words.append('Scene: {}, {} at {} cm.'.format(SCENES[call % len(SCENES)], SCENES[(call + 2) % len(SCENES)],
                                                      12 * call + len(words)))
    return ' '.join(words)[:tokens * 4] + '\nWhat next?'


def request(system: str, call: int, args, new_tokens: int):
    from gemma_spec_ros.engine import GenerationRequest

    return GenerationRequest(messages=[{'role': 'system', 'content': system},
                                       {'role': 'user', 'content': state(call, args.state_tokens)}],
                             max_new_tokens=new_tokens, drafter=args.drafter)


def load(args, prefix_cache_mb: float):
    from gemma_spec_ros.engine import Engine, EngineConfig

    return Engine.from_config(EngineConfig(
        target_path=args.target, assistant_path=args.assistant, draft_model_path=args.draft, drafter=args.drafter,
        quantization=args.quantization, compile=args.compile, dtype=args.dtype, num_threads=args.threads,
        warmup='blocking' if args.compile != 'eager' else 'off', context_limit=args.context,
        prefix_cache_mb=prefix_cache_mb), progress=_say)


def measure(args) -> dict:
    engines = {'on': load(args, args.prefix_cache_mb)}
    if not args.no_off:  # a second engine: too much memory at the E2B shape
        engines['off'] = load(args, 0.0)
    system = system_prompt(engines['on'].tokenizer, args.system_tokens)
    ttft = {'cold': [], 'hit': [], 'off': []}
    prompt_tokens, reused, same = 0, [], True
    for repeat in range(args.repeats):
        engines['on'].clear_prefix_cache()
        cold = engines['on'].generate(request(system, 2 * repeat, args, 1))
        hit = engines['on'].generate(request(system, 2 * repeat + 1, args, 1))
        ttft['cold'].append(cold.stats.time_to_first_token)
        ttft['hit'].append(hit.stats.time_to_first_token)
        if 'off' in engines:
            ttft['off'].append(engines['off'].generate(request(system, 2 * repeat + 1, args, 1)
                                                       ).stats.time_to_first_token)
        prompt_tokens, reused = hit.stats.prompt_tokens, reused + [hit.stats.cached_prompt_tokens]
        # lossless: a hit's greedy reply is the cold prefill's, for the same prompt
        engines['on'].clear_prefix_cache()
        again_cold = engines['on'].generate(request(system, 2 * repeat + 1, args, args.new_tokens))
        again_hit = engines['on'].generate(request(system, 2 * repeat + 1, args, args.new_tokens))
        same &= again_cold.token_ids == again_hit.token_ids and again_hit.stats.cached_prompt_tokens > 0
    loop = {}
    for name in sorted(engines, reverse=args.repeats % 2 == 1):
        engines[name].clear_prefix_cache()
        started = time.perf_counter()
        for call in range(args.calls):
            engines[name].generate(request(system, call, args, args.new_tokens))
        loop[name] = time.perf_counter() - started
    status = engines['on'].status().prefix_cache
    for engine in engines.values():
        engine.close()
    median = {name: statistics.median(values) if values else float('nan') for name, values in ttft.items()}
    return {
        'target': args.target, 'quantization': args.quantization, 'compile': args.compile, 'threads': args.threads,
        'drafter': args.drafter, 'machine': machine_description(args.threads), 'date': datetime.now(UTC).isoformat(),
        'prompt_tokens': prompt_tokens, 'reused_tokens': reused, 'repeats': args.repeats,
        'ttft_s': {name: [round(v, 4) for v in values] for name, values in ttft.items()},
        'ttft_median_s': {name: round(v, 4) for name, v in median.items()},
        'hit_over_cold': round(median['hit'] / median['cold'], 3),
        'hit_over_off': round(median['hit'] / median['off'], 3),
        'loop_calls': args.calls, 'loop_new_tokens': args.new_tokens,
        'loop_s': {name: round(v, 2) for name, v in loop.items()},
        'loop_speedup': round(loop['off'] / loop['on'], 3) if 'off' in loop else None, 'identical_tokens': same,
        'prefix_cache_mib': round(status.nbytes / 2 ** 20, 1), 'hit_rate': round(status.hit_rate, 3)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog='python -m gemma_spec_ros bench prefix',
                                     description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    models = REPO / 'models'
    parser.add_argument('--target', default=str(models / 'gemma4-spec-target'))
    parser.add_argument('--assistant', default=str(models / 'gemma4-spec-assistant'))
    parser.add_argument('--draft', default=str(models / 'gemma4-spec-draft'))
    parser.add_argument('--drafter', default='mtp', help='drafter of every call (default mtp)')
    parser.add_argument('--quantization', default='none', help='none, int8 or int4 (engine.quantization)')
    parser.add_argument('--dtype', default='float32')
    parser.add_argument('--compile', default='auto', help='engine.compile (eager for the E2B shape: no compile)')
    parser.add_argument('--threads', type=int, default=1)
    parser.add_argument('--context', type=int, default=4096)
    parser.add_argument('--system-tokens', type=int, default=1500)
    parser.add_argument('--state-tokens', type=int, default=40)
    parser.add_argument('--prefix-cache-mb', type=float, default=256.0)
    parser.add_argument('--repeats', type=int, default=5, help='cold / hit / off triples, interleaved')
    parser.add_argument('--calls', type=int, default=10, help='calls of the planner loop')
    parser.add_argument('--new-tokens', type=int, default=32, help='new tokens per loop call')
    parser.add_argument('--no-off', action='store_true', help='leave out the engine without a prefix cache')
    parser.add_argument('--out', default='', help='write the figures as JSON here')
    args = parser.parse_args(argv)
    if args.drafter != 'draft':
        args.draft = ''
    if args.drafter != 'mtp':
        args.assistant = ''
    figures = measure(args)
    print(json.dumps(figures, indent=1))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(figures, indent=1) + '\n')
    return 0


if __name__ == '__main__':
    raise SystemExit(main())
