"""``python -m gemma_spec_ros generate``: run the engine from the command line (no ROS)."""

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from .config_file import load_engine_config, read_constraint_files, resolve_model_path
from .stats import format_stats
from .types import (
    COMPILE_MODES,
    DEVICES,
    DRAFTERS,
    DTYPES,
    QUANTIZATIONS,
    WARMUP_POLICIES,
    GenerationRequest,
    GenerationResult,
)

DEFAULT_TARGET = 'models/gemma4-spec-target'
DEFAULT_ASSISTANT = 'models/gemma4-spec-assistant'
DEFAULT_DRAFT = 'models/gemma4-spec-draft'
DEFAULT_EAGLE3 = 'models/gemma4-spec-eagle3'
PATH_FIELDS = {'mtp': 'assistant_path', 'draft': 'draft_model_path', 'eagle3': 'eagle3_path'}  # --drafter-path


def build_parser() -> argparse.ArgumentParser:
    """Return the argument parser of the generate command."""
    parser = argparse.ArgumentParser(
        prog='python -m gemma_spec_ros generate',
        description='Generate text with the speculative Gemma 4 engine. Without --config the bundled models '
                    '(models/gemma4-spec-*) are used; explicit flags override the config file.')
    parser.add_argument('--config', help="node params YAML (e.g. config/orin.yaml); reads its 'engine:' group")
    parser.add_argument('--target', help='target model directory')
    parser.add_argument('--drafter', choices=DRAFTERS, help='drafter (default: from the config, else mtp)')
    parser.add_argument('--drafter-path',
                        help='model directory of the drafter (assistant for mtp, model for draft, head for eagle3)')
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument('--prompt', help='prompt text')
    prompt.add_argument('--prompt-ids', help='comma-separated token ids, e.g. 2,651,1234')
    prompt.add_argument('--messages-json', help='JSON file with chat messages [{"role": ..., "content": ...}]')
    parser.add_argument('--max-new-tokens', type=int, default=0, help='0 = engine default')
    parser.add_argument('--temperature', type=float, default=0.0, help='0 = greedy (default)')
    parser.add_argument('--top-p', type=float, default=0.0, help='0 = off')
    parser.add_argument('--top-k', type=int, default=0, help='0 = off')
    parser.add_argument('--seed', type=int, default=-1, help='-1 = random; sample i uses seed + i')
    parser.add_argument('--stop', action='append', default=[], help='stop string (repeatable)')
    parser.add_argument('--json-schema', metavar='FILE', help='JSON Schema file the output must match')
    parser.add_argument('--grammar', metavar='FILE', help='EBNF grammar file (xgrammar syntax, rule root); at '
                        'most one of --json-schema and --grammar')
    parser.add_argument('--json-free-whitespace', action='store_true',
                        help='allow up to 16 whitespace characters between JSON elements (default: compact JSON)')
    parser.add_argument('--json-schema-unenforced', default='', choices=('', 'refuse', 'check'),
                        help='a --json-schema keyword the grammar cannot enforce: refuse (default) or check '
                             '(generate without it, validate the output at the end)')
    parser.add_argument('--tools', metavar='FILE', help='JSON file with the tools the model may call (a list of '
                        '{name, description, parameters}); needs --messages-json')
    parser.add_argument('--tool-choice', default='', help='auto (default with tools), none, required or a tool name')
    parser.add_argument('--thinking', action='store_true', help='let the model think first (shown apart)')
    parser.add_argument('--max-thinking-tokens', type=int, default=0, help='thought tokens before the channel '
                        'closes; 0 = no budget')
    parser.add_argument('--num-draft-tokens', type=int, default=None, help='K; 0 = adaptive')
    parser.add_argument('--device', choices=DEVICES, help='default: auto')
    parser.add_argument('--dtype', choices=DTYPES, help='default: auto')
    parser.add_argument('--quantization', choices=QUANTIZATIONS, help='weight-only quantization (default: none)')
    parser.add_argument('--threads', type=int, default=None,
                        help='torch CPU threads (engine.num_threads, default 1; 0 = torch default)')
    parser.add_argument('--compile', choices=COMPILE_MODES, help='decode steps (engine.compile, default auto)')
    parser.add_argument('--warmup', choices=WARMUP_POLICIES,
                        help='engine.warmup (default background: generate at once on eager steps while the compiled '
                             'steps load or compile; blocking: compile them all first)')
    parser.add_argument('--samples', type=int, default=1, help='number of generations (seeds S, S+1, ...)')
    parser.add_argument('--json', action='store_true', help='print one JSON object per sample and line')
    return parser


