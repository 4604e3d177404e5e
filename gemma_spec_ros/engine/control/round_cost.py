"""
What a round with k drafts costs, in load-free seconds: drafting, the target pass over k + 1 tokens, the loop's work.

Drafting is priced per round, per drafter call and per draft (DraftCost), with the calls each k takes from the
drafter of the current request (Drafter.draft_calls). Every time is divided by the target's load factor when it is
recorded, so drafting and verifying measured under different loads stay comparable.
"""

from collections.abc import Callable

from ..types import one_call_per_draft
from .target_cost import StallFilter, TargetCost

COST_DECAY = 0.98  # per round, weight of older rounds in the drafting fit and the loop's per-round work


class DraftCost:
    """
    Load-free seconds of drafting k tokens in n calls, fitted as fixed + n * per_call + k * step (least squares).

    The fit is decayed over recent rounds. A model drafter pays a fixed part per round (feeding it the tokens the
    last round accepted, the round's set-up) and a price per call (dispatch, a host sync) besides its steps; a cost
    per token alone makes short drafts look cheap and long ones dear. A drafter that runs several steps per call
    (the MTP assistant's greedy rounds: K = 4 is one call, K = 5 two) makes some K dearer than their neighbours,
    which only the per-call part can price. What recent rounds cannot tell apart is not fitted: while the calls
    move with K (one call per draft, or K only 4 and 8) the per-call part joins the others, and while K hardly
    varies the fit goes through zero (a cost per token).
    """

    MIN_K_VARIANCE = 0.25     # variance of K over recent rounds needed to fit the fixed part
    MIN_CALLS_VARIANCE = 0.1  # variance of the calls that K does not explain (around their linear fit on K) needed
                              # to fit the per-call part

    def __init__(self):
        self._sums = [0.0] * 9  # decayed: weight, k, n, seconds, k^2, n^2, k * n, k * seconds, n * seconds
        self.fixed = 0.0
        self.per_call = 0.0
        self.step: float | None = None  # None before the first drafting round

    def record(self, num_drafted: int, num_calls: int, seconds: float) -> None:
        k, n = num_drafted, num_calls
        terms = (1.0, k, n, seconds, k * k, n * n, k * n, k * seconds, n * seconds)
        self._sums = [COST_DECAY * total + term for total, term in zip(self._sums, terms, strict=True)]
        self.fixed, self.per_call, self.step = self._fit()

    def _fit(self) -> tuple[float, float, float]:
        """Return (fixed, per_call, step): the richest model the recent rounds identify with no negative part."""
        weight, k, n, t, k2, n2, kn, kt, nt = self._sums
        k_spread, n_spread = weight * k2 - k * k, weight * n2 - n * n  # weight^2 x variance
        kn_spread, kt_spread, nt_spread = weight * kn - k * n, weight * kt - k * t, weight * nt - n * t
        if k_spread >= self.MIN_K_VARIANCE * weight * weight:
            determinant = k_spread * n_spread - kn_spread * kn_spread
            if determinant >= self.MIN_CALLS_VARIANCE * weight * weight * k_spread:  # calls vary apart from K
                step = (kt_spread * n_spread - nt_spread * kn_spread) / determinant
                per_call = (nt_spread * k_spread - kt_spread * kn_spread) / determinant
                fixed = (t - step * k - per_call * n) / weight
                if step > 0 and per_call >= 0 and fixed >= 0:
                    return fixed, per_call, step
            step = kt_spread / k_spread
            fixed = (t - step * k) / weight
            if step > 0 and fixed >= 0:
                return fixed, 0.0, step
        return 0.0, 0.0, kt / k2

    def seconds(self, num_drafted: int, num_calls: int) -> float:
        if not num_drafted:
            return 0.0
        assert self.step is not None, 'a drafting round is recorded first'
        return self.fixed + num_calls * self.per_call + num_drafted * self.step

    def per_token(self) -> float | None:
        """Load-free seconds per drafted token over recent rounds, the fixed part included (None before drafting)."""
        _, drafted, _, seconds, *_ = self._sums
        return seconds / drafted if drafted > 0 else None


