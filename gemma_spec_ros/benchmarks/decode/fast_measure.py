"""
Measure the fast path against transformers' eager forward (figures for issue 12; not a test).

    python -m gemma_spec_ros bench fast-measure decode   # ms/token, greedy plain decoding: hf | lean | compiled
    python -m gemma_spec_ros bench fast-measure verify   # one target pass of q = 1..9 tokens
    python -m gemma_spec_ros bench fast-measure threads  # 1 vs 2 threads, busy-loop or not, OMP wait policy
    python -m gemma_spec_ros bench fast-measure memory   # RSS: runtime (mode) baseline, weights, KV cache, peaks
    python -m gemma_spec_ros bench fast-measure memory --random-targets 12x768x3072   # + random models, that shape
    python -m gemma_spec_ros bench fast-measure warmup --cold-cache   # background warm-up: time to full speed, and
                                                                      # tok/s while warming up against after it

Systems: ``hf`` is transformers' forward on a DynamicCache driven as the engine drives it, ``lean`` the lean forward
eager on the static cache, ``compiled`` the same through the inductor step graphs (on CPU called directly, without
dynamo's entry), ``compiled-dynamo`` the same graphs always called through torch.compile's entry, ``cudagraph``
through captured CUDA graphs (``--device cuda``). Repeats are interleaved and the
medians reported (the machine is shared: figures are noisy). Thread CPU time is reported beside wall time.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from gemma_spec_ros.engine.stats import mib

TARGET = 'models/gemma4-spec-target'
ASSISTANT = 'models/gemma4-spec-assistant'
DRAFT = 'models/gemma4-spec-draft'
MODULE = 'gemma_spec_ros.benchmarks.decode.fast_measure'  # its subprocesses run one measurement each
SYSTEMS = ('hf', 'lean', 'compiled', 'compiled-dynamo', 'cudagraph')
MODES = {'hf': 'transformers', 'lean': 'eager', 'compiled': 'inductor', 'compiled-dynamo': 'inductor',
         'cudagraph': 'cudagraph'}


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _load(args):
    import torch

    torch.set_num_threads(args.threads)
    from gemma_spec_ros.benchmarks.prompts import DEFAULT_PROMPTS, load_prompts
    from gemma_spec_ros.engine.runtime.model import checkpoints

    device = checkpoints.resolve_device(args.device)
    model = checkpoints.load_causal_lm(args.model, 'target', device, checkpoints.resolve_dtype(args.dtype, device))
    tokenizer = checkpoints.load_tokenizer(args.model)
    prompt = next(p for p in load_prompts(DEFAULT_PROMPTS) if p.category == 'code')
    return model, tokenizer(prompt.text).input_ids


class _System:
    """One system: the product's runner for its compile mode (causal_lm.build_causal_lm), named as here."""

    def __init__(self, name, model, context_limit, progress):
        from gemma_spec_ros.engine.runtime.steps.causal_lm import build_causal_lm

        self.name = name
        self.lm = build_causal_lm(model, MODES[name], context_limit, 9, 'target', progress)
        self.warmup_seconds = self.lm.warmup(0, progress).seconds
        if name == 'compiled-dynamo':  # drop the graphs recorded for direct calls: every call enters through dynamo
            self.lm.forget_direct_graphs()

    def reset(self):
        self.lm.reset()

    def forward(self, ids):  # ids [1, q] -> logits [q, vocab]
        return self.lm.append(ids).logits[0]

    def crop(self, count):
        self.lm.crop(-count)


def _systems(names, model, context_limit, progress):
    built = []
    for name in names:
        system = _System(name, model, context_limit, progress)
        if system.warmup_seconds:
            progress('{}: warm-up {:.1f} s'.format(name, system.warmup_seconds))
        built.append(system)
    return built


def _decode(system, prompt_ids, new_tokens):
    """Greedy plain decoding; returns (tokens, wall s/token, thread-CPU s/token) over the decode steps."""
    import torch

    with torch.inference_mode():
        system.reset()
        device = next(system.lm.model.parameters()).device
        token = system.forward(torch.tensor([prompt_ids], device=device))[-1].argmax().view(1, 1)
        tokens = [token.item()]
        wall, cpu = time.perf_counter(), time.thread_time()
        for _ in range(new_tokens - 1):
            token = system.forward(token)[-1].argmax().view(1, 1)
            tokens.append(token.item())  # the host sync of every decoding step
            system.crop(0)
        steps = new_tokens - 1
        return tokens, (time.perf_counter() - wall) / steps, (time.thread_time() - cpu) / steps