def _engine_overrides(args) -> dict:
    overrides = {'target_path': args.target, 'drafter': args.drafter, 'device': args.device, 'dtype': args.dtype,
                 'num_draft_tokens': args.num_draft_tokens, 'num_threads': args.threads, 'compile': args.compile,
                 'warmup': args.warmup, 'quantization': args.quantization}
    if not args.config:
        # the bundled drafters belong to the bundled target; with --target only --drafter-path adds one
        overrides['target_path'] = args.target or DEFAULT_TARGET
        for field, default in (('assistant_path', DEFAULT_ASSISTANT), ('draft_model_path', DEFAULT_DRAFT),
                               ('eagle3_path', DEFAULT_EAGLE3)):
            bundled = not args.target and Path(resolve_model_path(default)).is_dir()
            lean = args.compile != 'transformers' or field != 'eagle3_path'  # the head reads the lean forward's taps
            overrides[field] = default if bundled and lean else ''
        overrides['drafter'] = args.drafter or ('mtp' if overrides['assistant_path'] else 'ngram')
    if args.drafter_path:
        drafter = args.drafter or 'mtp'
        if drafter not in PATH_FIELDS:
            raise ValueError('--drafter-path needs --drafter mtp, draft or eagle3')
        overrides[PATH_FIELDS[drafter]] = args.drafter_path
        overrides['drafter'] = drafter
    return overrides


def _request(args, sample: int, constraint: dict[str, str]) -> GenerationRequest:
    request = GenerationRequest(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, stop=list(args.stop),
                                seed=args.seed + sample if args.seed >= 0 else -1,
                                json_free_whitespace=args.json_free_whitespace,
                                json_schema_unenforced=args.json_schema_unenforced, tool_choice=args.tool_choice,
                                thinking=args.thinking, max_thinking_tokens=args.max_thinking_tokens, **constraint)
    if args.tools:
        try:
            with open(args.tools, encoding='utf-8') as stream:
                request.tools = stream.read()
        except OSError as exc:
            raise ValueError('cannot read tools from {}: {}'.format(args.tools, exc)) from exc
    if args.prompt is not None:
        request.prompt = args.prompt
    elif args.prompt_ids is not None:
        try:
            request.prompt_ids = [int(token) for token in args.prompt_ids.split(',') if token.strip()]
        except ValueError as exc:
            raise ValueError('--prompt-ids must be comma-separated integers, got {!r}'.format(args.prompt_ids)) from exc
    else:
        try:
            with open(args.messages_json, encoding='utf-8') as stream:
                request.messages = json.load(stream)
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError('cannot read chat messages from {}: {}'.format(args.messages_json, exc)) from exc
        if not isinstance(request.messages, list):
            raise ValueError('--messages-json must hold a list of {"role", "content"} objects')
    return request


def _print_stats(result: GenerationResult) -> None:
    if result.reasoning:
        print('\n--- reasoning: {}'.format(result.reasoning))
    for call in result.tool_calls:
        print('\n--- tool call {}: {} {}'.format(call.id, call.name, call.arguments))
    print('\n--- finish={}\n{}'.format(result.finish_reason, format_stats(result.stats)))
    if result.structure_complete:
        print('--- structure complete')
    for warning in result.warnings:
        print('--- warning: {}'.format(warning))


def main(argv=None) -> int:
    """Entry point of the generate command; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        if args.samples < 1:
            raise ValueError('--samples must be >= 1, got {}'.format(args.samples))
        config = load_engine_config(args.config, _engine_overrides(args))
        constraint = read_constraint_files(args.json_schema, args.grammar)
        from transformers.utils import logging as transformers_logging

        from .decoding.engine import Engine  # heavy imports (torch, transformers) after argument checks

        transformers_logging.disable_progress_bar()

        engine = Engine.from_config(config, progress=lambda message: print(message, file=sys.stderr))
        for sample in range(args.samples):
            request = _request(args, sample, constraint)
            if args.json:
                result = engine.generate(request)
                print(json.dumps({'text': result.text, 'reasoning': result.reasoning,
                                  'tool_calls': [dataclasses.asdict(call) for call in result.tool_calls],
                                  'token_ids': result.token_ids,
                                  'finish_reason': result.finish_reason, 'stats': dataclasses.asdict(result.stats),
                                  'warnings': result.warnings, 'structure_complete': result.structure_complete}),
                      flush=True)
            else:
                result = engine.generate(request, on_delta=lambda delta: print(delta.text, end='', flush=True))
                _print_stats(result)
        engine.close()  # a background warm-up builds no further graph: the process is about to exit
    except ValueError as exc:
        print('error: {}'.format(exc), file=sys.stderr)
        return 2
    return 0


if __name__ == '__main__':
    sys.exit(main())
