"""
The auto drafter on tiny random Gemma 4 models: a drafter chosen per round, lossless alone and in a batch.

Greedy output equals plain decoding (adaptive and fixed K, one goal and in a batch beside other drafters' goals),
sampled output follows the target's distribution (χ²), prompt lookup drafts where the text repeats and a model
drafter where it pays, a drafter whose model is missing is no candidate, and a member that fails leaves the goal.
"""

import dataclasses
import threading
from collections import Counter

import pytest
import torch
from conftest import ON_TEST_DEVICE, TEST_COMPILE, chi_squared_p_value, target_distribution

from gemma_spec_ros.engine import Engine, EngineConfig, GenerationRequest
from gemma_spec_ros.engine.drafters.base import Drafter, Proposal

CODE_PROMPT = 'def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n\ndef add(a, b):\n'
STORY_PROMPT = 'The robot picked up the red cube and'
LONG = 72          # new tokens: several times the fixtures' sliding window (16)
MAX_BATCH = 4


@pytest.fixture(scope='module')
def auto_engine(tiny_engine_config):
    """ngram, draft and mtp loaded, engine.drafter auto."""
    return Engine.from_config(dataclasses.replace(tiny_engine_config, drafter='auto'))


@pytest.fixture(scope='module')
def auto_batch_engine(tiny_engine_config):
    engine = Engine.from_config(dataclasses.replace(tiny_engine_config, drafter='auto', max_batch=MAX_BATCH))
    yield engine
    engine.close()


def fresh_engine(config, **changes):
    """Load an auto engine whose controllers have measured nothing yet (each member is tried once, then priced)."""
    return Engine.from_config(dataclasses.replace(config, drafter='auto', **changes))


def ids_of(engine, prompt):
    return engine.tokenizer(prompt).input_ids


def check_counts(stats):
    """Check that the per-drafter round counts add up: every decode round once, 'none' where nothing was drafted."""
    assert sum(stats.rounds_by_drafter.values()) == stats.target_passes - 1
    assert stats.rounds_by_drafter.get('none', 0) == stats.rounds_by_draft_length[0]


class OracleDrafter(Drafter):
    """A model drafter in name that proposes the target's own greedy continuation: every draft is accepted."""

    name = 'draft'

    def __init__(self, sequences: list[list[int]]):
        self.sequences = sequences

    def propose(self, context, k):
        sequence = next((ids for ids in self.sequences if ids[:len(context.tokens)] == context.tokens), [])
        drafts = sequence[len(context.tokens):len(context.tokens) + k]
        return Proposal(torch.tensor(drafts, dtype=torch.long), None) if drafts else None


class RepeatingDrafter(Drafter):
    """Propose one token k times: sampled verification accepts it with the target's probability."""

    name = 'ngram'

    def __init__(self, token: int):
        self.token = token

    def for_batch(self, slot: int) -> 'RepeatingDrafter':
        return self

    def propose(self, context, k):
        return Proposal(torch.full((k,), self.token, dtype=torch.long), None)


class FailingDrafter(Drafter):
    """A member that raises when it drafts."""

    name = 'mtp'

    def propose(self, context, k):
        raise RuntimeError('assistant gone')


@pytest.mark.parametrize('k', [0, 3])
@pytest.mark.parametrize('prompt', [CODE_PROMPT, STORY_PROMPT], ids=['code', 'story'])
def test_auto_greedy_output_is_plain_decoding(auto_engine, reference, prompt, k):
    expected = reference(ids_of(auto_engine, prompt), LONG)
    for _ in range(2):  # the second goal starts from what the members' controllers learned
        result = auto_engine.generate(GenerationRequest(prompt=prompt, max_new_tokens=LONG, num_draft_tokens=k))
        assert result.token_ids == expected and not result.warnings
        assert result.stats.drafter == 'auto'
        check_counts(result.stats)


def test_auto_is_a_drafter_a_goal_may_name(tiny_engine, reference):
    assert 'auto' in tiny_engine.capabilities.drafters
    assert tiny_engine.validate(GenerationRequest(prompt=STORY_PROMPT, drafter='auto')).drafter == 'auto'
    result = tiny_engine.generate(GenerationRequest(prompt=STORY_PROMPT, max_new_tokens=24, drafter='auto'))
    assert result.token_ids == reference(ids_of(tiny_engine, STORY_PROMPT), 24)
    # a single drafter's goal counts its rounds too
    single = tiny_engine.generate(GenerationRequest(prompt=CODE_PROMPT, max_new_tokens=24, drafter='ngram'))
    assert set(single.stats.rounds_by_drafter) <= {'ngram', 'none'}
    check_counts(single.stats)


