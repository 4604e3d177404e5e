"""
The engine on the fast path (lean forward, static KV cache).

Rollbacks at the window edge, the MTP assistant on the rolled-back cache, sampling (χ²), memory, the context limit
and the choice of path (engine.compile).
"""

import dataclasses
import itertools
from collections import Counter

import pytest
import torch
from conftest import (
    AGREEING_COMPILE,
    SLIDING_WINDOW,
    TEST_COMPILE,
    TEST_THREADS,
    chi_squared_p_value,
    corrupt_after,
    target_distribution,
)

from gemma_spec_ros.engine import Engine, EngineConfig, GenerationRequest
from gemma_spec_ros.engine.drafters.base import Proposal
from gemma_spec_ros.engine.runtime import FastAssistant, FastCausalLM
from gemma_spec_ros.engine.runtime.steps.causal_lm import DynamicCausalLM

STORY_PROMPT = 'The robot picked up the red cube and'
SAMPLING_PROMPT = 'the the the cube the the'
CROSSINGS = 200  # new tokens: the fixtures' sliding window (16) twelve times over
SAMPLES = 1000
TOP_K = 3        # sampled outputs of OUTPUT_LENGTH tokens: TOP_K ** OUTPUT_LENGTH outcomes
OUTPUT_LENGTH = 3


@pytest.mark.parametrize('edge', ['window', 'ring'])
def test_rollbacks_right_at_the_window_edge_stay_exact(agreeing_engine, reference, edge):
    # the draft model is the target, so its drafts are right; each round's first wrong draft is put where the
    # rollback lands exactly on a multiple of the sliding window (or of the sliding ring's size)
    target = agreeing_engine.target_lm
    assert isinstance(target, FastCausalLM) and target.mode == AGREEING_COMPILE
    period = SLIDING_WINDOW if edge == 'window' else target.cache.ring_size
    prompt_ids = agreeing_engine.tokenizer(STORY_PROMPT).input_ids
    drafter = agreeing_engine.drafter('draft')
    original = drafter.propose
    edges = []

    def propose(context, k):
        keep = (-len(context.tokens)) % period  # drafts before the next edge position
        edges.append(keep < k)
        return corrupt_after(original(context, k), keep)

    drafter.propose = propose
    try:
        result = agreeing_engine.generate(GenerationRequest(prompt_ids=prompt_ids, max_new_tokens=CROSSINGS,
                                                            num_draft_tokens=8))
    finally:
        drafter.propose = original
    assert result.token_ids == reference(prompt_ids, CROSSINGS)
    assert sum(edges) >= CROSSINGS // period  # a rollback at every edge crossed
    assert result.stats.accepted_tokens < result.stats.drafted_tokens


def test_mtp_assistant_reads_only_the_kept_target_cache(tiny_engine, reference):
    # an oracle keeps the first j drafts right; after each round the assistant's first draft step must equal the
    # step on a fresh target cache that never saw the rejected drafts
    prompt_ids = tiny_engine.tokenizer(STORY_PROMPT).input_ids
    truth = reference(prompt_ids, 60)
    drafter = tiny_engine.drafter('mtp')
    assert drafter._fast is not None
    target = tiny_engine.target_lm
    fresh_target = FastCausalLM(target.model, target.cache.context_limit, target.max_query, 'eager')
    fresh_assistant = FastAssistant(drafter._assistant, fresh_target, 'eager')
    original = drafter.propose
    checked = []

    def propose(context, k):
        position = len(context.tokens) - 1
        assert target.length == position  # the rejected drafts are rolled back
        fresh_target.reset()
        fresh_target.prefill(torch.tensor([context.tokens[:-1]], device=target.lean.device))
        expected = fresh_assistant.step(context.last_token.unsqueeze(0), drafter._hidden, position).logits
        with drafter._steps_at(position) as step:
            actual = step(context.last_token, drafter._hidden)[0]
        torch.testing.assert_close(actual, expected[:, -1], atol=1e-4, rtol=1e-4)
        checked.append(position)
        done, keep = len(context.tokens) - len(prompt_ids), position % (k + 1)
        right = torch.tensor(truth[done:done + k], device=target.lean.device)
        proposal = original(context, k)
        return corrupt_after(Proposal(torch.cat([right[:keep], proposal.tokens[keep:]]), None), keep)

    drafter.propose = propose
    try:
        result = tiny_engine.generate(GenerationRequest(prompt_ids=prompt_ids, max_new_tokens=60, drafter='mtp',
                                                        num_draft_tokens=4))
    finally:
        drafter.propose = original
    assert result.token_ids == truth and 0.2 < result.stats.acceptance_rate < 0.9
    assert len(checked) >= 10
    assert max(checked) > 2 * SLIDING_WINDOW  # past the window: the ring has wrapped


