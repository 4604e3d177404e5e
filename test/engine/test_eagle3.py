"""The EAGLE-3 head on tiny random Gemma 4 models: training matches inference, greedy parity, its bookkeeping."""

import dataclasses

import pytest
import torch
from conftest import corrupt_after

from gemma_spec_ros.engine import Engine, GenerationRequest
from gemma_spec_ros.engine.drafters.base import Proposal
from gemma_spec_ros.engine.runtime import FastCausalLM
from gemma_spec_ros.engine.runtime.model.eagle import Eagle3Cache, Eagle3Config, Eagle3Head, training_masks

CODE_PROMPT = 'def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n\ndef add(a, b):\n'
STORY_PROMPT = 'The robot picked up the red cube and'
LONG = 72


@pytest.fixture(scope='module')
def target(tiny_models):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_models.target, dtype=torch.float32).eval()


@pytest.fixture(scope='module')
def head(tiny_models):
    return Eagle3Head.load(tiny_models.eagle3, torch.device('cpu'), torch.float32)


def test_training_masks_show_each_depth_its_chain():
    # depth 2 at entry 5: the chain started at the true entry 3; it sees true entries 0..3, depth 1 at 4, depth 2 at 5
    mask = training_masks(8, 2, 'cpu')
    assert mask.shape == (8, 24)
    assert mask[5, :8].tolist() == [True] * 4 + [False] * 4
    assert mask[5, 8:16].nonzero().flatten().tolist() == [4] and mask[5, 16:].nonzero().flatten().tolist() == [5]
    assert training_masks(4, 0, 'cpu').tolist() == torch.ones(4, 4).tril().bool().tolist()