def test_auto_drafts_with_prompt_lookup_where_the_text_repeats(tiny_engine_config, reference):
    # the random model drafters accept nothing (their gates pause them after 8 rounds, then they probe now and
    # then); prompt lookup copies what the text repeats
    engine = fresh_engine(tiny_engine_config)
    for prompt in (STORY_PROMPT, CODE_PROMPT):  # the members' first rounds: each is tried, then priced
        engine.generate(GenerationRequest(prompt=prompt, max_new_tokens=LONG))
    results = [engine.generate(GenerationRequest(prompt=prompt, max_new_tokens=LONG))
               for prompt in (CODE_PROMPT, STORY_PROMPT)]  # the tiny target's story repeats itself too
    for prompt, result in zip((CODE_PROMPT, STORY_PROMPT), results, strict=True):
        assert result.token_ids == reference(ids_of(engine, prompt), LONG)
    rounds = sum((Counter(result.stats.rounds_by_drafter) for result in results), Counter())
    assert rounds['ngram'] > rounds['draft'] + rounds['mtp'], rounds
    assert all(result.stats.accepted_tokens > 0 for result in results)


def test_auto_drafts_with_a_model_drafter_that_pays(tiny_engine_config, reference, monkeypatch):
    # a model drafter whose drafts the target always accepts, on text of no repeats: it beats prompt lookup
    engine = fresh_engine(tiny_engine_config)
    ids = list(range(40, 64))
    expected = reference(ids, LONG)
    monkeypatch.setitem(engine._drafters, 'draft', OracleDrafter([ids + expected]))
    result = engine.generate(GenerationRequest(prompt_ids=ids, max_new_tokens=LONG))
    assert result.token_ids == expected and not result.warnings
    rounds = result.stats.rounds_by_drafter
    assert rounds.get('draft', 0) > 2 * (rounds.get('ngram', 0) + rounds.get('mtp', 0)), rounds
    check_counts(result.stats)


def test_a_drafter_whose_model_is_missing_is_no_candidate(tiny_models, reference):
    # no draft model configured, and an assistant path that fails to load (the drafter is disabled)
    engine = Engine.from_config(EngineConfig(target_path=tiny_models.target, drafter='auto',
                                             assistant_path=tiny_models.target + '-missing', compile=TEST_COMPILE,
                                             **ON_TEST_DEVICE), tolerate_drafter_errors=True)
    assert set(engine.drafter_errors) == {'mtp'} and 'auto' in engine.capabilities.drafters
    result = engine.generate(GenerationRequest(prompt=CODE_PROMPT, max_new_tokens=40))
    assert result.token_ids == reference(ids_of(engine, CODE_PROMPT), 40) and not result.warnings
    assert set(result.stats.rounds_by_drafter) <= {'ngram', 'lookahead', 'none'} and result.stats.drafter == 'auto'
    assert engine.status().drafter == 'auto'


def test_a_member_that_fails_leaves_the_goal_to_the_others(tiny_engine_config, reference, monkeypatch):
    engine = fresh_engine(tiny_engine_config)  # a member never measured drafts early: this one raises then
    monkeypatch.setitem(engine._drafters, 'mtp', FailingDrafter())
    result = engine.generate(GenerationRequest(prompt=STORY_PROMPT, max_new_tokens=40, num_draft_tokens=2))
    assert result.token_ids == reference(ids_of(engine, STORY_PROMPT), 40)
    assert result.stats.drafter == 'auto' and 'mtp' not in result.stats.rounds_by_drafter
    assert [warning for warning in result.warnings if 'auto goes on without it' in warning]


def run_together(engine, requests: dict) -> dict:
    results = {}

    def run(name):
        results[name] = engine.generate(requests[name])

    threads = [threading.Thread(target=run, args=(name,)) for name in requests]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    assert not any(thread.is_alive() for thread in threads)
    return results