def decode(args) -> dict:
    model, prompt_ids = _load(args)
    systems = _systems(args.systems.split(','), model, len(prompt_ids) + args.new_tokens + 16, _say)
    wall: dict[str, list[float]] = {s.name: [] for s in systems}
    cpu: dict[str, list[float]] = {s.name: [] for s in systems}
    outputs = {}
    for _ in range(args.repeats):
        for system in systems:
            tokens, per_token, per_token_cpu = _decode(system, prompt_ids, args.new_tokens)
            outputs[system.name] = tokens
            wall[system.name].append(per_token * 1e3)
            cpu[system.name].append(per_token_cpu * 1e3)
    reference = next(iter(outputs.values()))
    result = {'device': str(next(model.parameters()).device), 'dtype': str(next(model.parameters()).dtype),
              'prompt_tokens': len(prompt_ids), 'new_tokens': args.new_tokens, 'threads': args.threads,
              'omp_wait_policy': os.environ.get('OMP_WAIT_POLICY', ''), 'identical': all(
                  tokens == reference for tokens in outputs.values()),
              'ms_per_token': {name: statistics.median(values) for name, values in wall.items()},
              'cpu_ms_per_token': {name: statistics.median(values) for name, values in cpu.items()},
              'wall_samples': wall}
    result['warmup_seconds'] = {s.name: s.warmup_seconds for s in systems if s.warmup_seconds}
    return result


def verify(args) -> dict:
    import torch

    model, prompt_ids = _load(args)
    systems = _systems(args.systems.split(','), model, len(prompt_ids) + 32, _say)
    device = next(model.parameters()).device
    wall: dict[str, dict[int, list[float]]] = {s.name: {q: [] for q in range(1, 10)} for s in systems}
    cpu: dict[str, dict[int, list[float]]] = {s.name: {q: [] for q in range(1, 10)} for s in systems}
    with torch.inference_mode():
        for system in systems:
            system.reset()
            system.forward(torch.tensor([prompt_ids], device=device))
        for system in systems:  # one system at a time (others would evict its caches), q interleaved
            for _ in range(args.repeats):
                for q in range(1, 10):
                    ids = torch.tensor([prompt_ids[-q:]], device=device)
                    start, start_cpu = time.perf_counter(), time.thread_time()
                    system.forward(ids)[-1, 0].item()  # wait for the pass (CUDA)
                    wall[system.name][q].append((time.perf_counter() - start) * 1e3)
                    cpu[system.name][q].append((time.thread_time() - start_cpu) * 1e3)
                    system.crop(q)

    def medians(samples):
        return {name: {q: round(statistics.median(v), 3) for q, v in by_q.items()} for name, by_q in samples.items()}
    return {'device': str(device), 'context': len(prompt_ids), 'threads': args.threads,
            'ms_per_pass': medians(wall), 'cpu_ms_per_pass': medians(cpu)}


def thread_matrix(args) -> dict:
    """1 and 2 threads, the machine as it is and with a busy-loop process added, in this process (one wait policy)."""
    import torch

    model, prompt_ids = _load(args)
    systems = _systems(args.systems.split(','), model, len(prompt_ids) + args.new_tokens + 16, _say)
    rows: dict[str, list[float]] = {}
    for _ in range(args.repeats):
        for busy in (False, True):
            spinner = subprocess.Popen([sys.executable, '-c', 'while True: pass']) if busy else None
            try:
                for count in (1, 2):
                    torch.set_num_threads(count)
                    for system in systems:  # compiled graphs recompile for a new thread count: not timed
                        _decode(system, prompt_ids, 4)
                    for system in systems:
                        per_token = _decode(system, prompt_ids, args.new_tokens)[1]
                        key = '{} threads={} load={} OMP_WAIT_POLICY={}'.format(
                            system.name, count, '+busy-loop' if busy else 'as-is',
                            os.environ.get('OMP_WAIT_POLICY') or 'default')
                        rows.setdefault(key, []).append(per_token * 1e3)
            finally:
                if spinner is not None:
                    spinner.kill()
                    spinner.wait()
    return rows


