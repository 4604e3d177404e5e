"""
Lookahead on one chain: an n-gram pool filled by the target's own predictions, the verify pass as Jacobi window.

Lookahead decoding (Fu et al., 2024) runs a second branch of W guessed tokens beside the verify branch, updates the
guesses by Jacobi iteration (each position's new guess is the target's prediction after the previous guesses), and
keeps the n-grams the iterations form in a pool that later rounds draft from. Here the verify pass is that window:
every position of a pass, the rejected drafts' positions too, gives the target's next-token prediction after an
n-gram of fed tokens, and the pool keeps it. After a pass whose drafts were cut short, the predictions behind the
cut are the next Jacobi guesses for the tokens after the new last token. So no draft model and no pass of its own:
the shapes are the verify pass's (K + 1 rows), and the drafting is a dictionary walk on the host.

Each round drafts by walking the pool: the longest n-gram of the context's tail (ngram_max down to ngram_min tokens)
that the pool knows gives the next token, which extends the tail, up to K tokens. The pool holds the text's own
n-grams (as prompt lookup does) and the target's predictions, the latest winning. Where the walk finds nothing,
the round drafts the Jacobi guesses of the last pass. Drafts are deterministic, so verification keeps the output
the target's (greedy: identical tokens; sampled: its distribution).

    drafter = LookaheadDrafter(1, 3, torch.device('cpu'))
    drafter.start([5, 6, 7, 5, 6]); drafter.propose(context, k=2)   # walks (5, 6) -> 7, (6, 7) -> 5: [7, 5]
"""

import torch

from ..runtime.model import checkpoints
from .base import DraftContext, Drafter, LoadContext, Proposal


class LookaheadDrafter(Drafter):
    """Draft by walking a pool of n-grams from the text and from every position of the target's passes."""

    name = 'lookahead'

    def __init__(self, ngram_min: int, ngram_max: int, device: torch.device,
                 placeholders: frozenset[int] = frozenset()):
        assert 1 <= ngram_min <= ngram_max, 'config_checks.check_config enforces the n-gram sizes'
        self._sizes = range(ngram_max, ngram_min - 1, -1)
        self._device = device
        self._placeholders = placeholders   # image, video and audio ids: never drafted
        self._next: dict[tuple[int, ...], int] = {}   # n-gram -> the latest token seen or predicted after it
        self._indexed = 0                   # the text's tokens whose n-grams are in the pool
        self._fed: tuple[list[int], list[int]] | None = None  # this drafter's open round: the context's tail, drafts
        self._guesses: list[int] = []       # Jacobi guesses for the tokens after the last one

    def join_batch(self, target_rows) -> list:
        return []  # no model: each goal drafts on its own

    def for_batch(self, slot: int) -> 'LookaheadDrafter':
        return LookaheadDrafter(self._sizes[-1], self._sizes[0], self._device, self._placeholders)

    @classmethod
    def load(cls, context: LoadContext) -> 'LookaheadDrafter':
        return cls(context.config.ngram_min, context.config.ngram_max, context.device,
                   checkpoints.placeholder_ids(context.target))

    def start(self, prompt_ids: list[int]) -> None:
        self._next.clear()
        self._indexed = 0
        self._fed, self._guesses = None, []

    def propose(self, context: DraftContext, k: int) -> Proposal | None:
        draft = self.walk(context.tokens, k) or self._guesses[:k]
        if draft and context.constraint is not None:   # cut at the first token the grammar refuses
            draft = draft[:context.constraint.allowed_prefix_len(draft)]
        self._fed = (context.tokens[-self._sizes[0]:], draft) if draft else None
        return Proposal(torch.tensor(draft, device=self._device), None) if draft else None

    def has_proposal(self, tokens: list[int]) -> bool:
        return bool(self.walk(tokens, 1) or self._guesses)

    def observe(self, target_out, num_fed: int, num_kept: int) -> None:
        """Pool the target's prediction at each position of this drafter's own pass; keep the guesses behind the cut."""
        fed, self._fed, self._guesses = self._fed, None, []
        if fed is None or num_fed != len(fed[1]) + 1:   # a pass of no draft of this drafter's
            return
        predicted = target_out.logits[0, -num_fed:].argmax(dim=-1).tolist()
        for row, token in enumerate(predicted):   # row i follows the context's tail and the first i drafts
            tail = fed[0] + fed[1][:row]
            for n in self._sizes:
                if len(tail) >= n:
                    self._next[tuple(tail[-n:])] = token
        self._guesses = [t for t in predicted[num_kept:] if t not in self._placeholders]

    def walk(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens, each the pool's token after the longest known n-gram of the tail so far ([]: none)."""
        self._index_until(tokens)
        tail, draft = list(tokens[-self._sizes[0]:]), []
        while len(draft) < k:
            token = next((self._next[key] for n in self._sizes if len(tail) >= n
                          and (key := tuple(tail[-n:])) in self._next), None)
            if token is None or token in self._placeholders:
                break
            draft.append(token)
            tail = tail[1:] + [token] if len(tail) >= self._sizes[0] else tail + [token]
        return draft

    def _index_until(self, tokens: list[int]) -> None:
        # the text's n-grams that end before its last token, each pointing at the token that followed it
        for follow in range(max(self._indexed, 1), len(tokens)):
            for n in self._sizes:
                if follow >= n:
                    self._next[tuple(tokens[follow - n:follow])] = tokens[follow]
        self._indexed = max(self._indexed, len(tokens))
