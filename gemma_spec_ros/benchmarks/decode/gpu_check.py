"""
The prepared GPU check of the fast path: one script to run when a GPU machine is lent.

    python -m gemma_spec_ros bench gpu-check --out bench/results/gpu            # CUDA: off, eager, cudagraph
    python -m gemma_spec_ros bench gpu-check --device cpu --modes off,eager --e2b-layers 2 --new-tokens 8  # smoke

For two targets, each with an MTP assistant, in bfloat16 on CUDA (float32 on CPU):
- ``bundled``: models/gemma4-spec-target with models/gemma4-spec-assistant;
- ``e2b``: random weights in the shape of ``Gemma4TextConfig()`` (documented by transformers as similar to
  google/gemma-4-e2b-it: hidden 2304, 30 layers, 262k vocabulary, per-layer embeddings), with a random assistant
  whose attention matches it. Random weights make tau about 1: its speculative row measures the assistant's cost.

It reports per engine.compile mode: plain decode tok/s, the memory-bandwidth roofline fraction of plain decoding
(bytes a decode step must read, the weights less the embedding tables of which a step reads one row, over the step
time, against the bandwidth a large device-to-device copy reaches), and tau and the speedup of MTP speculation
(adaptive K, and K=4) over plain decoding on the same path, with the verify-cost curve calibrated as
Engine.from_config does, and whether the MTP output equalled plain decoding. Writes results.json and results.md into
--out after every row. A mode that fails gets a row with its error and exit status 1; the others still run.
scripts/device_check.sh runs this and the engine's tests on a lent CUDA machine.
"""

import argparse
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

from gemma_spec_ros.benchmarks.cli import BUNDLED
from gemma_spec_ros.engine.stats import MIB, mib

