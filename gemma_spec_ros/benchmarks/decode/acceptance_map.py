"""
Record an acceptance map of the bundled models (figures for issue 14; not a test).

At every position of each prompt's greedy output: how many of a drafter's K_max drafts the target accepts, and the
drafter's confidence in each.

    python -m gemma_spec_ros bench acceptance-map --out test/data/acceptance_map.json

Greedy decoding emits the same tokens whatever the drafts, and a greedy drafter's proposal depends only on the
text before it. So a round that starts after s emitted tokens accepts min(K, run_lengths[s]) of K drafts, for
any policy: ``bench.adaptive_replay`` replays the controller and every fixed K over the map exactly, without the
models. The map also holds the costs the replay charges (target pass per size, drafter step), measured here.
"""

import argparse
import json
import sys
import time

from gemma_spec_ros.benchmarks.prompts import DEFAULT_PROMPTS, default_prompts_path, load_prompts, take_per_category

DRAFTERS = ('ngram', 'draft', 'mtp')
VERIFY_ROUNDS_PER_REPEAT = 20  # timed passes of every size per cost repeat


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class _FirstProposal:
    """Wraps a drafter: keeps its first proposal of a request and cancels the request after that round."""

    def __init__(self, drafter, cancel):
        self._propose, self._cancel = drafter.propose, cancel
        self.proposal = None
        drafter.propose = self

    def __call__(self, context, k):
        proposal = self._propose(context, k)
        if self.proposal is None:
            self.proposal = proposal
        self._cancel.cancel()
        return proposal


def _run_length(proposal, continuation: list[int]) -> tuple[int, list[float]]:
    if proposal is None:
        return 0, []
    drafts = proposal.tokens.tolist()
    accepted = next((i for i, (d, t) in enumerate(zip(drafts, continuation, strict=False)) if d != t),
                    min(len(drafts), len(continuation)))
    confidences = [] if proposal.confidences is None else [round(c, 3) for c in proposal.confidences.tolist()]
    return accepted, confidences


def record_map(engine, prompt_ids: list[int], drafter: str, max_k: int, max_new_tokens: int) -> dict:
    """run_lengths[s] and confidences[s] of a round after s emitted tokens (s = 1 .. n - 1) of the greedy output."""
    from gemma_spec_ros.engine.types import GenerationRequest

    plain = engine.generate(GenerationRequest(prompt_ids=prompt_ids, max_new_tokens=max_new_tokens, drafter='none'))
    output = list(plain.token_ids)
    propose = _lookup_proposals if drafter == 'ngram' else _engine_proposals
    run_lengths, confidences = [0], [[]]  # s = 0: the prefill round drafts nothing
    for emitted, proposal in enumerate(propose(engine, drafter, prompt_ids, output, max_k), start=1):
        accepted, confidence = _run_length(proposal, output[emitted:])
        run_lengths.append(accepted)
        confidences.append(confidence)
    return {'output_tokens': len(output), 'run_lengths': run_lengths, 'confidences': confidences}


def _engine_proposals(engine, drafter: str, prompt_ids: list[int], output: list[int], max_k: int):
    """Yield the drafter's first proposal of a request whose prompt ends before each output position (the loop)."""
    from gemma_spec_ros.engine.types import CancelToken, GenerationRequest

    for emitted in range(1, len(output)):
        cancel = CancelToken()
        hook = _FirstProposal(engine.drafter(drafter), cancel)  # a measurement hook on the drafter object
        try:
            engine.generate(GenerationRequest(prompt_ids=prompt_ids + output[:emitted - 1],
                                              max_new_tokens=max_k + 2, drafter=drafter,
                                              num_draft_tokens=max_k), cancel=cancel)
        finally:
            del engine.drafter(drafter).propose
        yield hook.proposal


def _lookup_proposals(engine, drafter: str, prompt_ids: list[int], output: list[int], max_k: int):
    """Prompt lookup reads only the tokens: propose at each position directly (no target passes needed)."""
    import torch

    from gemma_spec_ros.engine.drafters.base import DraftContext
    from gemma_spec_ros.engine.requests import SamplingParams

    lookup = engine.drafter(drafter)
    lookup.start(prompt_ids)
    for emitted in range(1, len(output)):
        tokens = prompt_ids + output[:emitted]
        yield lookup.propose(DraftContext(tokens, torch.tensor(tokens[-1:]), SamplingParams(), None), max_k)


