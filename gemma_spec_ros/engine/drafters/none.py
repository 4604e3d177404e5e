"""Plain autoregressive decoding through the same loop: proposes nothing."""

from .base import DraftContext, Drafter, Proposal


class NoneDrafter(Drafter):
    """Every round is a plain target step."""

    name = 'none'

    def join_batch(self, target_rows) -> list:
        return []  # no model: each goal proposes on its own

    def for_batch(self, slot: int) -> 'NoneDrafter':
        return self  # no state

    def propose(self, context: DraftContext, k: int) -> Proposal | None:
        return None
