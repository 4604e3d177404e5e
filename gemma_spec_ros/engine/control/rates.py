"""
What a round of K drafts earns: expected tokens per load-free second, the best K, the policy's gain over plain.

A round with K drafts emits E(K) = 1 + sum_{j<=K} a_1 * ... * a_j tokens (stats.expected_tokens), where a_i is the
measured acceptance of draft i given that drafts 1..i-1 were accepted, and costs RoundCosts.round(K): K drafter
steps in their calls, one target pass over K + 1 tokens and the loop's own work. K maximizes E(K) / cost(K).
"""

from ..stats import expected_tokens
from .estimator import AFTER_FULL, AFTER_MISS, FULL_MIN_DRAFTS, MAX_RATE, AcceptanceEstimator
from .round_cost import RoundCosts


class Rates:
    """Tokens per load-free second of each K, from one drafter's acceptance estimates and round costs."""

    def __init__(self, acceptance: AcceptanceEstimator, costs: RoundCosts):
        self.acceptance = acceptance
        self.costs = costs
        self.max_k = costs.max_k

    def rate(self, k: int, shape: list[float | None] | None = None, rates: list[float] | None = None) -> float | None:
        """Return expected tokens per load-free second with k drafts (k = 0: plain), or None before measurements."""
        cost = self.costs.round(k, shape or self.costs.target_cost.relative())
        if cost is None:
            return None
        return expected_tokens(rates if rates is not None else self.acceptance.position_alpha(), k) / cost

    def choices(self, rates: list[float], shape: list[float | None]) -> list[tuple] | None:
        """Return (rate, K, expected tokens, chance all K are accepted, cost) for K = 1..max_k (None: unmeasured)."""
        if not self.costs.drafting_measured or shape[1] is None:
            return None
        choices, tokens, survive, drafting = [], 1.0, 1.0, self.costs.drafting_table()
        overhead = self.costs.overhead
        for k in range(1, self.max_k + 1):
            survive *= rates[k - 1]
            tokens += survive
            cost = drafting[k] + shape[k + 1] + overhead
            choices.append((tokens / cost, k, tokens, survive, cost))
        return choices

    def best_choice(self, rates: list[float], shape: list[float | None]) -> tuple | None:
        """
        Return max(choices(rates, shape)) without building them all (None: unmeasured).

        Every round asks for it (an auto goal for each of its drafters); ties go to the longer K, as max() does.
        """
        if not self.costs.drafting_measured or shape[1] is None:
            return None
        best, tokens, survive = None, 1.0, 1.0
        drafting, overhead = self.costs.drafting_table(), self.costs.overhead
        for k in range(1, self.max_k + 1):
            survive *= rates[k - 1]
            tokens += survive
            cost = drafting[k] + shape[k + 1] + overhead
            if best is None or tokens / cost >= best[0]:
                best = (tokens / cost, k, tokens, survive, cost)
        return best

    def best(self, rates: list[float], shape: list[float | None]) -> tuple[int, float | None]:
        """Return the K >= 1 with the highest expected rate and that rate (max_k // 2, None before measurements)."""
        choice = self.best_choice(rates, shape)
        if choice is None:
            return max(1, self.max_k // 2), None
        return choice[1], choice[0]

    def best_k(self) -> int:
        """Return the K >= 1 with the highest expected rate in the current state (max_k // 2 before measurements)."""
        return self.best(self.acceptance.position_alpha(), self.costs.target_cost.relative())[0]

    def policy_rate(self, curves: list[list[float]], shape: list[float | None]) -> float | None:
        """Long-run tokens per load-free second of the best K in each state, the states weighted as they occur."""
        best = [self.best_choice(curve, shape) for curve in curves]
        if any(choice is None for choice in best):
            return None
        # per state: the best K's tokens, chance that the next round starts AFTER_FULL, cost
        _, ks, tokens, survive, costs = zip(*best, strict=True)
        full = [all_kept if k >= FULL_MIN_DRAFTS else 0.0 for k, all_kept in zip(ks, survive, strict=True)]
        share_full = full[AFTER_MISS] / (1 - full[AFTER_FULL] + full[AFTER_MISS])  # stationary two-state chain
        weights = (1 - share_full, share_full)
        return sum(w * t for w, t in zip(weights, tokens, strict=True)) / sum(
            w * c for w, c in zip(weights, costs, strict=True))

    def gain(self, z: float = 0.0) -> float | None:
        """
        Return the long-run speedup over plain decoding (None before measurements).

        z reads the first draft position's acceptance z standard errors up (down when negative): every round judges
        it, and it caps all later positions (whose sparse evidence would otherwise make the reading useless).
        """
        shape = self.costs.target_cost.relative()
        plain = self.rate(0, shape)
        curves = []
        for state in (AFTER_MISS, AFTER_FULL):
            curve = self.acceptance.position_alpha(state)
            error = self.acceptance.recent[state].error(0, curve[0])
            curves.append([min(MAX_RATE, max(0.0, curve[0] + z * error))] + curve[1:])
        rate = self.policy_rate(curves, shape)
        return None if plain is None or rate is None else rate / plain
