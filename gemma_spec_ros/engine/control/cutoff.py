"""
The confidence cut-off: a round stops drafting at the first draft the drafter gives less probability than it.

It is calibrated per drafter by replaying recent uncut rounds under each candidate cut-off (each round keeps what it
would have drafted under every one, so a replay is a sum) and kept only if it clearly beats the best uncut K. A cut
is priced by what it saves: the drafts not drafted and the shorter verify pass, or only the latter for a drafter
that drafts in calls of several steps (RoundCosts.cut_saves_drafting False: the MTP assistant's greedy rounds on the
fast path). With a cut-off in use, a share of rounds drafts without one, to keep calibrating it.
"""

from collections import deque
from dataclasses import dataclass

from .round_cost import RoundCosts

CUTOFFS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7)  # confidence cut-offs calibrated against drafting all K
CUTOFF_ROUNDS = 64        # recent uncut rounds replayed to calibrate the cut-off
CUTOFF_MIN_ROUNDS = 32    # uncut rounds needed before a cut-off may be chosen
CUTOFF_MIN_GAIN = 0.03    # a cut-off must beat the best uncut K by this much in replay
CUTOFF_EXPLORE_EVERY = 8  # with a cut-off in use, every so many rounds draft uncut to keep calibrating


def drafts_under_cutoff(confidences: list[float], cap: int, cutoff: float) -> int:
    """Drafts a round of at most cap proposes under a confidence cut-off: up to the first one below it, included."""
    low = next((i for i, confidence in enumerate(confidences[:cap]) if confidence < cutoff), cap - 1)
    return min(cap, low + 1)


@dataclass
class UncutRound:
    """An uncut round, kept to replay under each cut-off."""

    num_drafted: int
    num_accepted: int
    drafted_under: tuple[int, ...]  # [len(CUTOFFS)] drafts it would have proposed under each cut-off


class CutoffCalibration:
    """One drafter's cut-off per K, from replays of its recent uncut rounds priced by its round costs."""

    def __init__(self, costs: RoundCosts):
        self._costs = costs
        self.uncut: deque[UncutRound] = deque(maxlen=CUTOFF_ROUNDS)  # rounds drafted without cut-off
        self.cutoff = 0.0                                 # the cut-off of the latest speculative decision
        self._cutoffs: dict[int, tuple[int, float]] = {}  # K -> (round calibrated at, cut-off)

    def record(self, num_drafted: int, num_accepted: int, confidences: list[float]) -> None:
        """Keep an uncut round with the drafter's confidence in each draft ([num_drafted])."""
        self.uncut.append(UncutRound(num_drafted, num_accepted, tuple(
            drafts_under_cutoff(confidences, num_drafted, level) for level in CUTOFFS)))

    def choose(self, k: int, shape: list[float | None], rounds: int) -> float:
        """Return the cut-off for a round of k drafts after rounds drafting rounds (0 = none)."""
        calibrated = self._cutoffs.get(k)  # a replay takes ~1 ms: per K, at most every CUTOFF_EXPLORE_EVERY rounds
        if calibrated is None or rounds - calibrated[0] >= CUTOFF_EXPLORE_EVERY:
            calibrated = self._cutoffs[k] = (rounds, self._calibrate(k, shape))
        self.cutoff = calibrated[1]
        return self.cutoff

    def drafts_uncut(self, rounds: int) -> bool:
        """Tell whether this round drafts without the cut-off in use, to keep calibrating it."""
        return self.cutoff > 0 and rounds % CUTOFF_EXPLORE_EVERY == CUTOFF_EXPLORE_EVERY - 1

    def _calibrate(self, k: int, shape: list[float | None]) -> float:
        """Replay recent uncut rounds of at least k drafts under each cut-off; keep one only if it clearly pays."""
        rounds = [r for r in self.uncut if r.num_drafted >= k]
        if len(rounds) < CUTOFF_MIN_ROUNDS or not self._costs.drafting_measured:
            return 0.0
        costs = [self._costs.round(drafted, shape) or 0.0 for drafted in range(k + 1)]  # [k + 1] by drafts kept
        drafting = self._costs.drafting
        cut_costs = costs if self._costs.cut_saves_drafting else [  # a cut round pays the drafting of all k
            cost + drafting(k) - drafting(drafted) for drafted, cost in enumerate(costs)]

        def replay_rate(drafted: list[int], round_costs: list[float]) -> float:  # drafted: [rounds] drafts kept
            tokens = sum(min(r.num_accepted, d) for r, d in zip(rounds, drafted, strict=True)) + len(rounds)
            return tokens / sum(round_costs[d] for d in drafted)

        # against the best uncut K up to k: a cut-off that only shortens drafts at random is no better than that
        uncut = max(replay_rate([cap] * len(rounds), costs) for cap in range(1, k + 1))
        gain, cutoff = max((replay_rate([min(k, r.drafted_under[index]) for r in rounds], cut_costs) / uncut, cutoff)
                           for index, cutoff in enumerate(CUTOFFS))
        return cutoff if gain > 1 + CUTOFF_MIN_GAIN else 0.0
