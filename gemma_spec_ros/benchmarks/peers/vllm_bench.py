"""
Side by side on the same prompts: the local engine vs the vLLM backend, and 1 vs N concurrent clients on one server.

Greedy, the same prompt token ids for every system, the bundled target in float32, one torch thread for the local
engine and OMP_NUM_THREADS=1 for the server. The servers run with prefix caching off, so that repeated prompts do
not skip their prefill. Local and vLLM runs alternate prompt by prompt (same machine load); medians over
prompts x repeats. The figures are noisy on a shared machine.

    source scripts/env.sh && python -m gemma_spec_ros bench vllm --category code --out /tmp/bench.json

With ``--local-max-batch N`` (N > 1) the local side is a batched engine (engine.max_batch N, blocking warm-up) and
both systems serve N concurrent clients the same way: a wave sends N goals at once, each from a thread of its own
(prompts taken in turn), and waits for all of them; local and vLLM waves alternate over --repeats. Reported per
system: aggregate decode tokens/s (all new tokens over each wave's wall time; median of waves), per-goal tokens/s
and TTFT (from the wave's start to the goal's first token, so it includes a wait for a slot; medians over goals),
and our/vLLM ratios of the aggregate, wave by wave. The local engine runs n-gram goals with num_draft_tokens
--ngram-k, as the server does.

    python -m gemma_spec_ros bench vllm --local-max-batch 4 --repeats 5 --out /tmp/bench_batch.json
"""

import argparse
import json
import statistics
import threading
import time
from pathlib import Path

from gemma_spec_ros.benchmarks.decode.batching import send_at_once
from gemma_spec_ros.engine.backends.vllm import VllmBackend, VllmConfig
from gemma_spec_ros.engine.backends.vllm_metrics import metric_samples
from gemma_spec_ros.engine.backends.vllm_server import (
    DEFAULT_TARGET,
    REPO_ROOT,
    VllmServer,
    VllmServerConfig,
    ngram_speculative_config,
)
from gemma_spec_ros.engine.types import EngineConfig, GenerationRequest


def server_sum(backend: VllmBackend, name: str) -> float:
    return sum(value for sample, _, value in metric_samples(backend.metrics_text(), backend.model())
               if sample == name)


def summarize(rows: list[dict]) -> dict:
    return {key: statistics.median(row[key] for row in rows) for key in rows[0]}


def load_local_engine(max_batch: int = 1, compile_mode: str = 'auto'):
    import torch

    from gemma_spec_ros.engine import Engine, EngineConfig

    torch.set_num_threads(1)
    if max_batch == 1 and compile_mode == 'auto':
        return Engine.from_config(EngineConfig(target_path=str(DEFAULT_TARGET), drafter='none', device='cpu',
                                               dtype='float32', num_threads=1))
    print('loading the local engine (max_batch {}, compile {}, blocking warm-up)'.format(max_batch, compile_mode),
          flush=True)
    return Engine.from_config(EngineConfig(target_path=str(DEFAULT_TARGET), drafter='none', device='cpu',
                                           dtype='float32', num_threads=1, max_batch=max_batch,
                                           compile=compile_mode, warmup='blocking'),
                              progress=lambda message: print('  ' + message, flush=True))


def run_local(engine, prompt_ids: list[int], max_new: int, drafter: str) -> dict:
    stats = engine.generate(GenerationRequest(prompt_ids=prompt_ids, max_new_tokens=max_new, drafter=drafter)).stats
    return {'tokens_per_second': stats.tokens_per_second, 'ttft': stats.time_to_first_token, 'tau': stats.tau}


def run_backend(backend: VllmBackend, prompt_ids: list[int], max_new: int) -> dict:
    ttft_sum = server_sum(backend, 'time_to_first_token_seconds_sum')
    e2e_sum = server_sum(backend, 'e2e_request_latency_seconds_sum')
    result = backend.generate(GenerationRequest(prompt_ids=prompt_ids, max_new_tokens=max_new))
    time.sleep(0.05)   # let the server record the request's histograms
    stats = result.stats
    server_ttft = server_sum(backend, 'time_to_first_token_seconds_sum') - ttft_sum
    server_e2e = server_sum(backend, 'e2e_request_latency_seconds_sum') - e2e_sum
    return {'tokens_per_second': stats.tokens_per_second, 'ttft': stats.time_to_first_token, 'tau': stats.tau,
            'server_ttft': server_ttft, 'ttft_overhead': stats.time_to_first_token - server_ttft,
            'wall_overhead': stats.wall_time - server_e2e}


