"""
Our engine against llama.cpp (the engine inside llama_ros) on the same bundled models, interleaved in one run.

Greedy, the held-out code prompts of bench/prompts.jsonl, the same prompt token ids and token budget for every
system, 1 thread each (torch threads for ours, n_threads for llama.cpp). Per repeat and prompt every system runs
once in a shuffled order. Ours: plain float32, n-gram, draft model and MTP at adaptive K; int8 and float16
(engine.quantization of the target and the model drafters) plain, draft model and MTP. llama.cpp
(scripts/llamacpp_worker.py in .venv-llamacpp): plain f32, f16 and Q8_0; prompt lookup and the draft model at each
of them; the MTP assistant is probed and reported. Needs scripts/setup_llamacpp.sh and the GGUFs of
scripts/export_gguf.py (docs/llamacpp.md).

    source scripts/env.sh && flock /tmp/bench.lock python -m gemma_spec_ros bench llamacpp --out bench/results/llamacpp
"""

import argparse
import os
import shlex
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

from gemma_spec_ros.benchmarks.harness import Skipped
from gemma_spec_ros.benchmarks.peers import llamacpp as llamacpp_peers
from gemma_spec_ros.benchmarks.prompts import default_prompts_path, load_prompts
from gemma_spec_ros.benchmarks.report import machine_description, write_json
from gemma_spec_ros.benchmarks.systems import EngineRunner

MODELS = {'target': 'models/gemma4-spec-target', 'draft': 'models/gemma4-spec-draft',
          'assistant': 'models/gemma4-spec-assistant'}


def load_engine(args, quantization: str):
    from gemma_spec_ros.engine import Engine
    from gemma_spec_ros.engine.config_file import resolve_model_path
    from gemma_spec_ros.engine.types import EngineConfig

    options = {'quantization': quantization} if quantization != 'none' else {}
    print('loading our engine (compile {}, quantization {})'.format(args.compile, quantization), file=sys.stderr)
    return Engine.from_config(EngineConfig(
        target_path=resolve_model_path(MODELS['target']), drafter='none', device='cpu', dtype='float32',
        assistant_path=resolve_model_path(MODELS['assistant']), draft_model_path=resolve_model_path(MODELS['draft']),
        max_draft_tokens=args.max_draft_tokens, num_threads=args.threads, compile=args.compile, warmup='blocking',
        **options), progress=lambda message: print('  ' + message, file=sys.stderr))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog='python -m gemma_spec_ros bench llamacpp',
                                     description=__doc__.split('\n\n')[0])
    parser.add_argument('--category', default='code', help="bench/prompts.jsonl category (default code), or 'all'")
    parser.add_argument('--max-new-tokens', type=int, default=128)
    parser.add_argument('--repeats', type=int, default=4)
    parser.add_argument('--threads', type=int, default=1)
    parser.add_argument('--compile', default='auto', help="our engine's engine.compile")
    parser.add_argument('--max-draft-tokens', type=int, default=8, help="our engine's adaptive K ceiling")
    parser.add_argument('--ngram-ks', default='4,10', help="llama.cpp prompt lookup's num_pred_tokens (default "
                                                           "4 and llama-cpp-python's 10)")
    parser.add_argument('--draft-ks', default='3,6', help="llama.cpp draft model's K (default 3, llama.cpp's "
                                                          "--draft-max, and 6)")
    parser.add_argument('--venv', default=str(llamacpp_peers.DEFAULT_VENV))
    parser.add_argument('--gguf', default=str(llamacpp_peers.DEFAULT_GGUF), help='scripts/export_gguf.py --out')
    parser.add_argument('--seed', type=int, default=0)
    parser.add_argument('--out', required=True)
    args = parser.parse_args(argv)
    venv, gguf, out = Path(args.venv), Path(args.gguf), Path(args.out)
    missing = llamacpp_peers.skip_message(venv, gguf)
    if missing:
        print('bench llamacpp: ' + missing, file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()

    import torch
    from transformers import AutoTokenizer

    torch.set_num_threads(args.threads)
    machine = machine_description(args.threads)  # load average at the start
    prompts = [p for p in load_prompts(default_prompts_path()) if args.category in ('all', p.category)]
    if not prompts:
        parser.error('no prompts of category {!r}'.format(args.category))
    from gemma_spec_ros.engine.config_file import resolve_model_path

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(MODELS['target']), local_files_only=True)
    encoded = {prompt.id: tokenizer(prompt.text).input_ids for prompt in prompts}
    skipped = []
    reason = llamacpp_peers.mtp_refusal(venv, gguf, args.threads)
    if reason:
        print('llama.cpp MTP: ' + reason, file=sys.stderr)
        skipped.append(Skipped('llamacpp-f32/mtp', reason))
    engine = load_engine(args, 'none')
    runners = {'ours/none': EngineRunner(engine, 'none', 0)}
    runners |= {'ours/{}/adaptive'.format(drafter): EngineRunner(engine, drafter, 0)
                for drafter in ('ngram', 'draft', 'mtp')}
    for quantization, plain in (('int8', llamacpp_peers.OURS_INT8), ('float16', llamacpp_peers.OURS_FLOAT16)):
        quantized = load_engine(args, quantization)
        runners[plain] = EngineRunner(quantized, 'none', 0)
        runners |= {'{}/{}/adaptive'.format(plain.split('/')[0], drafter): EngineRunner(quantized, drafter, 0)
                    for drafter in ('draft', 'mtp')}
    worker = llamacpp_peers.LlamaCppWorker(venv, gguf, args.threads, out / 'llamacpp_worker.log')
    systems = llamacpp_peers.llamacpp_systems([int(k) for k in args.ngram_ks.split(',')],
                                              [int(k) for k in args.draft_ks.split(',')])
    runners |= {system: llamacpp_peers.LlamaCppRunner(worker, system) for system in systems}
    steps = [0]

    def on_step(name: str) -> None:
        steps[0] += 1
        if steps[0] % len(runners) == 0:
            print('{} generations ({})'.format(steps[0], name), file=sys.stderr, flush=True)

    try:
        measurements = llamacpp_peers.interleave(runners, prompts, encoded, args.repeats, args.max_new_tokens,
                                                 args.seed, on_step)
    finally:
        worker.close()
    rows = llamacpp_peers.rows_of(measurements)
    ratios = llamacpp_peers.comparisons(rows, measurements)
    table = llamacpp_peers.markdown(rows, ratios, skipped)
    command = 'python -m gemma_spec_ros bench llamacpp ' + shlex.join(sys.argv[1:] if argv is None else argv)
    document = {
        'created_utc': datetime.fromtimestamp(started, UTC).strftime('%Y-%m-%dT%H:%M:%SZ'),
        'duration_s': time.time() - started, 'command': command,
        'machine': machine | {'llama_cpp': worker.info.get('llama_cpp'),
                              'llama_cpp_system_info': worker.info.get('system_info')},
        'load_average_end': list(os.getloadavg()), 'settings': vars(args),
        'prompts': [{'id': p.id, 'prompt_tokens': len(encoded[p.id])} for p in prompts],
        'rows': rows, 'comparisons': ratios, 'skipped': skipped, 'measurements': measurements}
    write_json(out / 'results.json', document)
    (out / 'results.md').write_text('`{}`\n\n{}'.format(command, table))
    print(table)
    print('wrote {}/results.json and results.md'.format(out))
    return 0


if __name__ == '__main__':
    sys.exit(main())
