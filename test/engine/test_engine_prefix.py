"""The prefix cache in the engine: a goal that reuses a cached prompt prefix decodes as one that prefilled it all."""

import dataclasses
import random
import threading
from collections import Counter

import pytest
from conftest import chi_squared_p_value, target_distribution

from gemma_spec_ros.engine import Engine, GenerationRequest

LONG = 48     # new tokens
BLOCK = 64    # runtime.prefix_cache.DEFAULT_BLOCK_TOKENS: the least a hit reuses


@pytest.fixture(scope='module')
def batch_engine(tiny_engine_config):
    engine = Engine.from_config(dataclasses.replace(tiny_engine_config, max_batch=3))
    yield engine
    engine.close()


def fixed_prefix(engine, seed: int, tokens: int = 150) -> list[int]:
    """Return a stand-in for a planner's fixed system prompt: the same known words for every goal of a test."""
    words = random.Random(seed).choices(['robot', 'cup', 'table', 'pick', 'place', 'the', 'sink', 'door', 'red'],
                                        k=tokens)
    return engine.tokenizer(' '.join(words)).input_ids[:tokens]


def suffix(engine, text: str) -> list[int]:
    return engine.tokenizer(text, add_special_tokens=False).input_ids


def greedy(engine, prompt_ids, drafter, max_new_tokens=LONG):
    return engine.generate(GenerationRequest(prompt_ids=prompt_ids, max_new_tokens=max_new_tokens, drafter=drafter))


@pytest.mark.parametrize('drafter', ['none', 'ngram', 'draft', 'mtp'])
def test_a_hit_decodes_the_tokens_of_a_miss(tiny_engine, drafter):
    prefix = fixed_prefix(tiny_engine, seed=len(drafter))
    first, second = prefix + suffix(tiny_engine, ' Scene: a red cup.'), prefix + suffix(tiny_engine, ' Go on.')
    tiny_engine.clear_prefix_cache()
    miss = greedy(tiny_engine, first, drafter)
    hit = greedy(tiny_engine, first, drafter)                # the whole prompt but its last block
    other_hit = greedy(tiny_engine, second, drafter)         # the shared prefix, another suffix
    tiny_engine.clear_prefix_cache()
    other_miss = greedy(tiny_engine, second, drafter)
    assert miss.stats.cached_prompt_tokens == other_miss.stats.cached_prompt_tokens == 0
    assert hit.stats.cached_prompt_tokens >= BLOCK and other_hit.stats.cached_prompt_tokens >= BLOCK
    assert hit.token_ids == miss.token_ids and other_hit.token_ids == other_miss.token_ids
    assert hit.stats.drafter == drafter


def test_status_reports_the_cache_and_clearing_empties_it(tiny_engine):
    prefix = fixed_prefix(tiny_engine, seed=7)
    tiny_engine.clear_prefix_cache()
    before = tiny_engine.status().prefix_cache
    greedy(tiny_engine, prefix + suffix(tiny_engine, ' one'), 'none', max_new_tokens=2)
    greedy(tiny_engine, prefix + suffix(tiny_engine, ' two'), 'none', max_new_tokens=2)
    after = tiny_engine.status().prefix_cache
    assert after.lookups == before.lookups + 2 and after.hits == before.hits + 1
    assert after.tokens_reused - before.tokens_reused >= BLOCK and 0 < after.nbytes <= after.budget_bytes
    assert 0 < after.hit_rate <= 1
    tiny_engine.clear_prefix_cache()
    assert tiny_engine.status().prefix_cache.nbytes == 0


def test_off_prefills_every_prompt(tiny_engine_config):
    engine = Engine.from_config(dataclasses.replace(tiny_engine_config, prefix_cache_mb=0.0))
    prompt = fixed_prefix(engine, seed=3)
    results = [greedy(engine, prompt, 'none', max_new_tokens=4) for _ in range(2)]
    assert [r.stats.cached_prompt_tokens for r in results] == [0, 0] and engine.status().prefix_cache is None


def test_batched_goals_hit_and_decode_the_single_goal_tokens(batch_engine):
    prefix = fixed_prefix(batch_engine, seed=11)
    prompts = [prefix + suffix(batch_engine, text) for text in (' alpha', ' beta', ' gamma')]
    batch_engine.clear_prefix_cache()
    alone = []
    for prompt in prompts:  # one at a time, each after a clear: misses
        batch_engine.clear_prefix_cache()
        alone.append(greedy(batch_engine, prompt, 'draft'))
    batch_engine.clear_prefix_cache()
    greedy(batch_engine, prefix + suffix(batch_engine, ' delta'), 'draft', max_new_tokens=2)  # caches the prefix
    together = [None] * len(prompts)

    def run(index):
        together[index] = greedy(batch_engine, prompts[index], 'draft')

    threads = [threading.Thread(target=run, args=(index,)) for index in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert [r.stats.cached_prompt_tokens for r in alone] == [0] * len(prompts)
    assert all(r.stats.cached_prompt_tokens >= BLOCK for r in together)
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]


def test_sampled_goals_that_hit_follow_the_target_distribution(tiny_engine):
    temperature, top_k, length, samples = 2.0, 3, 3, 600
    prompt_ids = fixed_prefix(tiny_engine, seed=5, tokens=90)
    expected = target_distribution(tiny_engine.target_lm.model, prompt_ids, temperature, top_k, length)
    tiny_engine.clear_prefix_cache()
    observed, reused = Counter(), 0
    for seed in range(samples):
        result = tiny_engine.generate(GenerationRequest(
            prompt_ids=prompt_ids, max_new_tokens=length, temperature=temperature, top_k=top_k, seed=seed,
            drafter='draft', num_draft_tokens=2))
        observed[tuple(result.token_ids)] += 1
        reused += result.stats.cached_prompt_tokens > 0
    assert reused == samples - 1  # every goal but the first hit
    assert chi_squared_p_value(observed, expected) > 1e-3


@pytest.mark.parametrize('quantization', ['int8', 'int4'])
def test_a_hit_decodes_the_tokens_of_a_miss_with_quantized_weights(tiny_engine_config, quantization):
    engine = Engine.from_config(dataclasses.replace(tiny_engine_config, quantization=quantization))
    prompt = fixed_prefix(engine, seed=13) + suffix(engine, ' Scene: a mug.')
    miss = greedy(engine, prompt, 'mtp')
    hit = greedy(engine, prompt, 'mtp')
    engine.close()
    assert miss.stats.cached_prompt_tokens == 0 < hit.stats.cached_prompt_tokens and hit.token_ids == miss.token_ids


def test_status_answers_while_a_goal_decodes(tiny_engine):
    # /diagnostics reads status() once a second: it must not wait for the goal that holds the engine
    answered, in_time = threading.Event(), []

    def on_delta(delta):
        if not in_time:  # the first delta: the goal is decoding and holds the engine
            reader = threading.Thread(target=lambda: (tiny_engine.status(), answered.set()), daemon=True)
            reader.start()
            reader.join(10)
            in_time.append(answered.is_set())

    result = tiny_engine.generate(GenerationRequest(prompt_ids=fixed_prefix(tiny_engine, seed=17), max_new_tokens=8,
                                                    drafter='none'), on_delta=on_delta)
    assert in_time == [True] and result.finish_reason == 'length'
