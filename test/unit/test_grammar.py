"""Grammar constraints on a tiny vocabulary: mask helpers, matcher moves and rollback, and lossless speculation (χ²)."""

import math
from collections import Counter

import pytest
import torch
from conftest import chi_squared_p_value
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast

from gemma_spec_ros.engine.logits.grammar import ConstraintCompiler, mask_logits, unpack_bitmask
from gemma_spec_ros.engine.logits.sampling import logits_to_probs
from gemma_spec_ros.engine.logits.verify import verify
from gemma_spec_ros.engine.requests import SamplingParams

VOCAB = ['<pad>', '<eos>', '<unk>', 'a', 'b', 'c', 'ab', 'ba', 'ca', 'bc', 'cc']
ID = {token: index for index, token in enumerate(VOCAB)}
EOS = ID['<eos>']
# words of a and b separated by single c's: never "cc", never a leading or trailing c; EOS after a or b
GRAMMAR = 'root ::= [ab]+ ("c" [ab]+)*'
# the target puts mass on the special tokens and on forbidden "cc"; the draft differs and likes forbidden tokens
TARGET = torch.tensor([0.04, 0.08, 0.03, 0.15, 0.10, 0.12, 0.08, 0.06, 0.12, 0.07, 0.15])
DRAFT = torch.tensor([0.02, 0.05, 0.02, 0.05, 0.20, 0.06, 0.05, 0.05, 0.05, 0.05, 0.40])
TRIALS = 4_000
OUTPUT_LENGTH = 3  # the χ² tests compare the distribution of the first three emitted tokens
SAMPLED = SamplingParams(temperature=1.0)


@pytest.fixture(scope='module')
def compiler():
    backend = Tokenizer(models.WordLevel({token: index for index, token in enumerate(VOCAB)}, unk_token='<unk>'))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token='<pad>', eos_token='<eos>',
                                        unk_token='<unk>')
    return ConstraintCompiler(tokenizer, len(VOCAB), [EOS])


def ids(*tokens):
    return [ID[token] for token in tokens]


def allowed_tokens(mask):
    return {VOCAB[index] for index in mask.reshape(-1).nonzero().flatten().tolist()}


def constrained_probs(probs, allowed):
    """Return the distribution the engine and the drafters sample under a constraint (mask, then logits_to_probs)."""
    return logits_to_probs(mask_logits(probs.log(), allowed), SAMPLED)


# ----------------------------------------------------------------------------------------------- pure helpers
def test_mask_logits_sets_disallowed_to_minus_inf_and_moves_argmax():
    logits = torch.tensor([[3.0, 1.0, 2.0], [0.5, 0.1, 0.2]])
    allowed = torch.tensor([[False, True, True], [True, True, True]])
    masked = mask_logits(logits, allowed)
    assert masked[0, 0] == float('-inf') and masked[0, 1:].tolist() == [1.0, 2.0]
    assert torch.equal(masked[1], logits[1])
    assert masked.argmax(dim=-1).tolist() == [2, 0]
    assert logits[0, 0] == 3.0  # the input is left alone


def test_masked_logits_sample_the_allowed_tokens_renormalised_and_top_k_chooses_among_them():
    masked = mask_logits(torch.tensor([[0.5, 0.3, 0.2, 0.0]]).log(), torch.tensor([[False, True, True, False]]))
    assert torch.allclose(logits_to_probs(masked, SAMPLED), torch.tensor([[0.0, 0.6, 0.4, 0.0]]))
    # the mask applies before top-k: the most likely token, forbidden, does not take the only place
    assert logits_to_probs(masked, SamplingParams(temperature=1.0, top_k=1)).tolist() == [[0.0, 1.0, 0.0, 0.0]]


def test_unpack_bitmask_reads_bits_little_endian_and_cuts_the_vocab():
    words = torch.tensor([[0b101, -2**31], [0, 1]], dtype=torch.int32)  # bit 31 set: token 63
    mask = unpack_bitmask(words, 40)
    assert mask.shape == (2, 40) and mask.dtype == torch.bool
    assert mask[0].nonzero().flatten().tolist() == [0, 2]                 # token 63 lies past vocab 40
    assert unpack_bitmask(words, 64)[0].nonzero().flatten().tolist() == [0, 2, 63]
    assert mask[1].nonzero().flatten().tolist() == [32]