def run_concurrent(url: str, prompts: list[list[int]], max_new: int, clients: int) -> float:
    """Each client (its own backend, like a node) runs every prompt in turn; aggregate tokens/s over the wall."""
    backends = [VllmBackend(EngineConfig(), VllmConfig(url=url, model='target', metrics=False)) for _ in range(clients)]
    tokens = [0] * clients

    def client(index):
        for offset in range(len(prompts)):
            prompt_ids = prompts[(index + offset) % len(prompts)]
            result = backends[index].generate(GenerationRequest(prompt_ids=prompt_ids, max_new_tokens=max_new))
            assert result.finish_reason in ('stop', 'length'), result.error
            tokens[index] += result.stats.new_tokens

    threads = [threading.Thread(target=client, args=(index,)) for index in range(clients)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sum(tokens) / (time.perf_counter() - started)


def run_wave(generate, prompts: list[list[int]], clients: int, first: int) -> dict:
    """
    Send clients goals at once (prompts taken in turn from first), each from its own thread; wait for all.

    generate(index, prompt_ids, on_delta) runs one goal and returns its result. TTFT is from the wave's start.
    """
    results, ttft, seconds = send_at_once(
        lambda index, on_delta: generate(index, prompts[(first + index) % len(prompts)], on_delta), clients)
    for result in results:
        assert result.finish_reason in ('stop', 'length'), getattr(result, 'error', result.finish_reason)
    return {'seconds': seconds, 'new_tokens': sum(result.stats.new_tokens for result in results),
            'aggregate': sum(result.stats.new_tokens for result in results) / seconds,
            'per_goal': [result.stats.tokens_per_second for result in results],
            'ttft': ttft,
            'tau': [result.stats.tau for result in results],
            'outputs': {(first + index) % len(prompts): list(result.token_ids) for index, result in enumerate(results)}}


def summarize_waves(waves: list[dict]) -> dict:
    per_goal = [value for wave in waves for value in wave['per_goal']]
    ttft = [value for wave in waves for value in wave['ttft']]
    tau = [value for wave in waves for value in wave['tau'] if value == value and value > 0]
    return {'aggregate_tokens_per_second': statistics.median(wave['aggregate'] for wave in waves),
            'aggregate_tokens_per_second_waves': [round(wave['aggregate'], 1) for wave in waves],
            'per_goal_tokens_per_second_p50': statistics.median(per_goal),
            'ttft_p50_s': statistics.median(ttft),
            'tau_mean': sum(tau) / len(tau) if tau else float('nan'),
            'new_tokens_per_wave': [wave['new_tokens'] for wave in waves],
            'waves': len(waves)}


def start_server(speculative: dict | None) -> VllmServer:
    """Start a vLLM server of the bundled target with this speculation (None = plain), prefix caching off."""
    server = VllmServer(VllmServerConfig(speculative_config=speculative, log_requests=False,
                                         extra_args=['--no-enable-prefix-caching']))
    server.start(progress=lambda message: print(message, flush=True))
    return server


def run_batched_phase(engine, name: str, speculative: dict | None, drafter: str, prompts: list[list[int]],
                      args) -> dict:
    """One server; waves of --clients goals alternate between the batched local engine and the vLLM server."""
    server = start_server(speculative)
    try:
        backends = [VllmBackend(EngineConfig(), VllmConfig(url=server.url, model='target', metrics=False))
                    for _ in range(args.clients)]   # one per client, like one node per robot
        k = args.ngram_k if drafter == 'ngram' else 0

        def local(index, prompt_ids, on_delta):
            return engine.generate(GenerationRequest(prompt_ids=prompt_ids, max_new_tokens=args.max_new_tokens,
                                                     drafter=drafter, num_draft_tokens=k), on_delta=on_delta)

        def served(index, prompt_ids, on_delta):
            return backends[index].generate(GenerationRequest(prompt_ids=prompt_ids,
                                                              max_new_tokens=args.max_new_tokens), on_delta=on_delta)

        for generate in (local, served):   # a warm-up wave each
            run_wave(generate, prompts, args.clients, 0)
        ours, theirs = [], []
        for repeat in range(args.repeats):
            order = (('local', local), ('vllm', served)) if repeat % 2 == 0 else (('vllm', served), ('local', local))
            for system, generate in order:
                wave = run_wave(generate, prompts, args.clients, repeat)
                (ours if system == 'local' else theirs).append(wave)
                print('{} repeat {} {:<5} {} clients: {:.1f} tok/s aggregate in {:.1f} s'.format(
                    name, repeat + 1, system, args.clients, wave['aggregate'], wave['seconds']), flush=True)
        ratios = [mine['aggregate'] / other['aggregate'] for mine, other in zip(ours, theirs, strict=True)]
        same = [mine['outputs'][prompt] == other['outputs'][prompt] for mine, other in zip(ours, theirs, strict=True)
                for prompt in mine['outputs']]
        return {'local {} (max_batch {})'.format(drafter, args.local_max_batch): summarize_waves(ours),
                'vllm ' + name: summarize_waves(theirs),
                'local/vllm aggregate tokens/s (median of wave pairs)': statistics.median(ratios),
                'local/vllm aggregate tokens/s, wave pairs': [round(ratio, 3) for ratio in ratios],
                'goals with the same tokens on both': '{} of {}'.format(sum(same), len(same)),
                'server startup seconds': server.startup_seconds}
    finally:
        server.stop()


def run_phase(engine, name: str, speculative: dict | None, drafter: str, prompts: list[list[int]],
              args) -> dict:
    """One server; local and vLLM runs alternate prompt by prompt so that both see the same machine load."""
    server = start_server(speculative)
    try:
        backend = VllmBackend(EngineConfig(), VllmConfig(url=server.url, model='target'))
        run_local(engine, prompts[0], 8, drafter)   # warm-up
        run_backend(backend, prompts[0], 8)
        local, served = [], []
        for _ in range(args.repeats):
            for prompt_ids in prompts:
                local.append(run_local(engine, prompt_ids, args.max_new_tokens, drafter))
                served.append(run_backend(backend, prompt_ids, args.max_new_tokens))
        ratio = statistics.median(vllm['tokens_per_second'] / max(1e-9, ours['tokens_per_second'])
                                  for ours, vllm in zip(local, served, strict=True))
        single, many = [], []
        for _ in range(args.repeats):
            single.append(run_concurrent(server.url, prompts, args.max_new_tokens, 1))
            many.append(run_concurrent(server.url, prompts, args.max_new_tokens, args.clients))
        return {'local ' + drafter: summarize(local), 'vllm ' + name: summarize(served),
                'vllm/local decode tokens/s (median of pairs)': ratio,
                'aggregate tokens/s, 1 client': statistics.median(single),
                'aggregate tokens/s, {} clients'.format(args.clients): statistics.median(many),
                'server startup seconds': server.startup_seconds}
    finally:
        server.stop()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog='python -m gemma_spec_ros bench vllm',
                                     description=__doc__.split('\n\n')[0])
    parser.add_argument('--category', default='code', help='bench/prompts.jsonl category')
    parser.add_argument('--max-new-tokens', type=int, default=128)
    parser.add_argument('--repeats', type=int, default=2)
    parser.add_argument('--clients', type=int, default=4)
    parser.add_argument('--ngram-k', type=int, default=4)
    parser.add_argument('--local-max-batch', type=int, default=1,
                        help='> 1: a batched local engine (engine.max_batch) and --clients concurrent clients on '
                        'both systems, waves alternating (see above); 1: the one-at-a-time comparison')
    parser.add_argument('--compile', default='auto', help="the local engine's engine.compile (auto, eager, ...)")
    parser.add_argument('--out', default='')
    args = parser.parse_args(argv)

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(DEFAULT_TARGET))
    rows = [json.loads(line) for line in (REPO_ROOT / 'bench' / 'prompts.jsonl').read_text().splitlines() if line]
    prompts = [tokenizer(row['prompt']).input_ids for row in rows if row['category'] == args.category]
    report = {'prompts': len(prompts), 'category': args.category, 'max_new_tokens': args.max_new_tokens,
              'repeats': args.repeats, 'local_max_batch': args.local_max_batch, 'clients': args.clients,
              'compile': args.compile}
    engine = load_local_engine(args.local_max_batch, args.compile)
    phase = run_batched_phase if args.local_max_batch > 1 else run_phase
    for name, speculative, drafter in (('plain', None, 'none'),
                                       ('ngram', ngram_speculative_config(args.ngram_k), 'ngram')):
        report[name] = phase(engine, name, speculative, drafter, prompts, args)
        print(name, json.dumps(report[name], indent=2), flush=True)
    print(json.dumps(report, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + '\n')
    return 0


if __name__ == '__main__':
    raise SystemExit(main())