PROMPT = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def copy_bandwidth(device, seconds: float = 1.0) -> float:
    """Bytes per second a large device-to-device copy moves (read + write), the roofline's denominator."""
    import torch

    source = torch.empty(int(256 * MIB), dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    target.copy_(source)
    rounds, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        target.copy_(source)
        rounds += 1
    if device.type == 'cuda':
        torch.cuda.synchronize(device)
    return 2 * source.numel() * rounds / (time.perf_counter() - started)


def step_read_bytes(model) -> int:
    """Bytes of weights a decode step reads: every parameter, the embedding tables only as the (tied) LM head."""
    seen, total = set(), 0
    for name, parameter in model.named_parameters():
        if parameter.data_ptr() in seen or 'embed_tokens' in name:
            continue
        seen.add(parameter.data_ptr())
        total += parameter.numel() * parameter.element_size()
    head = model.get_output_embeddings().weight
    return total + (head.numel() * head.element_size() if head.data_ptr() not in seen else 0)


def _random_e2b(layers: int, device, dtype):
    """Build a random Gemma4ForCausalLM of Gemma4TextConfig's default shape (cut to `layers` when > 0) + assistant."""
    import torch
    from transformers import (
        Gemma4AssistantConfig,
        Gemma4AssistantForCausalLM,
        Gemma4ForCausalLM,
        Gemma4TextConfig,
    )

    from gemma_spec_ros.engine.runtime.model.checkpoints import decoder_layers

    config = Gemma4TextConfig()
    if layers:
        config.layer_types = config.layer_types[:layers - 1] + ['full_attention']
        config.num_hidden_layers = layers
    shape = config.to_dict()
    torch.manual_seed(0)
    with torch.device(device):
        target = Gemma4ForCausalLM(config).to(dtype).eval()
        head_dims = {layer.self_attn.layer_type: layer.self_attn.head_dim for layer in decoder_layers(target)}
        text = Gemma4TextConfig(
            vocab_size=shape['vocab_size'], hidden_size=shape['hidden_size'] // 2,
            intermediate_size=2 * shape['hidden_size'], num_hidden_layers=2,
            layer_types=['sliding_attention', 'full_attention'], num_attention_heads=shape['num_attention_heads'],
            num_key_value_heads=shape['num_key_value_heads'], head_dim=head_dims['sliding_attention'],
            global_head_dim=head_dims['full_attention'],
            sliding_window=shape['sliding_window'], hidden_size_per_layer_input=0, vocab_size_per_layer_input=0,
            pad_token_id=0, eos_token_id=1, bos_token_id=2)
        assistant = Gemma4AssistantForCausalLM(Gemma4AssistantConfig(
            text_config=text, backbone_hidden_size=shape['hidden_size'])).to(dtype).eval()
    return target, assistant


def _engine(target, assistant, tokenizer, mode: str, device, dtype):
    """Build an Engine over loaded models (no directories needed), warmed up for mode."""
    from gemma_spec_ros.engine import EngineConfig
    from gemma_spec_ros.engine.decoding.engine import Engine
    from gemma_spec_ros.engine.drafters.mtp import MtpDrafter
    from gemma_spec_ros.engine.drafters.none import NoneDrafter
    from gemma_spec_ros.engine.runtime.steps.causal_lm import build_causal_lm
    from gemma_spec_ros.engine.runtime.steps.warmup import warm_up_blocking

    config = EngineConfig(target_path='in-memory', assistant_path='in-memory', device=str(device), compile=mode,
                          context_limit=1024, warmup='blocking')
    target_lm = build_causal_lm(target, mode, 1024, config.max_draft_tokens + 1, 'target', _say)
    drafters = {'none': NoneDrafter(), 'mtp': MtpDrafter(assistant, target_lm)}
    warmed = warm_up_blocking(target_lm, drafters, _say)
    engine = Engine(config, target_lm, tokenizer, drafters, device, dtype, warmup=warmed)
    engine.calibrate_verify_costs()  # as Engine.from_config does: the adaptive controller's verify-cost curve
    return engine


def _decode_rate(engine, prompt_ids, drafter: str, k: int, new_tokens: int, repeats: int) -> tuple[float, float, list]:
    """Median decode tok/s and tau of greedy generations (one untimed first), and the tokens generated."""
    from gemma_spec_ros.engine import GenerationRequest

    request = GenerationRequest(prompt_ids=prompt_ids, max_new_tokens=new_tokens, drafter=drafter,
                                num_draft_tokens=k)
    engine.generate(request)
    runs = [engine.generate(request) for _ in range(repeats)]
    return (statistics.median(run.stats.tokens_per_second for run in runs),
            statistics.median(run.stats.tau for run in runs), runs[-1].token_ids)


def check(name: str, target, assistant, tokenizer, args, device, dtype, bandwidth: float, rows: list[dict],
          save) -> None:
    """Append a row per mode of args.modes, save() after each; a mode that fails gets a row with its error."""
    prompt_ids = tokenizer(PROMPT).input_ids
    read_bytes = step_read_bytes(target)
    for mode in args.modes.split(','):
        _say('{}: engine.compile {}'.format(name, mode))
        try:
            rows.append(_measure(name, target, assistant, tokenizer, mode, prompt_ids, read_bytes, args, device,
                                 dtype, bandwidth))
        except Exception as exc:  # a first run on new hardware: keep the other modes' figures
            traceback.print_exc()
            rows.append({'model': name, 'compile': mode, 'error': '{}: {}'.format(type(exc).__name__, exc)[:300]})
        _say(json.dumps(rows[-1]))
        save()


def _measure(name, target, assistant, tokenizer, mode, prompt_ids, read_bytes, args, device, dtype,
             bandwidth) -> dict:
    engine = _engine(target, assistant, tokenizer, mode, device, dtype)
    plain, _, plain_tokens = _decode_rate(engine, prompt_ids, 'none', 0, args.new_tokens, args.repeats)
    adaptive, adaptive_tau, adaptive_tokens = _decode_rate(engine, prompt_ids, 'mtp', 0, args.new_tokens,
                                                           args.repeats)
    fixed, fixed_tau, fixed_tokens = _decode_rate(engine, prompt_ids, 'mtp', 4, args.new_tokens, args.repeats)
    status = engine.status()
    return {'model': name, 'compile': status.compile_mode, 'warmup_s': round(status.warmup.seconds, 1),
            'weights_mib': round(mib(status.weights_bytes), 1), 'kv_cache_mib': round(mib(status.kv_cache_bytes), 1),
            'plain_tok_s': round(plain, 1), 'roofline_fraction': round(read_bytes * plain / bandwidth, 3),
            'mtp_adaptive_tok_s': round(adaptive, 1), 'mtp_adaptive_tau': round(adaptive_tau, 2),
            'mtp_adaptive_speedup': round(adaptive / plain, 2), 'mtp_k4_tok_s': round(fixed, 1),
            'mtp_k4_tau': round(fixed_tau, 2), 'mtp_k4_speedup': round(fixed / plain, 2),
            'mtp_tokens_equal_plain': adaptive_tokens == plain_tokens and fixed_tokens == plain_tokens}


def markdown(result: dict) -> str:
    rows = result['rows']
    columns = list(dict.fromkeys(column for row in rows for column in row))
    lines = ['Device: {} (torch {}, {}); copy bandwidth {:.0f} GB/s; {} new tokens, greedy, median of {}.'.format(
        result['device_name'], result['torch'], result['dtype'], result['copy_bandwidth_gbps'], result['new_tokens'],
        result['repeats']), '', '| ' + ' | '.join(columns) + ' |', '|' + '---|' * len(columns)]
    lines += ['| ' + ' | '.join(str(row.get(column, '')) for column in columns) + ' |' for row in rows]
    return '\n'.join(lines) + '\n'


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog='python -m gemma_spec_ros bench gpu-check', description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--device', default='cuda', help='cuda (the check) or cpu (a smoke run of the script)')
    parser.add_argument('--modes', default='off,eager,cudagraph', help='engine.compile modes, comma-separated')
    parser.add_argument('--models', default='bundled,e2b', help='bundled, e2b or both')
    parser.add_argument('--e2b-layers', type=int, default=0, help='cut the e2b shape to this many layers (0: all)')
    parser.add_argument('--new-tokens', type=int, default=128)
    parser.add_argument('--repeats', type=int, default=3)
    parser.add_argument('--out', default='bench/results/gpu')
    args = parser.parse_args(argv)
    import torch

    from gemma_spec_ros.engine.runtime.model import checkpoints

    device = checkpoints.resolve_device(args.device)
    dtype = torch.bfloat16 if device.type == 'cuda' else torch.float32
    torch.set_num_threads(1)
    bandwidth = copy_bandwidth(device)
    result = {'device_name': torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu',
              'torch': torch.__version__, 'dtype': str(dtype).replace('torch.', ''),
              'copy_bandwidth_gbps': bandwidth / 1e9, 'new_tokens': args.new_tokens, 'repeats': args.repeats,
              'rows': []}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def save() -> None:  # after every row: a run cut short keeps what it measured
        (out / 'results.json').write_text(json.dumps(result, indent=1))
        (out / 'results.md').write_text(markdown(result))

    tokenizer = checkpoints.load_tokenizer(BUNDLED['target'])
    if 'bundled' in args.models:
        target = checkpoints.load_causal_lm(BUNDLED['target'], 'target', device, dtype)
        assistant = checkpoints.load_assistant(BUNDLED['assistant'], device, dtype)
        check('bundled', target, assistant, tokenizer, args, device, dtype, bandwidth, result['rows'], save)
        del target, assistant
    if 'e2b' in args.models:
        target, assistant = _random_e2b(args.e2b_layers, device, dtype)
        check('e2b-shape random' + (' ({} layers)'.format(args.e2b_layers) if args.e2b_layers else ''),
              target, assistant, tokenizer, args, device, dtype, bandwidth, result['rows'], save)
    print(markdown(result))
    return 1 if any('error' in row for row in result['rows']) else 0


if __name__ == '__main__':
    sys.exit(main())
