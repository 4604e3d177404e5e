"""
What a batched verify pass costs one goal of the batch: the target cost its controller reads (GoalPassCost).

In a batch (engine.max_batch > 1) every goal's row runs in one target pass, padded to the longest row, so a pass
costs by its row bucket and its query length q: one TargetCost per row bucket (calibrated at load, following the
load online). A goal's controller must not read that whole cost as its own, nor the single-goal curve: it sees its
share. The pass over one token per row is split evenly among the goals, and each further position of query length
among the goals whose rows reach it, as a runway's segments are split among the planes that need them. The goals
whose own controllers speculate now (partners) are taken to reach whatever this goal drafts, so goals that all
speculate share every position alike; the others reach what their rows reached last round (a pinned K, a plain
goal's one token). A goal among plain ones pays its longer row alone.

With the controller's own rule on this curve (SpeculationController: the best K, the profit gate), a goal speculates
only where its tokens pay for the time its drafting and its longer row add to everyone's round: a goal whose drafter
does not pay drops to plain rounds (K = 0) while the others go on.
"""

from .target_cost import TargetCost


class GoalPassCost:
    """One goal's share of the batched passes, in TargetCost's terms (relative, load, measured, seconds)."""

    def __init__(self, pass_cost: TargetCost):
        self._pass_cost = pass_cost
        self._relative: list[float | None] = [None] * len(pass_cost.relative())
        self.last_seconds: float | None = None  # the goal's share of the latest pass (the controller's record)

    def share(self, pass_cost: TargetCost, goals: int, partners: int, other_widths: list[int]) -> None:
        """
        Price this round: pass_cost is its row bucket's, goals run in it.

        partners: the other goals whose controllers speculate now; other_widths: the rest's row lengths last round.
        """
        self._pass_cost = pass_cost
        shape = pass_cost.relative()
        if shape[1] is None:  # nothing measured yet
            self._relative = [None] * len(shape)
            return
        relative = [shape[1] / goals] * 2
        for q in range(2, len(shape)):
            sharing = 1 + partners + sum(width >= q for width in other_widths)
            relative.append(relative[-1] + (shape[q] - shape[q - 1]) / sharing)
        self._relative = relative

    def record_pass(self, width: int) -> None:
        """Note the goal's share of the pass just recorded in its bucket's TargetCost (its row width)."""
        self.last_seconds = self.seconds(width)

    @property
    def load(self) -> float:
        return self._pass_cost.load

    def relative(self) -> list[float | None]:
        """Load-free seconds of this goal's share of a pass over q = 0..max tokens of its row."""
        return self._relative

    def seconds(self, num_tokens: int) -> float | None:
        shape = self._relative[num_tokens]
        return None if shape is None else shape * self.load

    def measured(self, num_tokens: int) -> bool:
        """
        Whether the share of num_tokens is known: the bucket's cost was measured at some q.

        In a batch a goal's plain round need not run a pass of q = 1 (the others' rows are longer), so the gate's
        'measure plain decoding once first' cannot wait for one; the bucket's calibration measures every q.
        """
        return self._relative[num_tokens] is not None