def threads(args) -> dict:
    """Run thread_matrix once per OMP wait policy (read when torch loads, so in child processes), alternating."""
    rows: dict[str, list[float]] = {}
    for _ in range(args.repeats):
        for policy in ('', 'PASSIVE'):
            env = {key: value for key, value in os.environ.items() if key != 'OMP_NUM_THREADS'}
            env['OMP_WAIT_POLICY'] = policy  # '' keeps OpenMP's default (import gemma_spec_ros sets only unset)
            out = subprocess.run(
                [sys.executable, '-m', MODULE, 'thread-matrix', '--systems',
                 args.systems, '--new-tokens', str(args.new_tokens), '--repeats', '1', '--model', args.model],
                env=env, capture_output=True, text=True, check=True).stdout
            for key, values in json.loads(out).items():
                rows.setdefault(key, []).extend(values)
    return {'new_tokens': args.new_tokens, 'ms_per_token_median': {k: statistics.median(v) for k, v in rows.items()},
            'samples': rows}


def _rss() -> tuple[int, int]:
    from gemma_spec_ros.engine.stats import read_process_memory

    memory = read_process_memory()
    return memory.get('VmRSS', 0), memory.get('VmHWM', 0)


def memory_one(args) -> dict:
    """
    One engine (bundled models, one compile mode) in this process: RSS terms at each stage, in MiB.

    The runtime's baseline is the process with every library the engine runs on imported (torch, transformers'
    Gemma 4 classes, tokenizers, xgrammar, the engine) and no model loaded. The mode's baseline adds, for a mode
    that compiles with torch.compile (inductor), torch's compile stack: the RSS a trivial function compiled and run
    as the step graphs are (fullgraph, inference mode) adds (dynamo, AOTAutograd and inductor with their imports,
    sympy, networkx, the code cache and its first C++ kernel). It is the same for any model; what the model's own
    graphs add (graph objects, guards, kernels) stays in the serving peak, above the bound.
    """
    import torch
    import xgrammar  # noqa: F401 (the baseline: what a loaded engine has imported)
    from transformers import AutoTokenizer, Gemma4AssistantForCausalLM, Gemma4ForCausalLM  # noqa: F401

    from gemma_spec_ros.benchmarks.prompts import DEFAULT_PROMPTS, load_prompts
    from gemma_spec_ros.engine import Engine, EngineConfig, GenerationRequest
    from gemma_spec_ros.engine.decoding import engine as _engine_module  # noqa: F401

    torch.set_num_threads(args.threads)
    baseline = _rss()[0]
    mode_baseline = _compile_stack_baseline(args) if _compiles(args) else baseline
    engine = Engine.from_config(EngineConfig(
        target_path=args.model, assistant_path=args.assistant, draft_model_path=args.draft, device=args.device,
        compile=args.compile, num_threads=args.threads, warmup='blocking'))
    loaded, startup_peak = _rss()
    with open('/proc/self/clear_refs', 'w') as refs:  # reset VmHWM: the serving peak without the warm-up's
        refs.write('5')
    prompt = next(p for p in load_prompts(DEFAULT_PROMPTS) if p.category == 'code')
    for drafter in ('none', 'ngram', 'draft', 'mtp'):
        engine.generate(GenerationRequest(prompt=prompt.text, max_new_tokens=args.new_tokens, drafter=drafter))
    status = engine.status()
    serving_peak = _rss()[1]
    bound = 1.15 * (status.weights_bytes + status.kv_cache_bytes) + baseline
    mode_bound = bound - baseline + mode_baseline
    return {'compile': status.compile_mode, 'baseline_mib': mib(baseline), 'weights_mib': mib(status.weights_bytes),
            'kv_cache_mib': mib(status.kv_cache_bytes), 'after_load_mib': mib(loaded),
            'startup_peak_mib': mib(startup_peak), 'serving_peak_mib': mib(serving_peak), 'bound_mib': mib(bound),
            'serving_peak_over_bound': serving_peak / bound, 'compile_stack_mib': mib(mode_baseline - baseline),
            'mode_baseline_mib': mib(mode_baseline), 'mode_bound_mib': mib(mode_bound),
            'serving_peak_over_mode_bound': serving_peak / mode_bound, 'warmup_seconds': status.warmup.seconds}