@pytest.mark.parametrize('k', [0, 3])
def test_auto_goals_in_a_batch_match_plain_decoding(auto_batch_engine, reference, k):
    # auto goals beside single drafters' goals: each round groups the rows by the drafter that drafts them
    requests = {
        'code-auto': GenerationRequest(prompt=CODE_PROMPT, max_new_tokens=LONG, num_draft_tokens=k),
        'story-auto': GenerationRequest(prompt=STORY_PROMPT, max_new_tokens=LONG - 20, num_draft_tokens=k),
        'story-mtp': GenerationRequest(prompt=STORY_PROMPT + ' then', max_new_tokens=30, drafter='mtp',
                                       num_draft_tokens=k),
        'code-draft': GenerationRequest(prompt=CODE_PROMPT + 'def', max_new_tokens=30, drafter='draft',
                                        num_draft_tokens=k),
        'story-none': GenerationRequest(prompt=STORY_PROMPT + ' a', max_new_tokens=40, drafter='none'),
    }
    results = run_together(auto_batch_engine, requests)
    for name, request in requests.items():
        assert results[name].token_ids == reference(ids_of(auto_batch_engine, request.prompt),
                                                    request.max_new_tokens), name
        assert not results[name].warnings, (name, results[name].warnings)
    for name in ('code-auto', 'story-auto'):
        stats = results[name].stats
        assert stats.drafter == 'auto'
        check_counts(stats)
    assert results['code-auto'].stats.rounds_by_drafter.get('ngram', 0) > 0


def test_a_draft_model_slot_far_behind_catches_up_in_the_batch(auto_batch_engine, reference, monkeypatch):
    # the random draft model's gate pauses it; between its probes the goal's rounds run plain, and its slot of the
    # draft model's cache falls behind by more than a round's step takes: it catches up in one eager pass first
    from gemma_spec_ros.engine.runtime.steps.rows import FastRows

    caught_up = []
    extend = FastRows.extend
    monkeypatch.setattr(FastRows, 'extend', lambda rows, slot, ids: caught_up.append(ids.shape[1]) or extend(
        rows, slot, ids))
    result = auto_batch_engine.generate(GenerationRequest(prompt=STORY_PROMPT, max_new_tokens=2 * LONG,
                                                          drafter='draft'))
    assert result.token_ids == reference(ids_of(auto_batch_engine, STORY_PROMPT), 2 * LONG) and not result.warnings
    assert result.stats.paused_rounds > 0 and caught_up and max(caught_up) > 2, caught_up


@pytest.mark.parametrize('batched', [False, True], ids=['alone', 'batch'])
def test_sampled_auto_goals_follow_the_target_distribution(tiny_engine_config, monkeypatch, batched):
    engine = fresh_engine(tiny_engine_config, max_batch=MAX_BATCH if batched else 1)
    temperature, top_k, length, samples = 2.0, 3, 3, 600
    prompt_ids = engine.tokenizer('the the the cube the the').input_ids
    expected = target_distribution(engine.target_lm.model, prompt_ids, temperature, top_k, length)
    likely_second = Counter()  # drafting the likeliest second token gets drafts accepted and rejected
    for outcome, probability in expected.items():
        likely_second[outcome[1]] += probability
    # in place of prompt lookup: a deterministic proposal the target often takes; the random model drafters
    # propose sampled drafts (with their probabilities) in the rounds they win
    monkeypatch.setitem(engine._drafters, 'ngram', RepeatingDrafter(likely_second.most_common(1)[0][0]))
    observed, drafted, accepted, used, lock = Counter(), [0], [0], Counter(), threading.Lock()

    def sample(count):
        for _ in range(count):  # unseeded, adaptive: the drafter of each round is chosen on measured rates
            result = engine.generate(GenerationRequest(prompt_ids=prompt_ids, max_new_tokens=length,
                                                       temperature=temperature, top_k=top_k, drafter='auto'))
            with lock:
                observed[tuple(result.token_ids)] += 1
                drafted[0] += result.stats.drafted_tokens
                accepted[0] += result.stats.accepted_tokens
                used.update(result.stats.rounds_by_drafter)

    senders = MAX_BATCH if batched else 1
    threads = [threading.Thread(target=sample, args=(samples // senders,)) for _ in range(senders)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(600)
    engine.close()
    assert sum(observed.values()) == samples and 0 < accepted[0] < drafted[0], (accepted, drafted, used)
    assert chi_squared_p_value(observed, expected) > 1e-3
