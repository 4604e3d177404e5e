"""
The per-drafter speculation controller: the engine asks it for K before each round and tells it how the round went.

It ties the parts of this package together and holds no estimate of its own: acceptance (estimator), round costs
(round_cost, on the target cost that all drafters share), the best K (rates), the profit gate (gate), exploration
and the confidence cut-off (cutoff). Pure: no torch.
"""

from collections.abc import Callable

from .cutoff import CutoffCalibration
from .decision import Decision
from .estimator import AcceptanceEstimator
from .exploration import Exploration, ExplorationCost
from .gate import ProfitGate
from .rates import Rates
from .round_cost import RoundCosts
from .target_cost import TargetCost


class SpeculationController:
    """Chooses K, the cut-off and whether to speculate for one drafter, from that drafter's rounds."""

    def __init__(self, max_k: int, target_cost: TargetCost, profit_gate: bool, probe_interval: int,
                 cut_saves_drafting: bool = True):
        self.max_k = max_k
        self.target_cost = target_cost
        self.acceptance = AcceptanceEstimator(max_k)
        self.costs = RoundCosts(max_k, target_cost, cut_saves_drafting)
        self.rates = Rates(self.acceptance, self.costs)
        self.gate = ProfitGate(self.rates, profit_gate, probe_interval)
        self.cutoffs = CutoffCalibration(self.costs)
        self._exploration = Exploration(self.rates)
        self._pending: Decision | None = None  # the last decision, to account its exploration cost
        self.rounds_unjudged = 0  # auto goals' rounds since this drafter's drafts were last judged (control.choice)

    # ------------------------------------------------------------------------------------------ reading
    @property
    def speculating(self) -> bool:
        """False while the profit gate pauses speculation."""
        return self.gate.speculating

    @property
    def exploration(self) -> ExplorationCost:
        return self._exploration.cost

    @property
    def alpha(self) -> float:
        """Decayed share of the drafts the target judged that it accepted."""
        return self.acceptance.alpha

    def position_alpha(self, state: int | None = None) -> list[float]:
        """Return the acceptance at each draft position given all earlier ones were accepted ([K]), for a state."""
        return self.acceptance.position_alpha(state)

    @property
    def draft_calls(self) -> Callable[[int], int]:
        """Drafter calls of a round of k drafts in the current request (set by start)."""
        return self.costs.draft_calls

    @property
    def draft_token_seconds(self) -> float | None:
        """Seconds per drafted token at the current load, its share of the fixed part per round included."""
        return self.costs.draft_token_seconds

    @property
    def cutoff(self) -> float:
        """The calibrated confidence cut-off (0 = draft all K)."""
        return self.cutoffs.cutoff

    def best_k(self) -> int:
        """Return the K >= 1 with the highest expected rate in the current state (max_k // 2 before measurements)."""
        return self.rates.best_k()

    def break_even_tau(self, k: int) -> float:
        """Tokens per round a round with k drafts needs to match plain decoding: cost(k) / cost(plain)."""
        return self.costs.break_even_tau(k)

    def expected_rate(self, k: int | None = None, state: int | None = None) -> float | None:
        """
        Return the tokens per load-free second a round promises: k drafts or the best K (None: not measured).

        state: the acceptance state to read (estimator.AFTER_MISS or AFTER_FULL; None: the current one).
        """
        shape, curve = self.target_cost.relative(), self.acceptance.position_alpha(state)
        if k is None:
            return self.rates.best(curve, shape)[1]
        return self.rates.rate(k, shape, curve)

    def may_speculate_next(self) -> bool:
        """Tell whether the next round may draft (False only when decide() will surely run it plain)."""
        return self.gate.may_speculate_next()

    # ------------------------------------------------------------------------------------------ requests and rounds
    def start(self, draft_calls: Callable[[int], int] | None = None, *, pinned_k: bool = False,
              probe_now: bool = True) -> None:
        """
        Note that a request begins (optional).

        draft_calls: how many calls its drafter makes for a round of k drafts (Drafter.draft_calls; None: as
        before). Unless the request pins K, its text may differ from the last one's: the state starts over and a
        paused gate probes at once (unless probe_now is False: an auto goal, where other drafters draft meanwhile,
        probes at the gate's pace). A pinned request is only measured.
        """
        if draft_calls is not None:
            self.costs.set_draft_calls(draft_calls)
        if not pinned_k:
            self.acceptance.start()
            if probe_now:
                self.gate.start()

    def decide(self) -> Decision:
        """K (and cut-off) for the next round, applying the profit gate, probes and bounded exploration."""
        self._pending = self.gate.decide(self._speculate)
        return self._pending

    def _speculate(self) -> Decision:
        """Return the best K (now and then K + 1, to measure the next position) with the calibrated cut-off."""
        shape = self.target_cost.relative()
        curve = self.acceptance.position_alpha()
        k, best = self.rates.best(curve, shape)
        rounds = self.acceptance.rounds
        cutoff = self.cutoffs.choose(k, shape, rounds)
        if self.cutoffs.drafts_uncut(rounds):
            return Decision(k, True, 0.0, exploring=True)
        if self._exploration.tries_longer(k, best, curve, shape):
            return Decision(k + 1, True, cutoff, exploring=True)
        return Decision(k, True, cutoff)

    def record_unrun(self, num_drafted: int, num_accepted: int) -> None:
        """
        Record the acceptance of a round this drafter did not run, judged exactly from the output (auto goals).

        A greedy target's tokens do not depend on the drafts: a draft the drafter can make at no cost (prompt
        lookup) is judged against the tokens another drafter's round emitted. Acceptance only: nothing was timed.
        """
        if num_drafted == 0:
            self.acceptance.record_plain(paused=False)
        else:
            self.acceptance.record(num_drafted, num_accepted)

    def record(self, num_drafted: int, num_accepted: int, draft_seconds: float, *,
               confidences: list[float] | None = None, round_seconds: float | None = None) -> None:
        """
        Record one round: num_accepted of num_drafted drafts kept; drafting took draft_seconds.

        Call it after the round's TargetCost.record, for plain rounds too (num_drafted 0).
        Optional: confidences, the drafter's probability of each draft ([num_drafted]), calibrate the cut-off;
        round_seconds, the round's whole wall time, measures the loop's own per-round work.
        """
        decision, self._pending = self._pending, None
        target_seconds = self.target_cost.last_seconds or 0.0
        self.exploration.total_seconds += draft_seconds + target_seconds
        if round_seconds is not None:
            self.costs.record_overhead(max(0.0, round_seconds - draft_seconds - target_seconds))
        if num_drafted == 0:
            self.acceptance.record_plain(paused=decision is not None and not decision.speculating)
            return
        if decision is not None and decision.exploring:
            self._exploration.count(decision.speculating, num_drafted)
        self.acceptance.record(num_drafted, num_accepted)
        cutoff = decision.min_confidence if decision is not None else 0.0
        self.costs.record_drafting(num_drafted, draft_seconds, cutoff)
        if confidences is not None and cutoff == 0.0 and len(confidences) == num_drafted:
            self.cutoffs.record(num_drafted, num_accepted, confidences)
