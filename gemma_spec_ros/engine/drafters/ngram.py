"""Prompt lookup: propose what followed the latest earlier occurrence of the context's last n tokens."""

import torch

from ..runtime.model import checkpoints
from .base import DraftContext, Drafter, LoadContext, Proposal


class NgramDrafter(Drafter):
    """
    Prompt lookup: find the latest earlier occurrence of the context's last n tokens and propose what followed.

    Example: tokens [5, 6, 7, 9, 5, 6] with n = 2 match (5, 6) at position 0, so k = 2 proposes [7, 9];
    tokens [1, 2, 1, 2] with n = 2 match (1, 2) at position 0 and k = 3 proposes [1, 2, 1] (periodic).
    Longer n-grams are tried first. An incremental index keeps the work per round independent of context length.
    It reads the text: a continuation never copies an image placeholder (placeholders: the target's image, video and
    audio token ids, whose positions hold an encoder's embeddings), so a match just before an image proposes nothing.
    """

    name = 'ngram'

    def __init__(self, ngram_min: int, ngram_max: int, device: torch.device,
                 placeholders: frozenset[int] = frozenset()):
        assert 1 <= ngram_min <= ngram_max, 'config_checks.check_config enforces the n-gram sizes'
        self._sizes = range(ngram_max, ngram_min - 1, -1)
        self._device = device
        self._placeholders = placeholders
        self._continuation: dict[tuple[int, ...], int] = {}  # n-gram -> index of the token that followed it last
        self._indexed = 0

    def join_batch(self, target_rows) -> list:
        return []  # no model: each goal proposes on its own

    def for_batch(self, slot: int) -> 'NgramDrafter':
        return NgramDrafter(self._sizes[-1], self._sizes[0], self._device, self._placeholders)  # an index of its own

    @classmethod
    def load(cls, context: LoadContext) -> 'NgramDrafter':
        return cls(context.config.ngram_min, context.config.ngram_max, context.device,
                   checkpoints.placeholder_ids(context.target))

    def start(self, prompt_ids: list[int]) -> None:
        self._continuation.clear()
        self._indexed = 0

    def propose(self, context: DraftContext, k: int) -> Proposal | None:
        draft = self.lookup(context.tokens, k)
        if draft and context.constraint is not None:  # cut at the first token the grammar refuses
            draft = draft[:context.constraint.allowed_prefix_len(draft)]
        return Proposal(torch.tensor(draft, device=self._device), None) if draft else None

    def has_proposal(self, tokens: list[int]) -> bool:
        return bool(self.lookup(tokens, 1))

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest matching n-gram ([]: none)."""
        self._index_until(tokens, len(tokens))
        for n in self._sizes:
            if len(tokens) <= n:
                continue
            follow = self._continuation.get(tuple(tokens[-n:]))
            if follow is not None:
                return self._continue(tokens, follow, k, self._placeholders)
        return []

    @staticmethod
    def _continue(tokens: list[int], follow: int, k: int, placeholders: frozenset[int]) -> list[int]:
        # copy what followed the match, up to an image placeholder; a match just behind the end repeats the pattern
        # periodically
        draft: list[int] = []
        for index in range(follow, follow + k):
            token = tokens[index] if index < len(tokens) else draft[index - len(tokens)]
            if token in placeholders:
                break
            draft.append(token)
        return draft

    def _index_until(self, tokens: list[int], end: int) -> None:
        # index every n-gram that ends before the last token, pointing at the token that followed it
        for follow in range(max(self._indexed, 1), end):
            for n in self._sizes:
                if follow >= n:
                    self._continuation[tuple(tokens[follow - n:follow])] = follow
        self._indexed = max(self._indexed, end)
