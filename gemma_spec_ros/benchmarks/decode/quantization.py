"""
Weight-only quantization (engine.quantization), measured: speed, quality, τ and memory.

    python -m gemma_spec_ros bench quantization speed --random-target 12x1536x6144   # plain decode per precision
    python -m gemma_spec_ros bench quantization quality      # bundled target: agreement and perplexity vs float
    python -m gemma_spec_ros bench quantization tau          # τ of each drafter with a quantized target
    python -m gemma_spec_ros bench quantization memory-table # E2B shape per precision against Orin boards
    python -m gemma_spec_ros bench quantization e2b-write --models DIR   # random E2B shape + assistant, bf16
    python -m gemma_spec_ros bench quantization e2b-load --models DIR --precision int8   # peak RSS, decode, MTP c

Each prints one JSON object on stdout; progress goes to stderr.
"""

import argparse
import json
import math
import statistics
import sys
import tempfile
import time

from gemma_spec_ros.benchmarks.decode.fast_measure import write_random_models

TARGET = 'models/gemma4-spec-target'
ASSISTANT = 'models/gemma4-spec-assistant'
DRAFT = 'models/gemma4-spec-draft'
# name -> (model dtype, engine.quantization)
PRECISIONS = {'float32': ('float32', 'none'), 'bfloat16': ('bfloat16', 'none'), 'int8': ('float32', 'int8'),
              'int4': ('float32', 'int4'), 'float16': ('float32', 'float16')}
BOARDS_GB = (8, 16, 32, 64)
E2B_DRAFTS = 2  # e2b-load: the MTP assistant's drafts a round (fixed K: its price and the projection)


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def load_runner(path: str, precision: str, mode: str, context_limit: int, max_query: int = 1):
    import torch

    from gemma_spec_ros.engine.runtime.model import checkpoints
    from gemma_spec_ros.engine.runtime.quant.quantize import Quantizer
    from gemma_spec_ros.engine.runtime.steps.causal_lm import build_causal_lm

    dtype, quantization = PRECISIONS[precision]
    started = time.perf_counter()
    quantizer = Quantizer.for_mode(quantization)
    model = checkpoints.load_causal_lm(path, 'target', torch.device('cpu'), checkpoints.TORCH_DTYPES[dtype], quantizer)
    runner = build_causal_lm(model, mode, context_limit, max_query, 'target', _say, quantizer)
    return runner, time.perf_counter() - started


def plain_decode(runner, prompt_ids: list[int], new_tokens: int) -> tuple[list[int], float]:
    """Greedy plain decoding; returns the tokens and the wall seconds per decode step."""
    import torch

    with torch.inference_mode():
        runner.reset()
        token = runner.prefill(torch.tensor([prompt_ids])).logits[0, -1].argmax().view(1, 1)
        tokens = [token.item()]
        started = time.perf_counter()
        for _ in range(new_tokens - 1):
            token = runner.append(token).logits[0, -1].argmax().view(1, 1)
            tokens.append(token.item())
        return tokens, (time.perf_counter() - started) / (new_tokens - 1)


def speed(args) -> dict:
    """Plain decode of a random-weight target per precision, interleaved repeats, one compile mode."""
    import torch

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as scratch:
        _say('writing a random-weight target of shape {}'.format(args.random_target))
        target, _ = write_random_models(args.random_target, scratch)
        prompt_ids = list(range(10, 10 + args.prompt_tokens))
        runners = {}
        for precision in args.precisions.split(','):
            runner, seconds = load_runner(target, precision, args.compile, args.prompt_tokens + args.new_tokens + 8)
            _say('{}: built in {:.1f} s; warming up'.format(precision, seconds))
            plain_decode(runner, prompt_ids, 3)  # compiles the one-token step
            runners[precision] = (runner, seconds)
        samples = {precision: [] for precision in runners}
        outputs = {}
        for repeat in range(args.repeats):
            for precision, (runner, _) in runners.items():
                outputs[precision], per_token = plain_decode(runner, prompt_ids, args.new_tokens)
                samples[precision].append(per_token * 1e3)
            _say('repeat {}: {}'.format(repeat + 1, {p: round(s[-1], 2) for p, s in samples.items()}))
    ms = {precision: statistics.median(values) for precision, values in samples.items()}
    weights = {precision: _weights_mib(runner) for precision, (runner, _) in runners.items()}
    result = {'shape': args.random_target, 'compile': args.compile, 'threads': args.threads,
              'new_tokens': args.new_tokens, 'repeats': args.repeats, 'ms_per_token': ms,
              'tokens_per_s': {p: round(1e3 / value, 1) for p, value in ms.items()}, 'weights_mib': weights,
              'quantize_seconds': {p: round(runner.quantization.seconds, 2) for p, (runner, _) in runners.items()
                                   if runner.quantization is not None},
              'samples_ms': samples, 'tokens': outputs}
    for precision in ('int8', 'int4', 'float16'):
        for base in ('float32', 'bfloat16'):
            if precision in ms and base in ms:
                result['speedup {} vs {}'.format(precision, base)] = round(ms[base] / ms[precision], 3)
    return result


