"""The drafter interface: start a request, propose up to k tokens, observe each target pass."""

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import torch

from ..logits.grammar import GrammarConstraint, Lookahead, mask_logits
from ..logits.sampling import greedy_pick, logits_to_probs, sample
from ..requests import SamplingParams
from ..runtime.model import checkpoints
from ..types import one_call_per_draft


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
    confidences: torch.Tensor | None = None  # [k] the drafter's probability of each draft (model drafters), which
                                             # the adaptive controller calibrates the cut-off against


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
        return checkpoints.context_limit(self.config, self.target)


class Drafter(ABC):
    """One way of proposing draft tokens; registered by name in drafters/__init__.py."""

    name = ''
    needs_target_states = False  # True: target passes must return the last hidden state and shared K/V
    cut_saves_drafting = True    # a confidence cut-off ends drafting at once (False: drafts come from calls of
                                 # several steps, so a cut saves verify work only)
    weights_bytes = 0            # the drafter's own model
    kv_cache_bytes = 0           # its preallocated caches
    rows: 'DraftRows | None' = None  # a goal's drafter in a batch: the steps it shares with the batch's other goals
                                     # (None: it proposes on its own)

    @classmethod
    def load(cls, context: LoadContext) -> 'Drafter':
        """Build the drafter for a loaded target; ValueError naming the model and path when it does not fit."""
        return cls()

    def join_batch(self, target_rows) -> list | None:
        """
        Set up drafting for the goals of a batch (continuous batching), once, over the target's runtime.FastRows.

        Returns the graphs of its batched steps for the warm-up (runtime.GraphJob), or None where this drafter's
        goals are not batched (they then run one at a time).
        """
        return None

    def for_batch(self, slot: int) -> 'Drafter':
        """Return the drafter of the goal in KV-cache slot of a batch: its own state, this one's models (joined)."""
        raise NotImplementedError('{} drafter is not batched'.format(self.name))

    def start(self, prompt_ids: list[int]) -> None:  # noqa: B027 (optional hook)
        """Begin a request (forget the previous one); called before the target's prefill."""

    @property
    def prompt_kv_bytes_per_token(self) -> float:
        """K/V bytes its own model keeps per prompt token (0: none, or none a prefix cache can hold)."""
        return 0.0

    def keep_prefixes(self, prefix_cache) -> None:  # noqa: B027 (optional hook)
        """Prefill its own model's prompts through prefix_cache (a runtime.PrefixCache for that model)."""

    @abstractmethod
    def propose(self, context: DraftContext, k: int) -> Proposal | None:
        """Up to k tokens that continue context.tokens, or None for a plain round."""

    def has_proposal(self, tokens: list[int]) -> bool:
        """Whether a round after tokens may draft anything: cheap, and exact where the drafter can tell (n-gram)."""
        return True

    def draft_calls(self, sampling: SamplingParams, constrained: bool) -> Callable[[int], int]:
        """How many calls a round of k drafts makes in a request sampled so (under a grammar or not): one per draft."""
        return one_call_per_draft

    def observe(self, target_out, num_fed: int, num_kept: int) -> None:  # noqa: B027 (optional hook)
        """
        Observe a target pass (a runtime.StepOutput) after the target's rollback.

        target_out holds the pass's last num_fed positions, and the first num_kept of them stay in the cache
        (prefill: 1 and 1, the last prompt position).
        """

    def warmup(self, progress) -> int:
        """Compile or capture the drafter's steps (after every model is loaded, before the first request); graphs."""
        return 0

    def graph_jobs(self) -> list:
        """Return the drafter's step graphs for a background warm-up (runtime.GraphJob; none unless compiled on CPU)."""
        return []


@dataclass
class RowRequest:
    """One goal's drafting in a batched round: its row (KV-cache slot), its context, its K and its drafter."""

    slot: int
    context: DraftContext
    k: int
    drafter: Drafter


class DraftRows(ABC):
    """Drafting for the goals of a batch that share a drafter's model: each step runs for all their rows at once."""

    @abstractmethod
    def propose_rows(self, requests: list[RowRequest], batch: int) -> list[Proposal | None]:
        """Up to k tokens per request, as Drafter.propose, over rows 0..batch-1 (a request's row is its slot)."""


@contextmanager
def grammar_lookahead(context: DraftContext) -> Iterator[Lookahead | None]:
    """Yield the grammar lookahead of one draft round (None when unconstrained); it is rolled back on exit."""
    if context.constraint is None:
        yield None
        return
    with context.constraint.lookahead() as look:
        yield look