@pytest.mark.parametrize('drafter', ['draft', 'mtp', 'eagle3'])  # drafters with draft_probs; test_verify: one-hot
def test_sampled_speculation_follows_the_target_distribution(tiny_engine, drafter):
    temperature = 2.0  # spreads the random target's top 3
    prompt_ids = tiny_engine.tokenizer(SAMPLING_PROMPT).input_ids
    expected = target_distribution(tiny_engine.target_lm.model, prompt_ids, temperature, TOP_K, OUTPUT_LENGTH)
    assert sum(p * SAMPLES >= 5 for p in expected.values()) >= 10  # bins enough for power
    observed, drafted = Counter(), 0
    for seed in range(SAMPLES):
        result = tiny_engine.generate(GenerationRequest(
            prompt_ids=prompt_ids, max_new_tokens=OUTPUT_LENGTH, temperature=temperature, top_k=TOP_K, seed=seed,
            drafter=drafter, num_draft_tokens=2))
        observed[tuple(result.token_ids)] += 1
        drafted += result.stats.drafted_tokens
    assert drafted > 0
    assert chi_squared_p_value(observed, expected) > 1e-3


def test_chi_squared_detects_a_wrong_distribution(tiny_engine):
    # the same check against the target at another temperature must fail: the test has power
    prompt_ids = tiny_engine.tokenizer(SAMPLING_PROMPT).input_ids
    expected = target_distribution(tiny_engine.target_lm.model, prompt_ids, 2.0, TOP_K, OUTPUT_LENGTH)
    observed = Counter()
    for seed in range(SAMPLES):
        result = tiny_engine.generate(GenerationRequest(prompt_ids=prompt_ids, max_new_tokens=OUTPUT_LENGTH,
                                                        temperature=0.5, top_k=TOP_K, seed=seed, drafter='draft',
                                                        num_draft_tokens=2))
        observed[tuple(result.token_ids)] += 1
    assert chi_squared_p_value(observed, expected) < 1e-6


def test_status_reports_the_path_and_its_memory(tiny_engine, tiny_engine_off):
    fast, off = tiny_engine.status(), tiny_engine_off.status()
    assert (fast.compile_mode, off.compile_mode) == (TEST_COMPILE, 'transformers')
    head = tiny_engine.drafter('eagle3')  # the fast path's alone (it reads the lean forward's taps)
    assert fast.weights_bytes == off.weights_bytes + head.weights_bytes and off.weights_bytes > 0
    target_cache = tiny_engine.target_lm.cache
    assert fast.kv_cache_bytes == (target_cache.nbytes + tiny_engine.drafter('draft').kv_cache_bytes
                                   + head.kv_cache_bytes)
    assert target_cache.context_limit == 1024  # engine.context_limit 4096, the tiny models' 1024 positions
    assert off.kv_cache_bytes == 0


def test_timed_target_passes_cover_every_size_and_leave_requests_exact(tiny_engine, reference):
    prompt_ids = tiny_engine.tokenizer(STORY_PROMPT).input_ids
    seconds = tiny_engine.time_target_passes(prompt_ids, [1, 3, 9])
    assert sorted(seconds) == [1, 3, 9] and min(seconds.values()) > 0
    result = tiny_engine.generate(GenerationRequest(prompt_ids=prompt_ids, max_new_tokens=24, drafter='draft'))
    assert result.token_ids == reference(prompt_ids, 24)
    with pytest.raises(ValueError, match='max_draft_tokens'):
        tiny_engine.time_target_passes(prompt_ids, [1, 10])
    with pytest.raises(ValueError, match='no room'):
        tiny_engine.time_target_passes([], [1])


def test_context_limit_sizes_the_cache_and_bounds_requests(tiny_engine_config):
    engine = Engine.from_config(dataclasses.replace(tiny_engine_config, context_limit=64, drafter='draft'))
    assert engine.target_lm.cache.context_limit == 64
    prompt_ids = engine.tokenizer(STORY_PROMPT).input_ids
    room = 64 - len(prompt_ids)
    with pytest.raises(ValueError, match='engine.context_limit'):
        engine.validate(GenerationRequest(prompt_ids=prompt_ids, max_new_tokens=room + 1))
    for drafter, k in itertools.product(('none', 'draft', 'mtp'), (0, 8)):  # the cache filled to the last slot
        result = engine.generate(GenerationRequest(prompt_ids=prompt_ids, max_new_tokens=room, drafter=drafter,
                                                   num_draft_tokens=k if drafter != 'none' else 0))
        assert len(result.token_ids) == room or result.finish_reason == 'stop'


