"""The pure verification function: exact tokens on hand-built inputs, and losslessness by sampling."""

import pytest
import torch

from gemma_spec_ros.engine.logits.sampling import SamplingParams, logits_to_probs
from gemma_spec_ros.engine.logits.verify import verify

TARGET = torch.tensor([0.5, 0.3, 0.15, 0.05])
DRAFT_NEAR = torch.tensor([0.6, 0.2, 0.1, 0.1])
DRAFT_FAR = torch.tensor([0.05, 0.05, 0.1, 0.8])
TRIALS = 200_000
TV_BOUND = 0.01  # sampling noise at 200k trials is ~0.002; the transformers rule is off by ~0.33


def one_hot(index, vocab=4):
    return torch.nn.functional.one_hot(torch.tensor(index), vocab).float()


def test_greedy_accepts_longest_matching_prefix_and_adds_target_token():
    target_logits = torch.stack([one_hot(3), one_hot(1), one_hot(2)])[None] * 5  # argmax 3, 1, 2
    cases = {(3, 1): (2, 2), (3, 0): (1, 1), (0, 1): (0, 3)}
    for drafts, (accepted, next_token) in cases.items():
        num, token = verify(torch.tensor([drafts]), target_logits, None, greedy=True)
        assert (num.item(), token.item()) == (accepted, next_token)


def test_greedy_without_drafts_is_plain_argmax():
    num, token = verify(torch.zeros(1, 0, dtype=torch.long), torch.tensor([[[0.1, 2.0, 0.3]]]), None, greedy=True)
    assert (num.item(), token.item()) == (0, 1)


def test_sampling_first_rejected_draws_recovered_token():
    # position 0: target certain of 1 and draft 1 -> accepted; position 1: target says 2, draft 3 -> rejected,
    # recovered from normalize(max(0, target - draft)) = token 2 exactly
    target_probs = torch.stack([one_hot(1), one_hot(2), one_hot(0)])[None]
    draft_probs = torch.stack([one_hot(1), one_hot(3)])[None]
    num, token = verify(torch.tensor([[1, 3]]), target_probs, draft_probs, greedy=False,
                        generator=torch.Generator().manual_seed(0))
    assert (num.item(), token.item()) == (1, 2)


def test_sampling_all_accepted_draws_bonus_token():
    target_probs = torch.stack([one_hot(1), one_hot(2), one_hot(3)])[None]
    num, token = verify(torch.tensor([[1, 2]]), target_probs, None, greedy=False,
                        generator=torch.Generator().manual_seed(0))
    assert (num.item(), token.item()) == (2, 3)


def test_sampling_deterministic_draft_rejected_removes_it():
    # one-hot draft of token 0 where the target gives it 0: the recovered token comes from the target without 0
    target_probs = torch.tensor([[[0.0, 0.0, 1.0, 0.0], [0.25, 0.25, 0.25, 0.25]]])
    num, token = verify(torch.tensor([[0]]), target_probs, None, greedy=False,
                        generator=torch.Generator().manual_seed(0))
    assert (num.item(), token.item()) == (0, 2)


def _first_token_distribution(draft, k, sampled, softmax_bug=False, seed=0):
    """Distribution of the first emitted token over TRIALS independent rounds (vectorized)."""
    generator = torch.Generator().manual_seed(seed)
    if sampled:
        draft_tokens = torch.multinomial(draft.expand(TRIALS, -1), k, replacement=True, generator=generator)
    else:
        draft_tokens = torch.full((TRIALS, k), int(draft.argmax()))
    target_probs = TARGET.expand(TRIALS, k + 1, -1)
    draft_probs = draft.expand(TRIALS, k, -1) if sampled or softmax_bug else None
    num, token = verify(draft_tokens, target_probs, draft_probs, greedy=False, generator=generator)
    first = torch.where(num > 0, draft_tokens[:, 0], token)
    second = torch.where(num > 1, draft_tokens[:, 1 % k], token)[num >= 1]
    return torch.bincount(first, minlength=4) / TRIALS, torch.bincount(second, minlength=4) / len(second)


def tv(a, b):
    return 0.5 * (a - b).abs().sum().item()


@pytest.mark.parametrize('draft', [TARGET, DRAFT_NEAR, DRAFT_FAR], ids=['equal', 'near', 'far'])
@pytest.mark.parametrize('sampled', [True, False], ids=['sampled', 'argmax'])
def test_sampled_output_follows_target_distribution(draft, sampled):
    first, second = _first_token_distribution(draft, k=3, sampled=sampled)
    assert tv(first, TARGET) < TV_BOUND, first
    assert tv(second, TARGET) < TV_BOUND, second


def test_softmax_for_argmax_proposal_is_detected():
    # transformers' rule (argmax proposal judged against the softmax of the draft logits) is not lossless;
    # this test's bound must catch it
    first, _ = _first_token_distribution(DRAFT_NEAR, k=1, sampled=False, softmax_bug=True)
    assert tv(first, TARGET) > 0.2, first


def test_same_generator_seed_same_tokens():
    draft_tokens = torch.randint(0, 4, (1000, 4), generator=torch.Generator().manual_seed(1))
    target_probs = TARGET.expand(1000, 5, -1)
    runs = [verify(draft_tokens, target_probs, None, greedy=False, generator=torch.Generator().manual_seed(5))
            for _ in range(2)]
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])


def test_logits_to_probs_top_k_top_p_temperature():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert torch.allclose(logits_to_probs(logits, SamplingParams(1.0)), TARGET[None])
    top2 = logits_to_probs(logits, SamplingParams(1.0, top_k=2))
    assert torch.allclose(top2, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    nucleus = logits_to_probs(logits, SamplingParams(1.0, top_p=0.8))  # 0.5 + 0.3 reaches 0.8
    assert torch.allclose(nucleus, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    cold = logits_to_probs(logits, SamplingParams(0.5))
    assert cold[0, 0] > 0.5 and torch.isclose(cold.sum(), torch.tensor(1.0))
