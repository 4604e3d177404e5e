"""The drafter interface: start a request, propose up to k tokens, observe each target pass."""

from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from .. import models
from ..grammar import GrammarConstraint, Lookahead, mask_logits
from ..sampling import SamplingParams, logits_to_probs, sample


@dataclass
class DraftContext:
    """What a drafter may read in a round. The last token is emitted but not yet in the target's cache."""

    tokens: list[int]                  # prompt + generated token ids
    last_token: torch.Tensor           # [1] tokens[-1], already on the device
    sampling: SamplingParams
    generator: torch.Generator | None
    min_confidence: float = 0.0        # the draft model stops at a token it gives less probability (0 = never);
                                       # the adaptive controller calibrates it per drafter
    constraint: GrammarConstraint | None = None  # the request's json_schema / grammar; drafts must follow it


@dataclass
class Proposal:
    """Proposed tokens and, for sampled proposals, the distributions they were drawn from."""

    tokens: torch.Tensor              # [k] long, on the target device
    draft_probs: torch.Tensor | None  # [k, vocab] float32; None for deterministic proposals (one-hot)


@dataclass
class LoadContext:
    """What a drafter may use when it is loaded: the engine config and the loaded target."""

    config: object                    # EngineConfig
    target_lm: object                 # the target with its KV cache (causal_lm.FastCausalLM or DynamicCausalLM)
    tokenizer: object
    device: torch.device
    dtype: torch.dtype
    progress: object                  # Callable[[str], None]

    @property
    def target(self):
        """The target model (transformers)."""
        return self.target_lm.model

    @property
    def context_limit(self) -> int:
        """Most tokens of one request (sizes a drafter's own static cache)."""
        return models.context_limit(self.config, self.target)


class Drafter(ABC):
    """One way of proposing draft tokens; registered by name in drafters/__init__.py."""

    name = ''
    needs_target_states = False  # True: target passes must return the last hidden state and shared K/V
    weights_bytes = 0            # the drafter's own model
    kv_cache_bytes = 0           # its preallocated caches

    @classmethod
    def load(cls, context: LoadContext) -> 'Drafter':
        """Build the drafter for a loaded target; ValueError naming the model and path when it does not fit."""
        return cls()

    def start(self, prompt_ids: list[int]) -> None:  # noqa: B027 (optional hook)
        """Begin a request (forget the previous one); called before the target's prefill."""

    @abstractmethod
    def propose(self, context: DraftContext, k: int) -> Proposal | None:
        """Up to k tokens that continue context.tokens, or None for a plain round."""

    def observe(self, target_out, num_fed: int, num_kept: int) -> None:  # noqa: B027 (optional hook)
        """
        Observe a target pass (a fast.StepOutput) after the target's rollback.

        target_out holds the pass's last num_fed positions, and the first num_kept of them stay in the cache
        (prefill: 1 and 1, the last prompt position).
        """

    def warmup(self, progress) -> None:  # noqa: B027 (optional hook)
        """Compile or capture the drafter's steps (after every model is loaded, before the first request)."""


@contextmanager
def grammar_lookahead(context: DraftContext) -> Iterator[Lookahead | None]:
    """Yield the grammar lookahead of one draft round (None when unconstrained); it is rolled back on exit."""
    if context.constraint is None:
        yield None
        return
    with context.constraint.lookahead() as look:
        yield look


def draw(logits: torch.Tensor, context: DraftContext, min_confidence: float = 0.0,
         look: Lookahead | None = None) -> tuple[torch.Tensor, torch.Tensor | None, bool]:
    """
    One draft token from logits [1, vocab]: argmax when greedy (one-hot), else sampled from the processed probs.

    Also tells whether to keep drafting: the drafter's probability of its choice reaches min_confidence (checking
    it costs one host sync per draft token, so it is skipped when min_confidence is 0), and, under a grammar
    (look), the token was not a stop token. A grammar masks the logits first and costs one host sync per token.
    """
    if look is not None:
        logits = mask_logits(logits, look.mask(logits.device))
    if context.sampling.greedy:
        token, draft_probs = logits.argmax(dim=-1), None
        top = torch.softmax(logits.float(), dim=-1).max() if min_confidence else None
    else:
        draft_probs = logits_to_probs(logits, context.sampling)  # [1, vocab]
        token = sample(draft_probs, context.generator)
        top = draft_probs.max() if min_confidence else None
    more = top is None or top.item() >= min_confidence
    if look is not None:
        more = look.push(token.item()) and more
    return token, draft_probs, more


def stack(tokens: list[torch.Tensor], probs: list[torch.Tensor | None]) -> Proposal:
    """One Proposal from per-step tokens [1] and draft probabilities [1, vocab] (or None)."""
    draft_probs = None if probs[0] is None else torch.cat(probs)  # [k, vocab]
    return Proposal(torch.cat(tokens), draft_probs)
