"""
Bounded, counted exploration: now and then a round drafts K + 1 to measure the next draft position.

Positions beyond the chosen K are judged only when a round drafts them, so without exploration a K chosen on little
evidence would never be revised upward. The expected loss of every exploration and probe round against the choice
it displaced is counted (ExplorationCost), so that what measuring costs is known.
"""

from dataclasses import dataclass

from ..stats import expected_tokens
from .estimator import MAX_RATE
from .rates import Rates

EXPLORE_EVERY = 16        # speculative rounds between explorations of K + 1
EXPLORE_Z = 2.0           # explore K + 1 when its acceptance this many standard errors up would beat the best K
EXPLORE_MAX_LOSS = 0.25   # never explore a K expected to be this much slower than the best


@dataclass
class ExplorationCost:
    """What exploration cost, in rounds and in expected seconds lost against the best known choice."""

    explore_rounds: int = 0       # rounds drafting K + 1 or uncut, to measure what is not measured
    probe_rounds: int = 0         # speculative rounds while paused
    lost_seconds: float = 0.0     # expected extra seconds of those rounds for the same tokens
    total_seconds: float = 0.0    # measured seconds of all recorded rounds (drafting + target pass)

    @property
    def share(self) -> float:
        return self.lost_seconds / self.total_seconds if self.total_seconds > 0 else 0.0


class Exploration:
    """Chooses the rounds that draft K + 1 and counts what exploring and probing cost."""

    def __init__(self, rates: Rates):
        self._rates = rates
        self.cost = ExplorationCost()

    def tries_longer(self, k: int, best: float | None, curve: list[float], shape: list[float | None]) -> bool:
        """Tell whether this round drafts k + 1 instead of the best k (whose expected rate is best)."""
        rates, acceptance = self._rates, self._rates.acceptance
        if best is None or k >= rates.max_k or acceptance.rounds % EXPLORE_EVERY != EXPLORE_EVERY - 1:
            return False
        # upper confidence bound on the next position: rarely judged positions get tried, measured ones not
        error = acceptance.recent[acceptance.state].error(k, curve[k])
        hopeful = curve[:k] + [min(MAX_RATE, curve[k] + EXPLORE_Z * error)] + curve[k + 1:]
        longer, optimistic = rates.rate(k + 1, shape, curve), rates.rate(k + 1, shape, hopeful)
        return longer is not None and optimistic > best and longer >= (1 - EXPLORE_MAX_LOSS) * best

    def count(self, speculating: bool, num_drafted: int) -> None:
        """Add the expected extra seconds of an exploration (speculating) or probe round against what it displaced."""
        rates = self._rates
        shape = rates.costs.target_cost.relative()
        curve = rates.acceptance.position_alpha()
        cost = rates.costs.round(num_drafted, shape)
        if speculating:
            self.cost.explore_rounds += 1
            reference = rates.best(curve, shape)[1]
        else:
            self.cost.probe_rounds += 1
            reference = rates.rate(0, shape, curve)
        if cost is None or reference is None:
            return
        lost = cost - expected_tokens(curve, num_drafted) / reference
        self.cost.lost_seconds += max(0.0, lost) * rates.costs.target_cost.load