def test_the_target_states_training_reads_are_the_lean_forwards_features(target, head):
    from gemma_spec_ros.train.eagle3 import target_states

    ids = torch.randint(3, 500, (1, 20), generator=torch.Generator().manual_seed(0))
    states = target_states(target, ids, head.config.feature_layers)
    lean = FastCausalLM(target, 64, 9, 'eager')
    lean.lean.feature_layers = head.config.feature_layers
    prefill = lean.prefill(ids[:, :12], 1)
    step = lean.step(ids[:, 12:17], 0)
    assert prefill.features.shape == (1, 12, 3 * target.config.hidden_size)
    torch.testing.assert_close(prefill.features, states.features[:, :12], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(step.features, states.features[:, 12:17], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(('chain_start', 'depth'), [(3, 0), (2, 1), (5, 2), (9, 3)])
def test_each_trained_depth_is_what_drafting_computes(target, head, chain_start, depth):
    # training-time test: depth s at position p (all depths at once, masked) equals entering the true entries up to
    # p - s into the head's cache and drafting s steps on the head's own outputs
    from gemma_spec_ros.train.eagle3 import depth_logits, target_states

    ids = torch.randint(3, 500, (1, 20), generator=torch.Generator().manual_seed(1))
    states = target_states(target, ids, head.config.feature_layers)
    trained = depth_logits(head, states, 4)[depth][0, chain_start + depth - 1]
    cache = Eagle3Cache(head, 64, torch.device('cpu'), torch.float32)
    cache.reset(1)
    with torch.no_grad():
        hidden = cache.enter(states.embeds[:, 1:chain_start + 1], head.fuse_target(states.features[:, :chain_start]))
        for step in range(1, depth + 1):
            hidden = cache.enter(states.embeds[:, chain_start + step:chain_start + step + 1], hidden[:, -1:])
        drafted = head.logits(hidden[0, -1])
    torch.testing.assert_close(drafted, trained, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize('k', range(1, 9))
def test_greedy_parity_with_transformers(tiny_engine, reference, k):
    prompt_ids = tiny_engine.tokenizer(STORY_PROMPT).input_ids
    result = tiny_engine.generate(GenerationRequest(prompt_ids=prompt_ids, max_new_tokens=LONG, drafter='eagle3',
                                                    num_draft_tokens=k))
    assert result.token_ids == reference(prompt_ids, LONG)
    assert result.stats.drafter == 'eagle3' and not result.warnings and result.stats.drafted_tokens > 0


def test_greedy_parity_adaptive_k_and_sampled_seeds(tiny_engine, reference):
    prompt_ids = tiny_engine.tokenizer(CODE_PROMPT).input_ids
    for _ in range(2):
        result = tiny_engine.generate(GenerationRequest(prompt_ids=prompt_ids, max_new_tokens=LONG, drafter='eagle3'))
        assert result.token_ids == reference(prompt_ids, LONG)
    request = GenerationRequest(prompt=CODE_PROMPT, max_new_tokens=40, temperature=0.8, top_k=50, seed=3,
                                drafter='eagle3', num_draft_tokens=3)
    assert tiny_engine.generate(request).token_ids == tiny_engine.generate(request).token_ids


def test_the_heads_entries_are_the_kept_tokens_true_entries(tiny_engine, reference):
    # an oracle keeps the first j drafts right; at every round the head's entries up to the last token must equal
    # entries made afresh from a target that never saw a rejected draft
    prompt_ids = tiny_engine.tokenizer(STORY_PROMPT).input_ids
    truth = reference(prompt_ids, 60)
    drafter = tiny_engine.drafter('eagle3')
    target = tiny_engine.target_lm
    fresh = FastCausalLM(target.model, target.cache.context_limit, target.max_query, 'eager')
    head = drafter._head
    original = drafter.propose
    checked = []

    def propose(context, k):
        proposal = original(context, k)  # enters the true entries up to the last token, then drafts
        last = len(context.tokens) - 1
        fresh.reset()
        features = fresh.prefill(torch.tensor([context.tokens[:-1]]), 1).features
        cache = Eagle3Cache(head, 256, torch.device('cpu'), torch.float32)
        cache.reset(1)
        with torch.no_grad():
            cache.enter(target.lean.embed_tokens(torch.tensor(context.tokens[1:]))[None], head.fuse_target(features))
        held = drafter._runner.cache
        assert held.start == 1 and held.length >= last
        torch.testing.assert_close(held.keys[:, :, :last], cache.keys[:, :, :last], atol=1e-4, rtol=1e-4)
        checked.append(last)
        done, keep = len(context.tokens) - len(prompt_ids), last % (k + 1)
        right = torch.tensor(truth[done:done + k])
        return corrupt_after(Proposal(torch.cat([right[:keep], proposal.tokens[keep:]]), None), keep)

    fresh.lean.feature_layers = target.lean.feature_layers
    drafter.propose = propose
    try:
        result = tiny_engine.generate(GenerationRequest(prompt_ids=prompt_ids, max_new_tokens=60, drafter='eagle3',
                                                        num_draft_tokens=4))
    finally:
        drafter.propose = original
    assert result.token_ids == truth and 0.2 < result.stats.acceptance_rate < 0.9
    assert len(checked) >= 10


def test_a_prompt_from_the_prefix_cache_drafts_from_the_positions_it_prefilled(tiny_engine_config, reference):
    engine = Engine.from_config(dataclasses.replace(tiny_engine_config, prefix_cache_mb=4, drafter='eagle3'))
    prompt_ids = engine.tokenizer(CODE_PROMPT * 3).input_ids
    for _ in range(2):  # the second prompt restores the first's blocks: the head has no states for them
        result = engine.generate(GenerationRequest(prompt_ids=prompt_ids, max_new_tokens=40, num_draft_tokens=3))
        assert result.token_ids == reference(prompt_ids, 40) and result.stats.drafted_tokens > 0
    assert result.stats.cached_prompt_tokens > 0


def test_transformers_forward_names_why_it_has_no_eagle3(tiny_engine_config):
    engine = Engine.from_config(dataclasses.replace(tiny_engine_config, compile='transformers', assistant_path='',
                                                    draft_model_path=''), tolerate_drafter_errors=True)
    assert 'engine.compile must not be transformers' in engine.drafter_errors['eagle3'].describe()
    result = engine.generate(GenerationRequest(prompt=STORY_PROMPT, max_new_tokens=8, drafter='eagle3'))
    assert [warning.kind.value for warning in result.warnings] == ['drafter_fallback']
    assert result.token_ids


def test_a_head_for_another_target_is_refused(tiny_models, tiny_engine_config, tmp_path, target):
    config = Eagle3Config.for_target(target.config, hidden_size=48, intermediate_size=96)
    Eagle3Head(dataclasses.replace(config, vocab_size=config.vocab_size + 1)).save(tmp_path / 'other')
    engine = Engine.from_config(dataclasses.replace(tiny_engine_config, eagle3_path=str(tmp_path / 'other'),
                                                    assistant_path='', draft_model_path=''),
                                tolerate_drafter_errors=True)
    assert 'is for a target of hidden size' in engine.drafter_errors['eagle3'].describe()
    with pytest.raises(ValueError, match='needs eagle3.json'):
        Eagle3Head.load(tmp_path / 'missing', torch.device('cpu'), torch.float32)
