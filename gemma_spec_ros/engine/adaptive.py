"""
Adaptive draft length and profit gate, from online measurements.

Expected tokens per round with K drafts at acceptance alpha (Leviathan et al.): E(K) = (1 - alpha^(K+1)) / (1 - alpha);
with measured per-position acceptance a_i it is 1 + sum_j prod_{i<=j} a_i, which equals that formula when all a_i are
the same. A round costs K drafter steps plus one target pass over K + 1 tokens, both measured; K is chosen to maximize
E(K) / cost(K). When no K >= 1 beats plain decoding (1 token per 1-token target pass), speculation pauses and is
probed again every probe_interval rounds.
"""

import itertools
from dataclasses import dataclass

from .stats import expected_tokens

DECAY = 0.97          # weight of older rounds in the running estimates
PROBE_ROUNDS = 3      # speculative rounds per probe while paused
UNOBSERVED_DECAY = 0.995  # per round, for draft positions the round did not judge
MIN_EVIDENCE = 12.0       # decayed judged drafts needed before the gate may pause speculation
PRIOR_ALPHA = 0.5     # acceptance assumed before anything is measured (weight of ~2 drafted tokens)


class TargetCost:
    """Measured seconds of a target pass as a function of the number of tokens it verifies (1 = plain decoding)."""

    def __init__(self, max_tokens: int):
        self._seconds: list[float | None] = [None] * (max_tokens + 1)  # index = tokens per pass
        self._curve: list[float | None] | None = None                  # cached estimates

    def record(self, num_tokens: int, seconds: float) -> None:
        if num_tokens >= len(self._seconds):
            return
        old = self._seconds[num_tokens]
        self._seconds[num_tokens] = seconds if old is None else DECAY * old + (1 - DECAY) * seconds
        self._curve = None

    def curve(self) -> list[float | None]:
        """Seconds per pass for 0..max tokens: measured, else interpolated, else extrapolated along the last slope."""
        if self._curve is None:
            known = [(n, s) for n, s in enumerate(self._seconds) if s is not None]
            estimates = [self._estimate(known, n) for n in range(len(self._seconds))] if known else []
            # non-decreasing: verifying more tokens never costs less, whatever load noise measured
            self._curve = list(itertools.accumulate(estimates, max)) or [None] * len(self._seconds)
        return self._curve

    @staticmethod
    def _estimate(known: list[tuple[int, float]], num_tokens: int) -> float:
        below = [(n, s) for n, s in known if n <= num_tokens]
        above = [(n, s) for n, s in known if n >= num_tokens]
        if below and above:
            (n0, s0), (n1, s1) = below[-1], above[0]
            return s0 if n0 == n1 else s0 + (s1 - s0) * (num_tokens - n0) / (n1 - n0)
        if len(known) >= 2 and below:
            (n0, s0), (n1, s1) = known[-2], known[-1]
            return s1 + max(0.0, (s1 - s0) / (n1 - n0)) * (num_tokens - n1)
        return (below[-1] if below else above[0])[1]

    def seconds(self, num_tokens: int) -> float | None:
        """Estimated seconds of a pass verifying num_tokens tokens (None before any measurement)."""
        return self.curve()[num_tokens]

    def measured(self, num_tokens: int) -> bool:
        return num_tokens < len(self._seconds) and self._seconds[num_tokens] is not None


@dataclass
class Decision:
    num_draft_tokens: int     # K for the next round; 0 = plain round
    speculating: bool         # False while the profit gate pauses speculation