def _weights_mib(runner) -> float:
    from gemma_spec_ros.engine.runtime.steps.causal_lm import weights_bytes

    return round(weights_bytes(runner) / 2 ** 20, 1)


def quality(args) -> dict:
    """Next-token agreement with float32 and perplexity of each precision on held-out text windows."""
    import torch
    import torch.nn.functional as F

    from gemma_spec_ros.engine.runtime.model import checkpoints
    from gemma_spec_ros.train.corpora import corpus
    from gemma_spec_ros.train.corpora.data import TokenStream, fixed_windows

    torch.set_num_threads(args.threads)
    tokenizer = checkpoints.load_tokenizer(args.target)
    documents = list(corpus.default_documents('heldout'))
    windows = fixed_windows(TokenStream.from_documents(tokenizer, documents), args.window, args.windows)
    _say('{} held-out windows of {} tokens'.format(len(windows), args.window))
    logits = {}
    for precision in args.precisions.split(','):
        runner, _ = load_runner(args.target, precision, 'eager', args.window + 8, 8)
        with torch.inference_mode():
            rows = []
            for window in windows:
                runner.reset()
                rows.append(runner.prefill(window[None, :-1], logits_to_keep=0).logits[0].float())
        logits[precision] = torch.stack(rows)  # [windows, window - 1, vocab]
    targets = windows[:, 1:]
    reference = logits['float32'].argmax(-1)
    result = {'windows': len(windows), 'window_tokens': args.window, 'documents': len(documents)}
    for precision, values in logits.items():
        loss = F.cross_entropy(values.flatten(0, 1), targets.flatten())
        result[precision] = {'perplexity': round(math.exp(loss.item()), 3),
                             'agreement_with_float32': round((values.argmax(-1) == reference).float().mean().item(), 4)}
    return result


def tau(args) -> dict:
    """τ and decode tokens/s of each drafter (adaptive K) per precision, on the bundled models' held-out prompts."""
    from gemma_spec_ros.benchmarks.prompts import default_prompts_path, load_prompts, take_per_category
    from gemma_spec_ros.engine import Engine, EngineConfig, GenerationRequest
    from gemma_spec_ros.engine.stats import tau as pooled_tau

    prompts = take_per_category(load_prompts(default_prompts_path()), args.per_category)
    result = {'prompts': len(prompts), 'new_tokens': args.new_tokens, 'compile': args.compile}
    for precision in args.precisions.split(','):
        dtype, quantization = PRECISIONS[precision]
        engine = Engine.from_config(EngineConfig(
            target_path=TARGET, assistant_path=ASSISTANT, draft_model_path=DRAFT, dtype=dtype,
            quantization=quantization, compile=args.compile, warmup='blocking', num_threads=args.threads))
        figures, plain = {}, {}
        for drafter in ('none', 'ngram', 'draft', 'mtp'):  # plain first: the reference of the others
            new, passes, seconds, identical = [], [], 0.0, True
            for prompt in prompts:
                request = GenerationRequest(prompt=prompt.text, max_new_tokens=args.new_tokens, drafter=drafter)
                out = engine.generate(request)
                identical &= plain.setdefault(prompt.id, out.token_ids) == out.token_ids
                new.append(out.stats.new_tokens)
                passes.append(out.stats.target_passes)
                seconds += out.stats.wall_time - out.stats.time_to_first_token
            figures[drafter] = {'tau': round(pooled_tau(new, passes), 3), 'tokens_per_s': round(sum(new) / seconds, 1),
                                'identical_to_plain': identical}
        engine.close()
        result[precision] = figures
        _say('{}: {}'.format(precision, figures))
    return result


