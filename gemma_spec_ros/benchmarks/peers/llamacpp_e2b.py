r"""
Our engine against llama.cpp at the Gemma 4 E2B shape (random weights, 262k vocabulary, per-layer embeddings).

Each (engine, precision, threads) runs in a fresh process, so peak RSS is its own; the pairs alternate (ours,
then llama.cpp's, then the next pair) so both see the same machine. Same random prompt ids on both sides. Per
run: load time (ours: from the bfloat16 checkpoint, quantizing; llama.cpp: the GGUF, memory-mapped), prompt
processing of --prompt-tokens and --long-prompt tokens, plain greedy decode of --new-tokens after the shorter
prompt, peak RSS, and the bytes one decode step reads (every weight but the per-layer token embeddings, of which a
token reads one row). The roofline is this machine's read bandwidth (bench bandwidth, at the same thread count)
over those bytes: the decode rate no implementation of that weight format can pass.

Pairs: our int8 / Q8_0, our int4 / Q4_0 (Q4_K_M beside it), our float16 weights / f16.

    python -m gemma_spec_ros bench quantization e2b-write --models /work/e2b/hf
    .venv-llamacpp/bin/python scripts/export_gguf.py --out /work/e2b/gguf --source /work/e2b/hf/target \
        --name e2b --outtypes f16 --quantize q8_0,q4_0,q4_k_m
    python -m gemma_spec_ros bench llamacpp-e2b --models /work/e2b/hf --gguf /work/e2b/gguf --out DIR
"""

import argparse
import json
import os
import resource
import shlex
import subprocess
import sys
import time
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path

from gemma_spec_ros.benchmarks.decode import bandwidth
from gemma_spec_ros.benchmarks.peers.llamacpp import DEFAULT_VENV, WORKER
from gemma_spec_ros.benchmarks.report import machine_description, write_json

# our precision -> llama.cpp types measured beside it (the first is its pair)
PAIRS = {'int8': ('q8_0',), 'int4': ('q4_0', 'q4_k_m'), 'float16': ('f16',)}


def prompt_ids(length: int, seed: int) -> list[int]:
    """Return the random prompt both engines read (scripts/llamacpp_worker.py draws the same ids)."""
    import numpy as np

    return [int(token) for token in np.random.default_rng(seed).integers(10, 4000, size=length)]


def measure_ours(models: Path, precision: str, threads: int, compile_mode: str, prompt_tokens: int,
                 long_prompt: int, new_tokens: int, seed: int) -> dict:
    """Load, prompt processing at two lengths, and plain greedy decode of our engine, in this process."""
    import torch

    from gemma_spec_ros.benchmarks.decode.quantization import load_runner, plain_decode
    from gemma_spec_ros.engine.runtime.quant.quantize import stored_bytes
    from gemma_spec_ros.engine.runtime.steps.causal_lm import weights_bytes

    torch.set_num_threads(threads)
    prompt = prompt_ids(max(prompt_tokens, long_prompt), seed)
    runner, loaded = load_runner(str(models / 'target'), precision, compile_mode,
                                 max(prompt_tokens, long_prompt) + new_tokens + 8)
    started = time.perf_counter()
    plain_decode(runner, prompt[:16], 3)  # the one-token step's graph (compile_mode inductor)
    compiled = time.perf_counter() - started
    prompt_seconds = {}
    with torch.inference_mode():
        for length in sorted({prompt_tokens, long_prompt} - {0}):
            runner.reset()
            started = time.perf_counter()
            runner.prefill(torch.tensor([prompt[:length]]))
            prompt_seconds[length] = time.perf_counter() - started
    tokens, per_token = plain_decode(runner, prompt[:prompt_tokens], new_tokens)
    lean = getattr(runner, 'lean', None)  # the lean forward holds the tables as the steps read them
    skipped = stored_bytes(lean.per_layer_embed) if getattr(lean, 'per_layer_size', 0) else 0
    return {'precision': precision, 'threads': threads, 'compile': compile_mode, 'load_s': round(loaded, 2),
            'first_steps_s': round(compiled, 2),
            'prompt_tokens_per_s': {str(n): round(n / s, 2) for n, s in prompt_seconds.items()},
            'decode_tokens_per_s': round(1 / per_token, 3), 'new_tokens': new_tokens,
            'peak_rss_gib': round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20, 3),
            'step_bytes': weights_bytes(runner) - skipped, 'token_ids': tokens}


def _child(command: list[str], env: dict | None = None) -> dict:
    """Run one measurement process; its last stdout line is the JSON answer."""
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        return {'error': 'exit {}: {}'.format(done.returncode, done.stderr.strip()[-600:])}
    return json.loads(lines[-1])


def _ours_command(args, precision: str, threads: int) -> list[str]:
    return [sys.executable, '-m', 'gemma_spec_ros', 'bench', 'llamacpp-e2b', '--one-ours', precision,
            '--threads-one', str(threads), '--models', args.models, '--compile', args.compile,
            '--prompt-tokens', str(args.prompt_tokens), '--long-prompt', str(args.long_prompt),
            '--new-tokens', str(args.new_tokens), '--seed', str(args.seed)]