class DraftRound:
    """The drafts of one round, drawn one at a time from a model drafter's logits."""

    def __init__(self, context: DraftContext, min_confidence: float, look: Lookahead | None):
        self._context = context
        self._min_confidence = min_confidence
        self._look = look
        self._tokens: list[torch.Tensor] = []        # [1] each
        self._probs: list[torch.Tensor | None] = []  # [1, vocab] each (sampled proposals)
        self._confidences: list[torch.Tensor] = []   # [1] each

    def draw(self, logits: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """
        Add one draft from logits [1, vocab]: argmax when greedy (one-hot), else sampled from the processed probs.

        Returns the token [1] and whether to keep drafting: the drafter's probability of its choice reaches the
        cut-off (checking it costs one host sync per draft, so it is skipped while the cut-off is 0), and, under a
        grammar, the token was not a stop token. A grammar masks the logits first and costs one host sync per draft.
        """
        context, look = self._context, self._look
        if look is not None:
            logits = mask_logits(logits, look.mask(logits.device))
        if context.sampling.greedy:
            (token, confidence), draft_probs = greedy_pick(logits), None  # [1] each
        else:
            draft_probs = logits_to_probs(logits, context.sampling)  # [1, vocab]
            token = sample(draft_probs, context.generator)
            confidence = draft_probs.gather(-1, token[:, None])[:, 0]
        self._tokens.append(token)
        self._probs.append(draft_probs)
        self._confidences.append(confidence)
        more = not self._min_confidence or confidence.item() >= self._min_confidence
        if look is not None:
            more = look.push(token.item()) and more
        return token, more

    @property
    def count(self) -> int:
        """Drafts drawn so far."""
        return len(self._tokens)

    def proposal(self) -> Proposal:
        """Return the round's drafts as one Proposal."""
        draft_probs = None if self._probs[0] is None else torch.cat(self._probs)  # [k, vocab]
        return Proposal(torch.cat(self._tokens), draft_probs, torch.cat(self._confidences))


class RowDraws:
    """
    The drafts of a batched round (DraftRows), drawn row by row from each step's logits.

    Greedy rows without a grammar take their pick from one argmax over every row (one host sync per step); the
    others draw as a goal on its own does (DraftRound: sampled, under a grammar, at a cut-off).
    """

    def __init__(self, requests: list[RowRequest]):
        """Set up the rows of requests; use it as a context manager: each grammar's lookahead lasts the round."""
        self._requests = {request.slot: request for request in requests}
        self._greedy = {request.slot: [] for request in requests
                        if request.context.sampling.greedy and request.context.constraint is None}
        self._lookaheads = ExitStack()
        self._rounds = {request.slot: DraftRound(request.context, request.context.min_confidence,
                                                 self._lookaheads.enter_context(grammar_lookahead(request.context)))
                        for request in requests if request.slot not in self._greedy}

    def __enter__(self) -> 'RowDraws':
        return self

    def __exit__(self, *exc_info) -> None:
        self._lookaheads.close()  # the grammars roll back what the drafts pushed

    def draw(self, logits: torch.Tensor, slots: list[int]) -> dict[int, tuple[int, bool]]:
        """Draw a draft for each slot from logits [batch, vocab] (row = slot): {slot: (token, draw another)}."""
        picks = logits.argmax(dim=-1).tolist() if any(slot in self._greedy for slot in slots) else None
        drawn = {}
        for slot in slots:
            if slot in self._greedy:
                self._greedy[slot].append(picks[slot])
                token, count, more = picks[slot], len(self._greedy[slot]), True
            else:
                tensor, more = self._rounds[slot].draw(logits[slot:slot + 1])
                token, count = tensor.item(), self._rounds[slot].count
            drawn[slot] = token, more and count < self._requests[slot].k
        return drawn

    def count(self, slot: int) -> int:
        """Drafts drawn so far in slot's row."""
        return len(self._greedy[slot]) if slot in self._greedy else self._rounds[slot].count

    def proposals(self, requests: list[RowRequest], device: torch.device) -> list[Proposal | None]:
        """Return the round's drafts per request (None for a request that drew none)."""
        proposals = {slot: Proposal(torch.tensor(drafts, device=device), None)
                     for slot, drafts in self._greedy.items() if drafts}
        proposals.update((slot, draft_round.proposal()) for slot, draft_round in self._rounds.items()
                         if draft_round.count)
        return [proposals.get(request.slot) for request in requests]