def test_row_products_are_an_engine_parameter_every_compiled_model_takes(tiny_engine_config):
    # resolved once at load (not at import), so that a node's parameter sets the graphs its compile process builds
    config = dataclasses.replace(tiny_engine_config, compile='inductor', warmup='off', row_product_max_rows=3)
    engine = Engine.from_config(config)
    assert engine.config.row_product_max_rows == 3
    assert engine.target_lm.lean.row_product_max_rows == 3
    longest = config.max_draft_tokens + 1
    for role in ('target', 'draft'):  # a graph per pass length up to 3, then one for the longer passes
        passes = {job.name for job in engine.graph_jobs if job.name.startswith(role + ' q=')}
        assert passes == {role + ' q=1', role + ' q=2', role + ' q=3', '{} q=4..{}'.format(role, longest)}, passes
    default = Engine.from_config(dataclasses.replace(config, row_product_max_rows=0))
    assert default.config.row_product_max_rows == 2  # the tests' override (conftest), where the parameter is 0
    with pytest.raises(ValueError, match='engine.row_product_max_rows'):
        Engine.from_config(dataclasses.replace(config, row_product_max_rows=-1))


def _moe_target(tiny_models, tmp_path) -> str:
    from transformers import AutoTokenizer, Gemma4ForCausalLM, Gemma4TextConfig

    config = Gemma4TextConfig.from_pretrained(tiny_models.target)
    config.enable_moe_block, config.num_experts, config.top_k_experts, config.moe_intermediate_size = True, 4, 2, 32
    torch.manual_seed(3)
    model = Gemma4ForCausalLM(config).eval()
    model.save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(tiny_models.target).save_pretrained(tmp_path)
    return str(tmp_path)


def test_auto_runs_transformers_forward_where_the_fast_path_does_not_cover_the_model(tiny_models, tmp_path):
    config = EngineConfig(target_path=_moe_target(tiny_models, tmp_path), drafter='none', device='cpu',
                          num_threads=TEST_THREADS)
    messages = []
    engine = Engine.from_config(config, progress=messages.append)
    assert isinstance(engine.target_lm, DynamicCausalLM) and engine.status().compile_mode == 'transformers'
    assert any('fast path not available' in message and 'MoE' in message for message in messages)
    assert engine.generate(GenerationRequest(prompt=STORY_PROMPT, max_new_tokens=4)).token_ids
    with pytest.raises(ValueError, match='engine.compile=eager cannot run the target.*MoE'):
        Engine.from_config(dataclasses.replace(config, compile='eager'))


def test_compiled_steps_recompile_when_torch_threads_change_after_warm_up(agreeing_engine, reference):
    # warmed-up steps skip guard evaluation; a guard that fails (another thread count) must recompile, not break
    prompt_ids = agreeing_engine.tokenizer(STORY_PROMPT).input_ids
    torch.set_num_threads(TEST_THREADS + 1)
    try:
        result = agreeing_engine.generate(GenerationRequest(prompt_ids=prompt_ids, max_new_tokens=24,
                                                            num_draft_tokens=4))
    finally:
        torch.set_num_threads(TEST_THREADS)
    assert result.token_ids == reference(prompt_ids, 24)


@pytest.mark.parametrize('temperature', [0.0, 1.0])
def test_the_controller_prices_the_drafter_calls_each_round_makes(tiny_engine, monkeypatch, temperature):
    # greedy MTP rounds on the fast path draft in calls of several steps (K = 5: 4 + 1), sampled ones one per draft
    drafter, controller = tiny_engine.drafter('mtp'), tiny_engine.controller('mtp')
    steps, calls, rounds = drafter._fast._steps, [], []
    run_step, propose = steps.run, drafter.propose

    def counted_run(*args, **kwargs):
        calls[-1] += 1
        return run_step(*args, **kwargs)

    def counted_propose(context, k):
        calls.append(0)
        proposal = propose(context, k)
        if proposal is not None:
            rounds.append((proposal.tokens.shape[0], calls[-1]))
        return proposal

    monkeypatch.setattr(steps, 'run', counted_run)
    monkeypatch.setattr(drafter, 'propose', counted_propose)
    prompt_ids = tiny_engine.tokenizer(SAMPLING_PROMPT).input_ids
    for k in (3, 5, 8):
        tiny_engine.generate(GenerationRequest(prompt_ids=prompt_ids, max_new_tokens=24, temperature=temperature,
                                               drafter='mtp', num_draft_tokens=k))
    assert {k for k, _ in rounds} >= {3, 5, 8}
    assert all(made == controller.draft_calls(k) for k, made in rounds), rounds
    assert (controller.draft_calls(5) == 2) == (temperature == 0.0)