def _e2b_parts() -> dict:
    """Parameters of the E2B shape and its assistant (gpu_check's, on the meta device) by kind; KV per token."""
    import torch

    from gemma_spec_ros.benchmarks.decode.gpu_check import _random_e2b

    model, assistant = _random_e2b(0, torch.device('meta'), torch.bfloat16)
    config = model.config
    parts = {'layer_matrices': 0, 'embedding': 0, 'per_layer_embedding': 0, 'other': 0}
    for name, parameter in model.named_parameters():
        if 'embed_tokens_per_layer' in name:
            parts['per_layer_embedding'] += parameter.numel()
        elif 'embed_tokens' in name:
            parts['embedding'] += parameter.numel()
        elif parameter.dim() == 2:
            parts['layer_matrices'] += parameter.numel()
        else:
            parts['other'] += parameter.numel()
    kv_elements, window = 0, config.sliding_window
    for layer in model.model.layers:
        attention = layer.self_attn
        if attention.is_kv_shared_layer:
            continue
        per_token = 2 * attention.k_proj.out_features
        kv_elements += per_token if attention.layer_type == 'full_attention' else per_token * min(window, 4096) / 4096
    return {'parameters': parts, 'kv_elements_per_token': kv_elements, 'layers': config.num_hidden_layers,
            'assistant_parameters': sum(parameter.numel() for parameter in assistant.parameters())}


def memory_table(args) -> dict:
    """Weights + a 4k KV cache of the E2B shape per precision, from the measured bytes per parameter."""
    bytes_per = _measured_bytes_per_parameter()
    shape = _e2b_parts()
    parts, kv_per_token = shape['parameters'], shape['kv_elements_per_token']
    assistant_parameters = shape['assistant_parameters']
    rows = {}
    for precision, (matrix_bytes, table_bytes) in bytes_per.items():
        float_bytes = 2 if precision == 'bfloat16' else 4 if precision == 'float32' else 2
        weights = (parts['layer_matrices'] * matrix_bytes + (parts['embedding'] + parts['per_layer_embedding'])
                   * table_bytes + parts['other'] * float_bytes + assistant_parameters * float_bytes)
        kv = kv_per_token * args.context * float_bytes
        total_gib = (weights + kv) / 2 ** 30
        rows[precision] = {'weights_gib': round(weights / 2 ** 30, 2), 'kv_4k_gib': round(kv / 2 ** 30, 3),
                           'total_gib': round(total_gib, 2),
                           'fits': {'{} GB'.format(gb): total_gib * 2 ** 30 < gb * 1e9 * args.usable for gb in
                                    BOARDS_GB}}
    return {'shape': 'E2B (Gemma4TextConfig defaults)', 'parameters': parts,
            'total_parameters_b': round(sum(parts.values()) / 1e9, 3), 'bytes_per_parameter': bytes_per,
            'context': args.context, 'usable_fraction': args.usable,
            'assistant_parameters_m': round(assistant_parameters / 1e6, 1), 'rows': rows}


def _measured_bytes_per_parameter() -> dict:
    """Return (decoder matrices, embedding tables) bytes per parameter per precision, measured by quantizing."""
    import torch

    from gemma_spec_ros.engine.runtime.quant.quantize import Quantizer, stored_bytes

    measured = {'float32': (4.0, 4.0), 'bfloat16': (2.0, 2.0)}
    matrix, table = torch.nn.Parameter(torch.randn(2048, 1536)), torch.nn.Parameter(torch.randn(4096, 1536))
    for mode in ('int8', 'int4'):
        quantizer = Quantizer(mode)
        matrix_bytes = stored_bytes(quantizer.matrix(torch.nn.Parameter(matrix.detach().clone()))) / matrix.numel()
        table_bytes = stored_bytes(quantizer.table(torch.nn.Parameter(table.detach().clone()))) / table.numel()
        measured[mode] = (round(matrix_bytes, 4), round(table_bytes, 4))
    return measured


def e2b_write(args) -> dict:
    """Write a random-weight E2B-shape target and its assistant (gpu_check's shapes) in bfloat16 to --checkpoints."""
    from pathlib import Path

    import torch

    from gemma_spec_ros.benchmarks.decode.gpu_check import _random_e2b
    from gemma_spec_ros.train.export import copy_tokenizer

    torch.set_default_dtype(torch.bfloat16)  # built in bfloat16: float32 would take 20 GB
    started = time.perf_counter()
    target, assistant = _random_e2b(0, torch.device('cpu'), torch.bfloat16)
    for model, name in ((target, 'target'), (assistant, 'assistant')):
        model.config.eos_token_id, model.config.bos_token_id, model.config.pad_token_id = 1, 2, 0
        model.save_pretrained(Path(args.models) / name)
        copy_tokenizer(Path(TARGET), Path(args.models) / name)
    return {'models': args.models, 'seconds': round(time.perf_counter() - started, 1)}