# ----------------------------------------------------------------------------------------------- matcher moves
def test_first_mask_and_eos_only_where_the_grammar_can_end(compiler):
    constraint = compiler.constraint(grammar=GRAMMAR)
    assert allowed_tokens(constraint.next_mask()) == {'a', 'b', 'ab', 'ba', 'bc'}
    constraint.accept(ids('a', 'bc'))
    assert not constraint.completed
    assert '<eos>' not in allowed_tokens(constraint.next_mask())
    constraint.accept(ids('a'))
    assert constraint.completed
    assert allowed_tokens(constraint.next_mask()) == {'<eos>', 'a', 'b', 'c', 'ab', 'ba', 'ca', 'bc'}
    constraint.accept([EOS])
    assert constraint.terminated and constraint.completed


def test_masks_along_gives_k_plus_1_rows_and_stops_at_the_first_refused_draft(compiler):
    constraint = compiler.constraint(grammar=GRAMMAR)
    constraint.accept(ids('a'))
    masks, allowed = constraint.masks_along(ids('c', 'b', 'cc', 'a'))
    assert masks.shape == (5, len(VOCAB)) and allowed == 2
    assert allowed_tokens(masks[0]) == {'<eos>', 'a', 'b', 'c', 'ab', 'ba', 'ca', 'bc'}
    assert allowed_tokens(masks[1]) == {'a', 'b', 'ab', 'ba', 'bc'}   # after "ac": no EOS, no c
    assert not masks[2, ID['cc']]                                      # verify rejects draft 2 here
    assert torch.equal(masks[3], masks[2]) and torch.equal(masks[4], masks[2])  # unused, still valid
    assert torch.equal(constraint.next_mask()[0], masks[0])            # the matcher did not move


def test_masks_along_stops_after_a_stop_token(compiler):
    constraint = compiler.constraint(grammar=GRAMMAR)
    masks, allowed = constraint.masks_along(ids('a', '<eos>', 'b'))
    assert allowed == 2 and torch.equal(masks[2], masks[1]) and torch.equal(masks[3], masks[1])
    assert not constraint.completed


def test_lookahead_rolls_back_and_ends_at_a_stop_token(compiler):
    constraint = compiler.constraint(grammar=GRAMMAR)
    constraint.accept(ids('b'))
    before = constraint.next_mask()
    with constraint.lookahead() as look:
        assert look.push(ID['ca'])
        assert '<eos>' in allowed_tokens(look.mask())
        assert not look.push(EOS)  # the draft ends here
    assert torch.equal(constraint.next_mask(), before) and not constraint.terminated
    with pytest.raises(AssertionError), constraint.lookahead() as look:
        look.push(ID['cc'])  # a drafter that skipped the mask
    assert torch.equal(constraint.next_mask(), before)


def test_allowed_prefix_len_cuts_an_ngram_proposal(compiler):
    constraint = compiler.constraint(grammar=GRAMMAR)
    constraint.accept(ids('a'))
    assert constraint.allowed_prefix_len(ids('c', 'a', 'c', 'c')) == 3
    assert constraint.allowed_prefix_len(ids('cc')) == 0
    assert constraint.allowed_prefix_len(ids('<eos>', 'a')) == 1
    assert constraint.allowed_prefix_len([]) == 0


def test_accept_refuses_a_token_outside_the_mask(compiler):
    constraint = compiler.constraint(grammar=GRAMMAR)
    with pytest.raises(AssertionError, match='violates the grammar'):
        constraint.accept(ids('c'))


def test_masks_after_rollback_equal_a_fresh_matcher_fed_the_same_prefix(compiler):
    generator = torch.Generator().manual_seed(3)
    constraint = compiler.constraint(grammar=GRAMMAR)
    prefix: list[int] = []
    for _ in range(40):
        draft = torch.randint(0, len(VOCAB), (4,), generator=generator).tolist()
        masks, allowed = constraint.masks_along(draft)
        constraint.allowed_prefix_len(draft)
        for row in range(allowed + 1):
            fresh = compiler.constraint(grammar=GRAMMAR)
            fresh.accept(prefix + draft[:row])
            if not fresh.terminated:
                assert torch.equal(masks[row], fresh.next_mask()[0]), (prefix, draft, row)
        fresh = compiler.constraint(grammar=GRAMMAR)
        fresh.accept(prefix)
        assert torch.equal(constraint.next_mask(), fresh.next_mask())
        step = torch.multinomial(constrained_probs(TARGET[None], masks[:1]), 1, generator=generator).item()
        if step == EOS:
            constraint.reset()
            prefix = []
        else:
            constraint.accept([step])
            prefix.append(step)