def warmup(args) -> dict:
    """
    Feed a planner's goals to the bundled models' engine while it warms up in the background, until full speed.

    A goal pair (MTP adaptive, then plain) is sent every --interval seconds from load on, as a planner would; each
    records its time since the engine started loading, tok/s and decode path. Once every graph serves, the same goals
    run --repeats times on eager steps only and on the graphs, interleaved: tok/s while warming up against after.
    --cold-cache compiles into an empty inductor cache (a fresh machine); else the cache under ~/.cache is used.
    """
    import tempfile

    if args.cold_cache:
        os.environ['TORCHINDUCTOR_CACHE_DIR'] = tempfile.mkdtemp(prefix='gemma_spec_cold_cache_')
    import torch

    from gemma_spec_ros.benchmarks.prompts import DEFAULT_PROMPTS, load_prompts
    from gemma_spec_ros.engine import Engine, EngineConfig, GenerationRequest

    torch.set_num_threads(args.threads)
    prompt = next(p for p in load_prompts(DEFAULT_PROMPTS) if p.category == 'code')
    started = time.perf_counter()
    engine = Engine.from_config(EngineConfig(
        target_path=args.model, assistant_path=args.assistant, draft_model_path=args.draft, drafter='mtp',
        device=args.device, compile='inductor', num_threads=args.threads, warmup='background'),
        progress=lambda message: _say('{:7.1f} s  {}'.format(time.perf_counter() - started, message)))
    ready = time.perf_counter() - started

    def goal(drafter):
        result = engine.generate(GenerationRequest(prompt=prompt.text, max_new_tokens=args.new_tokens,
                                                   drafter=drafter))
        return {'at_s': round(time.perf_counter() - started, 2), 'drafter': drafter,
                'tok_s': round(result.stats.tokens_per_second, 1), 'path': result.stats.decode_path}

    served = []
    while not engine.status().warmup.done:
        served += [goal('mtp'), goal('none')]
        _say('{at_s:7.1f} s  goal {drafter}: {tok_s} tok/s on {path}'.format(**served[-2]))
        _say('{at_s:7.1f} s  goal {drafter}: {tok_s} tok/s on {path}'.format(**served[-1]))
        engine.warmup.wait(args.interval)
    state = engine.status().warmup
    side_by_side = {(drafter, graphs): [] for drafter in ('mtp', 'none') for graphs in (False, True)}
    for _ in range(args.repeats):
        for (drafter, graphs), rates in side_by_side.items():
            engine.warmup.use_graphs(graphs)
            rates.append(goal(drafter)['tok_s'])
    return {'cold_cache': args.cold_cache, 'engine_ready_s': round(ready, 2),
            'first_result_s': served[0]['at_s'] if served else None,
            'default_path_s': round(state.default_path_seconds or 0.0, 1),
            'time_to_full_speed_s': round(state.seconds, 1),
            'graphs': state.graphs_total, 'failed': state.failed, 'served_while_warming': served,
            'median_tok_s': {'{} on {}'.format(drafter, 'graphs' if graphs else 'eager steps'):
                             statistics.median(rates) for (drafter, graphs), rates in side_by_side.items()}}


def _compiles(args) -> bool:
    """Whether args.compile runs torch.compile graphs on args.device (inductor, or auto resolving to it)."""
    from gemma_spec_ros.engine.runtime.model import checkpoints
    from gemma_spec_ros.engine.runtime.steps.tables import INDUCTOR_MODES, resolve_compile_mode

    if args.compile == 'transformers':
        return False
    return resolve_compile_mode(args.compile, checkpoints.resolve_device(args.device)) in INDUCTOR_MODES


def _compile_stack_baseline(args) -> int:
    """
    RSS (bytes) once torch's compile stack is loaded: a trivial function compiled and run as the step graphs are.

    As they are on CPU: with a dynamic dimension (~2.5 MiB more than a static one), and with a C++ wrapper where the
    target's steps get one (model.inlines_layers; nothing more once inductor's cache holds it, ~15 MiB more when it
    compiles).
    """
    import torch
    from transformers import AutoConfig

    from gemma_spec_ros.engine.runtime.model import checkpoints
    from gemma_spec_ros.engine.runtime.model.forward import inlines_layers
    from gemma_spec_ros.engine.runtime.ops.compile_cache import release_compile_garbage

    device = checkpoints.resolve_device(args.device)
    layers = AutoConfig.from_pretrained(args.model, local_files_only=True).get_text_config().num_hidden_layers
    on_cpu = device.type == 'cpu'
    tiny = torch.compile(lambda x: (x * 2 + 1).sum(), fullgraph=True, dynamic=False,
                         options={'cpp_wrapper': on_cpu and inlines_layers(layers)})
    example = torch.ones(4, device=device)
    if on_cpu:
        torch._dynamo.mark_dynamic(example, 0)
    with torch.inference_mode():
        tiny(example).item()
    del tiny
    release_compile_garbage()  # as after every step graph's compile
    return _rss()[0]