def measure_costs(engine, prompt_ids: list[int], drafters: list[str], max_k: int, repeats: int) -> dict:
    """
    Target pass per size 1..max_k+1 over a plain pass, and per drafter its costs.

    The verify curve is the median of timed passes of every size in a shuffled order per repeat
    (Engine.median_target_passes): pinned-K requests rarely pair passes of different sizes, which the engine's own
    curve learns from.
    Per drafter: c per token besides the fixed part per round and the part per drafter call, those parts, the calls
    of a greedy round of each K (Drafter.draft_calls) and whether a confidence cut-off saves drafting
    (Drafter.cut_saves_drafting).
    """
    from gemma_spec_ros.engine.requests import SamplingParams
    from gemma_spec_ros.engine.types import GenerationRequest

    medians = engine.median_target_passes(prompt_ids, VERIFY_ROUNDS_PER_REPEAT * repeats)
    verify = [medians[n] for n in range(1, max_k + 2)]  # [max_k + 1] seconds
    for _ in range(repeats):  # every size, interleaved, feeds the engine's own cost measurement
        for drafter in drafters:
            for k in [0, *range(1, max_k + 1)]:
                engine.generate(GenerationRequest(prompt_ids=prompt_ids, max_new_tokens=48,
                                                  drafter='none' if k == 0 else drafter, num_draft_tokens=k))
    plain = engine.verify_costs.relative()[1]  # the drafting fits' load-free unit
    fits = {d: engine.controller(d).costs.draft_cost for d in drafters}
    calls = {d: engine.drafter(d).draft_calls(SamplingParams(), False) for d in drafters}
    return {'verify_cost': [round(s / verify[0], 4) for s in verify],
            'plain_step_ms': round(verify[0] * 1000, 3),
            'draft_cost_ratio': {d: round(fit.step / plain, 4) for d, fit in fits.items()},
            'draft_fixed_ratio': {d: round(fit.fixed / plain, 4) for d, fit in fits.items()},
            'draft_call_ratio': {d: round(fit.per_call / plain, 4) for d, fit in fits.items()},
            'draft_calls': {d: [calls[d](k) for k in range(max_k + 1)] for d in drafters},
            'cut_saves_drafting': {d: engine.drafter(d).cut_saves_drafting for d in drafters}}


def _write(path: str, result: dict) -> None:
    with open(path, 'w', encoding='utf-8') as f:
        json.dump(result, f, separators=(',', ':'))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog='python -m gemma_spec_ros bench acceptance-map',
                                     description=__doc__.split('\n\n')[0])
    parser.add_argument('--out', required=True)
    parser.add_argument('--prompts', default=None, help='JSONL prompts (default {})'.format(DEFAULT_PROMPTS))
    parser.add_argument('--per-category', type=int, default=0, help='prompts per category (0 = all)')
    parser.add_argument('--drafters', default=','.join(DRAFTERS))
    parser.add_argument('--max-new-tokens', type=int, default=128)
    parser.add_argument('--max-k', type=int, default=8)
    parser.add_argument('--threads', type=int, default=1)
    parser.add_argument('--compile', default='auto')
    parser.add_argument('--cost-repeats', type=int, default=3)
    args = parser.parse_args(argv)
    drafters = [d for d in args.drafters.split(',') if d]
    if not drafters or any(d not in DRAFTERS for d in drafters):
        raise SystemExit('--drafters: choose from {}'.format(', '.join(DRAFTERS)))

    import torch

    from gemma_spec_ros.engine import Engine
    from gemma_spec_ros.engine.types import EngineConfig

    torch.set_num_threads(args.threads)
    engine = Engine.from_config(EngineConfig(
        target_path='models/gemma4-spec-target', drafter='none', assistant_path='models/gemma4-spec-assistant',
        draft_model_path='models/gemma4-spec-draft', device='cpu', dtype='float32', max_draft_tokens=args.max_k,
        num_threads=args.threads, compile=args.compile, warmup='blocking'), progress=_say)
    prompts = take_per_category(load_prompts(args.prompts or default_prompts_path()), args.per_category)
    started = time.perf_counter()
    records = []
    result = {
        'made_by': 'python -m gemma_spec_ros bench acceptance-map ' + ' '.join(argv or sys.argv[1:]),
        'about': 'bundled models, greedy, compile {}, {} thread(s); run_lengths[s]: drafts of {} accepted by a '
                 'round after s emitted tokens; confidences[s]: the drafter probability of each draft; costs: '
                 'verify_cost[n - 1] = target pass over n tokens / a plain pass, draft_cost_ratio c = drafter step / '
                 'plain pass, draft_fixed_ratio = drafting cost per round besides the steps and calls / plain pass, '
                 'draft_call_ratio = cost per drafter call / plain pass, draft_calls[k] = calls of a greedy round of k '
                 'drafts'.format(
                     args.compile, args.threads, args.max_k),
        'max_k': args.max_k, 'max_new_tokens': args.max_new_tokens, 'costs': None, 'prompts': records}
    with torch.inference_mode():
        for prompt in prompts:
            ids = engine.tokenizer(prompt.text).input_ids
            maps = {d: record_map(engine, ids, d, args.max_k, args.max_new_tokens) for d in drafters}
            records.append({'id': prompt.id, 'category': prompt.category, 'prompt_tokens': len(ids), 'maps': maps})
            _say('{} ({}): {}'.format(prompt.id, prompt.category, ', '.join(
                '{} mean run {:.2f}'.format(d, sum(m['run_lengths']) / max(1, len(m['run_lengths']) - 1))
                for d, m in maps.items())))
            _write(args.out, result)  # partial maps are usable (costs come last)
        result['costs'] = measure_costs(engine, engine.tokenizer(prompts[0].text).input_ids, drafters,
                                        args.max_k, args.cost_repeats)
    result['seconds'] = round(time.perf_counter() - started)
    _write(args.out, result)
    _say('wrote {} ({} prompts, {:.0f} s)'.format(args.out, len(records), result['seconds']))
    return 0


if __name__ == '__main__':
    raise SystemExit(main())