# ----------------------------------------------------------------------------------------------- lossless speculation
def constrained_distribution(compiler, length=OUTPUT_LENGTH) -> dict[tuple[int, ...], float]:
    """Exact distribution of the first `length` tokens of masked, renormalised TARGET sampling (EOS ends early)."""
    outcomes: dict[tuple[int, ...], float] = {}

    def walk(prefix: list[int], probability: float) -> None:
        constraint = compiler.constraint(grammar=GRAMMAR)
        constraint.accept(prefix)
        step = constrained_probs(TARGET[None], constraint.next_mask())[0]
        for token in step.nonzero().flatten().tolist():
            outcome, chance = prefix + [token], probability * step[token].item()
            if token == EOS or len(outcome) == length:
                outcomes[tuple(outcome)] = chance
            else:
                walk(outcome, chance)

    walk([], 1.0)
    return outcomes


def draft_round(constraint, proposal: str, k: int, generator) -> tuple[list[int], torch.Tensor | None]:
    """Draft k tokens: 'one-hot' (a fixed proposal, as n-gram), 'sampled' (unmasked DRAFT) or 'masked' (lookahead)."""
    if proposal == 'one-hot':
        return [int(DRAFT.argmax())] * k, None  # "cc": always forbidden
    if proposal == 'sampled':
        return torch.multinomial(DRAFT, k, replacement=True, generator=generator).tolist(), DRAFT.expand(k, -1)
    tokens, rows = [], []
    with constraint.lookahead() as look:
        for _ in range(k):
            draft_probs = constrained_probs(DRAFT[None], look.mask())           # [1, vocab]
            tokens.append(torch.multinomial(draft_probs, 1, generator=generator).item())
            rows.append(draft_probs)
            if not look.push(tokens[-1]):
                break
    while len(tokens) < k:  # after a draft EOS: filler the output never reaches (it is cut at the EOS)
        tokens.append(EOS)
        rows.append(torch.nn.functional.one_hot(torch.tensor([EOS]), len(VOCAB)).float())
    return tokens, torch.cat(rows)


def speculative_outcomes(compiler, proposal: str, k: int = 3, renormalise: bool = True,
                         seed: int = 0) -> Counter:
    """First OUTPUT_LENGTH tokens of TRIALS constrained speculative runs (verify batched over the runs)."""
    generator = torch.Generator().manual_seed(seed)
    constraints = [compiler.constraint(grammar=GRAMMAR) for _ in range(TRIALS)]
    outputs: list[list[int]] = [[] for _ in range(TRIALS)]
    active = list(range(TRIALS))
    while active:
        drafts, draft_rows, mask_rows = [], [], []
        for run in active:
            tokens, draft_probs = draft_round(constraints[run], proposal, k, generator)
            drafts.append(tokens)
            draft_rows.append(draft_probs)
            mask_rows.append(constraints[run].masks_along(tokens)[0])
        masks = torch.stack(mask_rows)                                           # [n, k + 1, vocab]
        target = TARGET.expand(masks.shape)
        target_probs = constrained_probs(target, masks) if renormalise else target * masks
        draft_probs = None if draft_rows[0] is None else torch.stack(draft_rows)  # [n, k, vocab]
        num_accepted, next_token = verify(torch.tensor(drafts), target_probs, draft_probs, greedy=False,
                                          generator=generator)
        still_active = []
        for row, run in enumerate(active):
            new = drafts[row][:num_accepted[row]] + [next_token[row].item()]
            if EOS in new:
                new = new[:new.index(EOS) + 1]
            new = new[:OUTPUT_LENGTH - len(outputs[run])]
            constraints[run].accept(new)  # asserts every emitted token is allowed
            outputs[run] += new
            if len(outputs[run]) < OUTPUT_LENGTH and outputs[run][-1] != EOS:
                still_active.append(run)
        active = still_active
    return Counter(tuple(output) for output in outputs)


@pytest.mark.parametrize('proposal', ['one-hot', 'sampled', 'masked'])
def test_constrained_speculation_follows_the_masked_target_distribution(compiler, proposal):
    expected = constrained_distribution(compiler)
    assert math.isclose(sum(expected.values()), 1.0, rel_tol=1e-5)
    observed = speculative_outcomes(compiler, proposal)
    assert chi_squared_p_value(observed, expected) > 1e-3


def test_chi_squared_detects_a_mask_without_renormalisation(compiler):
    # masking the target without renormalising changes the acceptance rule; the test must catch it
    observed = speculative_outcomes(compiler, 'sampled', renormalise=False)
    assert chi_squared_p_value(observed, constrained_distribution(compiler)) < 1e-6