def memory(args) -> dict:
    """
    memory_one per compile mode, each in its own process (a process's RSS high-water mark never falls).

    With --random-targets, also per random-weight target shape (rows 'MODE SHAPE'), each with an MTP assistant of
    one layer of its width and the bundled draft model: how the terms scale with the weights.
    """
    import tempfile

    rows = {}
    with tempfile.TemporaryDirectory(prefix='gemma-spec-memory-') as scratch:
        targets = [('', args.model, args.assistant)]
        for shape in filter(None, args.random_targets.split(',')):
            _say('writing random-weight models of target shape {}'.format(shape))
            targets.append((' ' + shape, *write_random_models(shape, os.path.join(scratch, shape))))
        for mode in args.compile.split(','):
            for suffix, target, assistant in targets:
                _say('measuring {}{}'.format(mode, suffix))
                out = subprocess.run([sys.executable, '-m', MODULE, 'memory-one',
                                      '--compile', mode, '--new-tokens', str(args.new_tokens), '--model', target,
                                      '--assistant', assistant, '--draft', args.draft, '--device', args.device,
                                      '--threads', str(args.threads)], capture_output=True, text=True,
                                     check=True).stdout
                rows[mode + suffix] = json.loads(out)
    return rows


def write_random_models(shape_text: str, directory: str) -> tuple[str, str]:
    """Write a random-weight target of shape LAYERSxHIDDENxINTERMEDIATE and an assistant for it; return their paths."""
    import torch
    from transformers import AutoConfig, Gemma4AssistantForCausalLM, Gemma4ForCausalLM

    from gemma_spec_ros.train.export import save_model
    from gemma_spec_ros.train.shapes import ModelShape, assistant_config, text_config

    shape = ModelShape.parse(shape_text)
    vocab_size = AutoConfig.from_pretrained(TARGET, local_files_only=True).get_text_config().vocab_size
    torch.manual_seed(0)
    target = Gemma4ForCausalLM(text_config(shape, vocab_size))
    assistant_shape = ModelShape(1, shape.hidden_size, shape.intermediate_size)
    assistant = Gemma4AssistantForCausalLM(assistant_config(target.config, assistant_shape))
    paths = os.path.join(directory, 'target'), os.path.join(directory, 'assistant')
    for model, path in zip((target, assistant), paths, strict=True):  # stored as the bundled ones: float16
        save_model(model, Path(path), Path(TARGET), torch.float16, {'random_weights': shape_text})
    return paths


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog='python -m gemma_spec_ros bench fast-measure', description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('what', choices=('decode', 'verify', 'threads', 'thread-matrix', 'memory', 'memory-one',
                                         'warmup'))
    parser.add_argument('--model', default=TARGET)
    parser.add_argument('--systems', default='hf,lean,compiled', help='comma-separated: ' + ', '.join(SYSTEMS))
    parser.add_argument('--threads', type=int, default=1)
    parser.add_argument('--device', default='cpu', help='cpu|cuda|auto')
    parser.add_argument('--dtype', default='auto', help='auto|float32|bfloat16|float16')
    parser.add_argument('--new-tokens', type=int, default=128)
    parser.add_argument('--repeats', type=int, default=5)
    parser.add_argument('--compile', default='off,eager,inductor', help='memory: engine.compile modes, comma-separated')
    parser.add_argument('--assistant', default=ASSISTANT, help='memory: the MTP assistant')
    parser.add_argument('--draft', default=DRAFT, help='memory: the draft model')
    parser.add_argument('--random-targets', default='',
                        help='memory: also random-weight targets of these shapes (LAYERSxHIDDENxINTERMEDIATE, '
                             'comma-separated)')
    parser.add_argument('--cold-cache', action='store_true', help='warmup: compile into an empty inductor cache')
    parser.add_argument('--interval', type=float, default=5.0, help='warmup: seconds between goal pairs')
    args = parser.parse_args(argv)
    if any(name not in SYSTEMS for name in args.systems.split(',')):
        parser.error('--systems takes a comma-separated subset of {}'.format(', '.join(SYSTEMS)))
    result = {'decode': decode, 'verify': verify, 'threads': threads, 'thread-matrix': thread_matrix, 'memory': memory,
              'memory-one': memory_one, 'warmup': warmup}[args.what](args)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == '__main__':
    sys.exit(main())
