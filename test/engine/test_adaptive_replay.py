"""
Adaptive K against every fixed K, replayed exactly over a recorded acceptance map of the bundled models.

test/data/acceptance_map.json was recorded with ``python -m gemma_spec_ros bench acceptance-map`` (see its
``made_by``): for every prompt of bench/prompts.jsonl and drafter, the drafts a round accepts at each position of
the greedy output, the drafter's confidences, and the measured cost curve. The replay runs the bench's interleaved
order (plain, fixed K = 1..8 and adaptive share one controller per drafter, as in the engine) with noisy timings.
"""

import json
from pathlib import Path

import pytest

from gemma_spec_ros.benchmarks.decode.acceptance_map import measure_costs, record_map
from gemma_spec_ros.benchmarks.decode.adaptive_replay import (
    ADAPTIVE,
    Costs,
    Simulation,
    Tally,
    best_single_k,
    replay_bench,
    table,
)

MAP = json.loads((Path(__file__).parents[1] / 'data' / 'acceptance_map.json').read_text())
KS = list(range(1, MAP['max_k'] + 1))


# (timing noise, seed): single passes on a shared CPU swing by tens of percent
@pytest.fixture(scope='module', params=[(0.1, 0), (0.1, 1), (0.1, 2), (0.3, 0), (0.3, 1)])
def replayed(request):
    noise, seed = request.param
    return replay_bench(MAP, KS, repeats=2, noise=noise, seed=seed, overhead=0.02)


def test_adaptive_keeps_up_with_the_best_fixed_k_of_every_category(replayed):
    rows = table(replayed, KS)
    assert len(rows) == 15  # 3 drafters x 5 categories
    for row in rows:
        assert row.ratio >= 0.97, row


def test_adaptive_beats_the_best_single_fixed_k_on_average(replayed):
    for drafter in ('ngram', 'draft', 'mtp'):
        k, best, adaptive = best_single_k(replayed, KS, drafter)
        assert adaptive >= best, (drafter, k, best, adaptive)


def test_adaptive_is_never_below_plain_decoding(replayed):
    for row in table(replayed, KS):
        assert row.adaptive_speedup >= 0.97, row


def test_replay_matches_the_engine_round_for_round(tiny_engine):
    # the map recorder and the replay against the real loop: fixed K and the same prompt give the same rounds
    prompt = tiny_engine.tokenizer('one two three four one two three four one two three four one two').input_ids
    from gemma_spec_ros.engine.types import GenerationRequest

    mapping = record_map(tiny_engine, prompt, 'ngram', 8, 60)
    assert max(mapping['run_lengths']) > 0 and min(mapping['run_lengths'][1:]) < 8  # accepts and rejects
    for k in (3, 5):
        result = tiny_engine.generate(GenerationRequest(prompt_ids=prompt, max_new_tokens=60, drafter='ngram',
                                                        num_draft_tokens=k))
        assert len(result.token_ids) == mapping['output_tokens']
        simulation = Simulation(['ngram'], Costs([1.0] * 9, {'ngram': 0.1}), 8, noise=0.0, seed=0)
        tally = Tally()
        simulation.request('ngram', k, mapping, tally)
        assert tally.rounds + 1 == result.stats.target_passes
        assert tally.tokens + 1 == len(result.token_ids)


def test_measured_costs_price_each_drafter_call(tiny_engine):
    # the map's costs as the replay charges them: the verify curve, and per drafter its parts and calls per K
    prompt = tiny_engine.tokenizer('def add(a, b):\n    return a + b\n').input_ids
    recorded = measure_costs(tiny_engine, prompt, ['ngram', 'mtp'], 8, repeats=1)
    assert len(recorded['verify_cost']) == 9 and recorded['verify_cost'][0] == 1.0
    assert all(cost > 0 for cost in recorded['verify_cost'])
    assert recorded['draft_calls'] == {'ngram': list(range(9)), 'mtp': [0, 1, 1, 2, 1, 2, 2, 3, 1]}  # 1, 2, 4, 8 steps
    costs = Costs(recorded['verify_cost'], recorded['draft_cost_ratio'], 0.0, recorded['draft_fixed_ratio'],
                  recorded['cut_saves_drafting'], {'mtp': 0.5}, recorded['draft_calls'])
    assert costs.draft_seconds('mtp', 5) - costs.draft_seconds('mtp', 4) == pytest.approx(
        0.5 + recorded['draft_cost_ratio']['mtp'])  # K = 5 takes a second call


def _run_alone(simulation: Simulation, drafter: str, k: int, prompts: list[dict]) -> Tally:
    tally = Tally()
    for prompt in prompts:
        simulation.request(drafter, k, prompt['maps'][drafter], tally)
    return tally


@pytest.mark.parametrize('draft_cost', [0.23, 0.45])
def test_requests_that_change_character_keep_up_with_the_best_choice_of_each_part(draft_cost):
    # adaptive requests only, code then explanations then code; at c = 0.45 the explanations lose at every K
    costs = Costs(MAP['costs']['verify_cost'], {'draft': draft_cost}, 0.02)
    simulation = Simulation(['draft'], costs, MAP['max_k'], noise=0.1, seed=0)
    for category in ('code', 'explain', 'code'):
        part = [p for p in MAP['prompts'] if p['category'] == category]
        fixed = {k: _run_alone(Simulation(['draft'], costs, MAP['max_k'], 0.0, 0), 'draft', k, part).speedup
                 for k in KS}
        adaptive = _run_alone(simulation, 'draft', ADAPTIVE, part)
        assert adaptive.speedup >= 0.97 * max(1.0, *fixed.values()), (category, adaptive.speedup, fixed)