def e2b_load(args) -> dict:
    """Load the E2B shape (e2b-write) with its assistant at one precision, decode, and report the peak memory."""
    import resource
    from pathlib import Path

    from gemma_spec_ros.engine import Engine, EngineConfig, GenerationRequest

    dtype, quantization = PRECISIONS[args.precision]
    started = time.perf_counter()
    engine = Engine.from_config(EngineConfig(
        target_path=str(Path(args.models) / 'target'), assistant_path=str(Path(args.models) / 'assistant'),
        dtype=dtype, quantization=quantization, compile='eager', warmup='off', context_limit=args.context,
        num_threads=args.threads), progress=_say)
    loaded = time.perf_counter() - started
    load_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20  # KiB -> GiB
    figures = {}
    for drafter in ('none', 'mtp'):
        out = engine.generate(GenerationRequest(prompt='def main():', max_new_tokens=args.new_tokens, drafter=drafter,
                                                num_draft_tokens=E2B_DRAFTS if drafter == 'mtp' else 0))
        figures[drafter] = {'tokens': out.token_ids, 'draft_cost_ratio': round(out.stats.draft_cost_ratio, 4),
                            'decode_tokens_per_s': round((out.stats.new_tokens - 1) / max(
                                1e-9, out.stats.wall_time - out.stats.time_to_first_token), 2)}
    verify = engine.calibrate_verify_costs()  # median seconds of a target pass per size
    status = engine.status()
    engine.close()
    # A projection, not a measurement: the random-weight assistant accepts almost nothing, so tau comes from
    # elsewhere (--projected-tau); the round's price is measured here, K drafts at c each and a verify of K + 1 rows.
    c, verify_ratio = figures['mtp']['draft_cost_ratio'], verify[E2B_DRAFTS + 1] / verify[1]
    projected = {str(tau): round(tau / (verify_ratio + E2B_DRAFTS * c), 2)
                 for tau in (float(value) for value in args.projected_tau.split(','))}
    return {'precision': args.precision, 'load_seconds': round(loaded, 1), 'context': args.context,
            'weights_gib': round(status.weights_bytes / 2 ** 30, 2),
            'kv_cache_gib': round(status.kv_cache_bytes / 2 ** 30, 3),
            'peak_rss_after_load_gib': round(load_peak, 2),
            'peak_rss_gib': round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20, 2),
            'same_tokens_with_mtp': figures['none']['tokens'] == figures['mtp']['tokens'], 'decode': figures,
            'verify_seconds': {size: round(seconds, 4) for size, seconds in verify.items()},
            'mtp_projection': {'drafts': E2B_DRAFTS, 'draft_cost_ratio': c, 'verify_cost_ratio': round(verify_ratio, 3),
                               'speedup_by_tau': projected}}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog='python -m gemma_spec_ros bench quantization',
                                     description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('what', choices=('speed', 'quality', 'tau', 'memory-table', 'e2b-write', 'e2b-load'))
    parser.add_argument('--threads', type=int, default=1)
    parser.add_argument('--precisions', default='float32,bfloat16,int8,int4')
    parser.add_argument('--random-target', default='12x1536x6144', help='speed: LAYERSxHIDDENxINTERMEDIATE')
    parser.add_argument('--compile', default='inductor', help='speed and tau: engine.compile')
    parser.add_argument('--new-tokens', type=int, default=64)
    parser.add_argument('--prompt-tokens', type=int, default=32, help='speed')
    parser.add_argument('--repeats', type=int, default=3, help='speed')
    parser.add_argument('--target', default=TARGET, help='quality')
    parser.add_argument('--window', type=int, default=256, help='quality: tokens per held-out window')
    parser.add_argument('--windows', type=int, default=32, help='quality')
    parser.add_argument('--per-category', type=int, default=2, help='tau: held-out prompts per category')
    parser.add_argument('--context', type=int, default=4096, help='memory-table, e2b-load: KV cache tokens')
    parser.add_argument('--models', default='/tmp/gemma_spec_e2b', help='e2b-write, e2b-load: the E2B-shape models')
    parser.add_argument('--precision', default='int8', choices=tuple(PRECISIONS), help='e2b-load')
    parser.add_argument('--projected-tau', default='1.73,3.76',
                        help="e2b-load: tau values to project MTP's speedup at the E2B shape with (the bundled pair's "
                             "MTP on held-out code: 1.73 with today's planner-tuned assistant, 3.76 before)")
    parser.add_argument('--usable', type=float, default=0.75,
                        help='memory-table: share of the board memory a model may take (the OS, perception...)')
    args = parser.parse_args(argv)
    run = {'speed': speed, 'quality': quality, 'tau': tau, 'memory-table': memory_table, 'e2b-write': e2b_write,
           'e2b-load': e2b_load}[args.what]
    print(json.dumps(run(args), indent=2))
    return 0


if __name__ == '__main__':
    sys.exit(main())