def _llamacpp_command(args, kind: str, threads: int) -> list[str]:
    return [str(Path(args.venv) / 'bin' / 'python'), str(WORKER), '--measure',
            str(Path(args.gguf) / '{}-{}.gguf'.format(args.name, kind)), '--threads', str(threads),
            '--prompt-tokens', str(args.prompt_tokens), '--long-prompt', str(args.long_prompt),
            '--new-tokens', str(args.new_tokens), '--seed', str(args.seed)]


def _with_roofline(row: dict, read_gb_s: float) -> dict:
    if 'error' in row:
        return row
    roofline = read_gb_s * 1e9 / row['step_bytes']
    return row | {'roofline_tokens_per_s': round(roofline, 3),
                  'of_roofline': round(row['decode_tokens_per_s'] / roofline, 3)}


def markdown(rows: list[dict], bandwidths: dict) -> str:
    lines = ['| threads | system | decode tok/s | of roofline | prompt tokens: tok/s | load s | peak RSS GiB '
             '| step GB |', '|---|---|---|---|---|---|---|---|']
    for row in rows:
        if 'error' in row:
            lines.append('| {} | {} | error: {} | | | | | |'.format(row['threads'], row['system'],
                                                                   row['error'][-160:]))
            continue
        prompt = ' / '.join('{}: {:.1f}'.format(n, value) for n, value in row['prompt_tokens_per_s'].items())
        lines.append('| {} | {} | {:.2f} | {:.0%} | {} | {:.1f} | {:.2f} | {:.2f} |'.format(
            row['threads'], row['system'], row['decode_tokens_per_s'], row['of_roofline'], prompt, row['load_s'],
            row['peak_rss_gib'], row['step_bytes'] / 1e9))
    lines += ['', 'Read bandwidth (bench bandwidth): ' + ', '.join(
        '{} thread(s) {:.1f} GB/s'.format(threads, value['read_gb_s']) for threads, value in bandwidths.items())]
    return '\n'.join(lines) + '\n'


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog='python -m gemma_spec_ros bench llamacpp-e2b', description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--models', default='/tmp/gemma_spec_e2b', help='bench quantization e2b-write --models')
    parser.add_argument('--gguf', default='/tmp/gemma_spec_e2b/gguf', help='scripts/export_gguf.py --out')
    parser.add_argument('--name', default='e2b', help='scripts/export_gguf.py --name')
    parser.add_argument('--venv', default=str(DEFAULT_VENV))
    parser.add_argument('--precisions', default=','.join(PAIRS), help='ours, comma-separated: ' + ', '.join(PAIRS))
    parser.add_argument('--threads', default='1,2', help='comma-separated thread counts')
    parser.add_argument('--compile', default='inductor', help="our engine's engine.compile")
    parser.add_argument('--prompt-tokens', type=int, default=512)
    parser.add_argument('--long-prompt', type=int, default=2048, help='a second prompt length (0: none)')
    parser.add_argument('--new-tokens', type=int, default=128)
    parser.add_argument('--seed', type=int, default=0)
    parser.add_argument('--out', help='folder for results.json and results.md')
    parser.add_argument('--one-ours', choices=tuple(PAIRS), help=argparse.SUPPRESS)
    parser.add_argument('--threads-one', type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one_ours:  # the child process of one of our rows
        print(json.dumps(measure_ours(Path(args.models), args.one_ours, args.threads_one, args.compile,
                                      args.prompt_tokens, args.long_prompt, args.new_tokens, args.seed)))
        return 0
    precisions = [name.strip() for name in args.precisions.split(',') if name.strip()]
    unknown = [name for name in precisions if name not in PAIRS]
    if unknown or not args.out:
        parser.error('--out is required; --precisions from {} (got {})'.format(', '.join(PAIRS), unknown))
    threads = [int(value) for value in args.threads.split(',')]
    started = time.time()
    machine = machine_description(1)
    bandwidths = {count: asdict(bandwidth.measure(count)) for count in threads}
    rows = []
    for count in threads:
        for precision in precisions:
            jobs = [('ours-{}'.format(precision), _ours_command(args, precision, count), None)]
            jobs += [('llamacpp-{}'.format(kind), _llamacpp_command(args, kind, count),
                      os.environ | {'OMP_NUM_THREADS': str(count), 'GGML_NO_BACKTRACE': '1'})
                     for kind in PAIRS[precision]]
            for system, command, env in jobs:
                print('{} at {} thread(s)'.format(system, count), file=sys.stderr, flush=True)
                row = {'system': system, 'threads': count} | _child(command, env)
                rows.append(_with_roofline(row, bandwidths[count]['read_gb_s']))
                print('  ' + json.dumps({k: v for k, v in row.items() if k != 'token_ids'}), file=sys.stderr,
                      flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = 'python -m gemma_spec_ros bench llamacpp-e2b ' + shlex.join(sys.argv[1:] if argv is None else argv)
    table = markdown(rows, bandwidths)
    write_json(out / 'results.json', {
        'created_utc': datetime.fromtimestamp(started, UTC).strftime('%Y-%m-%dT%H:%M:%SZ'),
        'duration_s': round(time.time() - started, 1), 'command': command, 'machine': machine,
        'load_average_end': list(os.getloadavg()), 'settings': vars(args), 'bandwidth': bandwidths, 'rows': rows})
    (out / 'results.md').write_text('`{}`\n\n{}'.format(command, table))
    print(table)
    return 0


if __name__ == '__main__':
    sys.exit(main())