class RoundCosts:
    """One drafter's round costs: its drafting fit and the loop's work per round, with the shared target cost."""

    def __init__(self, max_k: int, target_cost: TargetCost, cut_saves_drafting: bool = True):
        self.max_k = max_k
        self.target_cost = target_cost
        self.cut_saves_drafting = cut_saves_drafting  # False: a cut round costs the drafting of the planned K
        self.draft_cost = DraftCost()                 # load-free seconds of drafting k tokens in n calls
        self.overhead = 0.0                           # load-free seconds per round outside drafting and target pass
        self._draft_calls: Callable[[int], int] = one_call_per_draft
        self._draft_stalls = StallFilter()
        self._overhead_stalls = StallFilter()
        self._drafting_costs: list[float] | None = None  # cached drafting(k) for k = 0..max_k

    @property
    def draft_calls(self) -> Callable[[int], int]:
        """Drafter calls of a round of k drafts, for the current request (Drafter.draft_calls)."""
        return self._draft_calls

    def set_draft_calls(self, calls: Callable[[int], int]) -> None:
        self._draft_calls, self._drafting_costs = calls, None

    @property
    def drafting_measured(self) -> bool:
        return self.draft_cost.step is not None

    def record_overhead(self, seconds: float) -> None:
        """Record a round's seconds outside drafting and the target pass (the loop's own work)."""
        overhead = seconds / self.target_cost.load
        plain = self.target_cost.relative()[1]  # a stall is judged against a round's scale, not the overhead's
        if not self._overhead_stalls.skips(overhead, None if plain is None else self.overhead + plain):
            self.overhead = COST_DECAY * self.overhead + (1 - COST_DECAY) * overhead

    def record_drafting(self, num_drafted: int, seconds: float, min_confidence: float) -> None:
        """Record a drafting round; one cut short (min_confidence) counts only where a cut saves drafting."""
        load = self.target_cost.load
        calls = self._draft_calls(num_drafted)
        estimate = None if self.draft_cost.step is None else self.draft_cost.seconds(num_drafted, calls)
        stalled = self._draft_stalls.skips(seconds / load, estimate)
        if not stalled and (self.cut_saves_drafting or not min_confidence):  # else: seconds of drafts not kept
            self.draft_cost.record(num_drafted, calls, seconds / load)
            self._drafting_costs = None

    def round(self, k: int, shape: list[float | None]) -> float | None:
        """Load-free seconds of a round with k drafts (0: plain) under a target shape (None: not measured)."""
        verify = shape[k + 1]
        if verify is None or (k and self.draft_cost.step is None):
            return None
        return self.drafting(k) + verify + self.overhead

    def drafting(self, k: int) -> float:
        """Load-free seconds of drafting k tokens (0 for a plain round)."""
        return self.drafting_table()[k] if k else 0.0

    def drafting_table(self) -> list[float]:
        """drafting(k) for k = 0..max_k ([max_k + 1]), once drafting was measured; kept until the next one."""
        if self._drafting_costs is None:  # each round reads ~3 x max_k of them
            self._drafting_costs = [self.draft_cost.seconds(k, self._draft_calls(k)) for k in range(self.max_k + 1)]
        return self._drafting_costs

    @property
    def draft_token_seconds(self) -> float | None:
        """Seconds per drafted token at the current load, its share of the fixed part per round included."""
        per_token = self.draft_cost.per_token()
        return None if per_token is None else per_token * self.target_cost.load

    def break_even_tau(self, k: int) -> float:
        """Tokens per round a round with k drafts needs to match plain decoding: cost(k) / cost(plain)."""
        shape = self.target_cost.relative()
        plain, cost = self.round(0, shape), self.round(k, shape)
        if plain is None or cost is None:
            return 1.0
        return cost / plain