class AdaptiveK:
    """Per-drafter controller: running acceptance and drafter step cost, shared target cost curve."""

    def __init__(self, max_k: int, target_cost: TargetCost, profit_gate: bool, probe_interval: int):
        self.max_k = max_k
        self.target_cost = target_cost
        self.profit_gate = profit_gate
        self.probe_interval = max(1, probe_interval)
        self._accepted = PRIOR_ALPHA * 2   # decayed accepted drafts
        self._evaluated = 2.0              # decayed drafts the target judged (accepted + first rejected)
        self._kept_at = [0.0] * max_k      # [K] decayed accepts at draft position i
        self._judged_at = [0.0] * max_k    # [K] decayed rounds that judged position i (all before it accepted)
        self._draft_step: float | None = None  # seconds per drafted token
        self.speculating = True
        self._paused_rounds = 0
        self._probe_left = 0              # probe rounds still to run while paused
        self._probed = False              # a probe just finished: re-evaluate the gate

    @property
    def alpha(self) -> float:
        return self._accepted / self._evaluated

    def position_alpha(self) -> list[float]:
        """
        Return the acceptance at each draft position given all earlier ones were accepted ([K]).

        With little data, position 1 leans to alpha and later positions to 1 (optimism, so that longer drafts get
        tried: acceptance after an accepted draft is often higher; a poor position 1 still caps them).
        """
        priors = [self.alpha] + [1.0] * (self.max_k - 1)
        return [(kept + 2 * prior) / (judged + 2)
                for kept, judged, prior in zip(self._kept_at, self._judged_at, priors, strict=True)]

    @property
    def draft_step_seconds(self) -> float | None:
        return self._draft_step

    def record(self, num_drafted: int, num_accepted: int, draft_seconds: float) -> None:
        """One speculative round: num_accepted of num_drafted drafts kept; drafting took draft_seconds."""
        if num_drafted == 0:
            return
        evaluated = num_accepted + (1 if num_accepted < num_drafted else 0)
        self._accepted = DECAY * self._accepted + num_accepted
        self._evaluated = DECAY * self._evaluated + evaluated
        for position in range(self.max_k):
            # judged positions forget with DECAY; unobserved ones (beyond the drafts) only slowly, so that what
            # was learned about them holds K steady, and decays enough to be explored again eventually
            if position < min(evaluated, num_drafted):
                self._judged_at[position] = DECAY * self._judged_at[position] + 1
                self._kept_at[position] = DECAY * self._kept_at[position] + (position < num_accepted)
            else:
                self._judged_at[position] *= UNOBSERVED_DECAY
                self._kept_at[position] *= UNOBSERVED_DECAY
        step = draft_seconds / num_drafted
        self._draft_step = step if self._draft_step is None else DECAY * self._draft_step + (1 - DECAY) * step

    def rate(self, k: int, curve: list[float | None] | None = None) -> float | None:
        """Return expected tokens per second with k drafts (k = 0: plain decoding), or None before measurements."""
        verify = (curve or self.target_cost.curve())[k + 1]
        if verify is None or (k and self._draft_step is None):
            return None
        return expected_tokens(self.position_alpha(), k) / (k * (self._draft_step or 0.0) + verify)

    def best_k(self) -> int:
        """Return the K >= 1 with the highest expected rate (max_k // 2 before measurements)."""
        curve = self.target_cost.curve()
        rates = [(self.rate(k, curve), k) for k in range(1, self.max_k + 1)]
        if any(rate is None for rate, _ in rates):
            return max(1, self.max_k // 2)
        return max(rates)[1]

    def break_even_tau(self, k: int) -> float:
        """Tokens per round a round with k drafts needs to match plain decoding: cost(k) / cost(plain)."""
        curve = self.target_cost.curve()
        plain, verify = curve[1], curve[k + 1]
        if plain is None or verify is None:
            return 1.0
        return (k * (self._draft_step or 0.0) + verify) / plain

    def decide(self) -> Decision:
        """K for the next round, applying the profit gate and periodic probes."""
        if not self.target_cost.measured(1):
            return Decision(0, self.speculating)  # measure plain decoding once first
        if not self.profit_gate:
            return Decision(self.best_k(), True)
        if self._probe_left > 0:
            self._probe_left -= 1
            return Decision(self.best_k(), False)
        if not self.speculating and not self._probed:
            self._paused_rounds += 1
            if self._paused_rounds % self.probe_interval:
                return Decision(0, False)  # paused: no estimates needed
            self._probe_left = PROBE_ROUNDS - 1
            self._probed = True
            return Decision(self.best_k(), False)
        self._probed = False
        k = self.best_k()
        curve = self.target_cost.curve()
        best, plain = self.rate(k, curve), self.rate(0, curve)
        self.speculating = best is None or plain is None or best > plain or self._evaluated < MIN_EVIDENCE
        return Decision(k if self.speculating else 0, self.speculating)

    def may_speculate_next(self) -> bool:
        """Tell whether the next round may draft (False only when decide() will surely run it plain)."""
        if not self.profit_gate or self.speculating or self._probe_left or self._probed:
            return True
        return not self.target_cost.measured(1) or (self._paused_rounds + 1) % self.probe_interval == 0
