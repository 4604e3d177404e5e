"""
The profit gate: speculation runs only while it beats plain decoding; while paused, probe rounds watch for a gain.

The gate judges the policy's long-run rate (both states, weighted by how often each occurs: Rates.gain) against plain
decoding. It pauses when even an optimistic reading of the acceptance (PAUSE_Z standard errors up) loses, and
resumes when probes show a clear gain (RESUME_MARGIN); the band between keeps a steady gain from flipping the gate.
While paused, PROBE_ROUNDS probe rounds run at least every probe_interval plain rounds, sooner when probing costs
little, and the recent acceptance evidence fades with every plain round, so probes soon decide.
"""

import math
from collections.abc import Callable

from ..stats import expected_tokens
from .decision import Decision
from .rates import Rates

PROBE_ROUNDS = 3          # speculative rounds per probe while paused
PROBE_BUDGET = 0.05       # while paused, probes may cost this share of the plain rounds' time (so a cheap drafter
                          # probes often, a dear one every probe_interval rounds)
MIN_PROBE_EVERY = 4       # plain rounds between probes at least
PAUSE_Z = 1.0             # pause only when the acceptance this many standard errors up still loses
MIN_EVIDENCE = 8.0        # recent judged rounds at position 1 needed before the gate may pause
RESUME_MARGIN = 0.03      # resume only when the expected gain over plain decoding exceeds this


class ProfitGate:
    """Pauses a drafter's speculation when it does not pay, probes while paused, resumes on a clear gain."""

    def __init__(self, rates: Rates, enabled: bool, probe_interval: int):
        self._rates = rates
        self.enabled = enabled                  # False: always speculate (engine.profit_gate off)
        self.probe_interval = max(1, probe_interval)
        self.speculating = True
        self._paused_rounds = 0                 # plain rounds since the gate paused or last probed
        self._probe_left = 0                    # probe rounds still to run while paused
        self._probed = False                    # a probe just finished: re-evaluate the gate

    def decide(self, speculate: Callable[[], Decision]) -> Decision:
        """Return a plain or probe round, or speculate()'s choice while speculation pays."""
        rates = self._rates
        if not rates.costs.target_cost.measured(1):
            return Decision(0, self.speculating)  # measure plain decoding once first
        if not self.enabled:
            self.speculating = True
            return speculate()
        if self._probe_left > 0:
            self._probe_left -= 1
            return Decision(rates.best_k(), False, exploring=True)
        if not self.speculating:
            gain = rates.gain() if self._probed else None
            self._probed = False
            if gain is None or gain <= 1 + RESUME_MARGIN:
                self._paused_rounds += 1
                if self._paused_rounds < self.probe_every():
                    return Decision(0, False)
                self._paused_rounds = 0
                self._probe_left = PROBE_ROUNDS - 1
                self._probed = True
                return Decision(rates.best_k(), False, exploring=True)
            self.speculating = True
            return speculate()
        optimistic = rates.gain(PAUSE_Z) if rates.acceptance.evidence >= MIN_EVIDENCE else None
        if optimistic is not None and optimistic < 1.0:
            self.speculating = False
            self._paused_rounds = 0
            return Decision(0, False)
        return speculate()

    def start(self) -> None:
        """Begin a request: its text may differ, so a paused gate probes at once."""
        if not self.speculating and not self._probe_left:
            self._paused_rounds = self.probe_interval - 1

    def probe_every(self) -> int:
        """Plain rounds between probes: as many as keep the probes' expected loss within PROBE_BUDGET."""
        rates = self._rates
        shape = rates.costs.target_cost.relative()
        k = rates.best_k()
        plain, cost = rates.costs.round(0, shape), rates.costs.round(k, shape)
        if plain is None or cost is None:
            return self.probe_interval
        loss = PROBE_ROUNDS * max(0.0, cost - expected_tokens(rates.acceptance.position_alpha(), k) * plain)
        return min(self.probe_interval, max(MIN_PROBE_EVERY, math.ceil(loss / (PROBE_BUDGET * plain))))

    @property
    def probing(self) -> bool:
        """Whether a probe is under way while paused: probe rounds left, or one just ended to be judged."""
        return not self.speculating and bool(self._probe_left or self._probed)

    def may_speculate_next(self) -> bool:
        """Tell whether the next round may draft (False only when decide() will surely run it plain)."""
        if not self.enabled or self.speculating or self._probe_left or self._probed:
            return True
        return not self._rates.costs.target_cost.measured(1) or self._paused_rounds + 1 >= self.probe_every()
