"""
Acceptance per draft position, per state, from the rounds' accepted counts; a CUSUM test tells when it changed.

a_i is the acceptance of draft i given that drafts 1..i-1 were accepted. Acceptance is not i.i.d.: it comes in runs
(a loop, a copied span), so the a_i are kept separately for rounds that follow a fully accepted round (of at least
FULL_MIN_DRAFTS drafts) and rounds that follow a miss, and K is chosen for the state the next round starts in. Each
state's recent counts shrink toward its long-run counts, which shrink toward the counts of all rounds (pooled).

The evidence of positions beyond the drafted K fades faster than that of drafted ones in the recent and per-state
counts: it was measured on older text, and held at full weight it keeps K low on a later text that accepts far
more. A position without recent evidence falls back to the pooled estimate.

A two-sided CUSUM test on the accepted counts notices when the text changes character (code to prose) and rebuilds
the recent counts from the rounds since the change, so the profit gate reacts within a few rounds. It judges a round
against the current estimates, except in the first HISTORY rounds of a new text: those are judged against the
estimates the text began with. Estimates that move with each round shrink the deviations of a lasting change, and a
text unlike the last ones (one that accepts nothing after one that accepted most) carried the old estimates for
dozens of rounds without an alarm: a cheap drafter kept drafting K = 8 into misses.
"""

import math
from collections import deque

DECAY = 0.98              # per round, weight of older rounds in the recent acceptance
LONG_DECAY = 0.995        # per round, the long-run acceptance that recent estimates shrink toward (and fall back
                          # to at positions not judged lately)
UNDRAFTED_DECAY = 0.8     # per round, extra weight left to the recent and per-state evidence of the positions the
                          # round did not draft
PRIOR_ALPHA = 0.5         # acceptance assumed before anything is measured
PRIOR_WEIGHT = 2.0        # rounds' worth of weight of the prior of each position
AFTER_MISS, AFTER_FULL = 0, 1  # acceptance states: the previous round had a rejected draft (or was plain) / had none
FULL_MIN_DRAFTS = 2       # a fully accepted round starts AFTER_FULL only when it drafted this many: one accepted
                          # draft says little about a run (K = 1 rounds in a text that alternates hits and misses
                          # would otherwise send long drafts into misses)
MAX_RATE = 0.999          # acceptance readings are capped below 1 (a run never lasts forever)
CUSUM_SLACK = 0.5         # CUSUM drift allowance, in standard deviations of a round's accepted count
CUSUM_ALARM = 6.0         # CUSUM alarm level: the acceptance changed
CUSUM_MIN_STD = 0.5       # floor of a round's standard deviation (keeps rare misses of a good drafter quiet)
CHANGE_KEEP = 0.1         # on a change, the weight left to the long-run counts (so stale priors give way)
HISTORY = 16              # recent rounds kept to rebuild the estimates after a change


class PositionCounts:
    """
    Decayed per-position counts: judged[i] rounds reached draft i+1 (all earlier accepted), kept[i] accepted it.

    A round that did not draft position i+1 fades its counts by undrafted_decay besides the decay.
    """

    def __init__(self, max_k: int, decay: float, undrafted_decay: float = 1.0):
        self.decay = decay
        self.undrafted_decay = undrafted_decay
        self.judged = [0.0] * max_k  # [K]
        self.kept = [0.0] * max_k    # [K]

    def add(self, num_drafted: int, num_accepted: int) -> None:
        reached = min(num_drafted, num_accepted + 1)
        for position in range(len(self.judged)):
            decay = self.decay if position < num_drafted else self.decay * self.undrafted_decay
            self.judged[position] = decay * self.judged[position] + (position < reached)
            self.kept[position] = decay * self.kept[position] + (position < num_accepted)

    def fade(self, factor: float | None = None) -> None:
        """Age the counts by one round that judged nothing here (or scale them by factor)."""
        factor = self.decay if factor is None else factor
        self.judged = [factor * judged for judged in self.judged]
        self.kept = [factor * kept for kept in self.kept]

    def rates(self, priors: list[float] | None = None) -> list[float]:
        """Return the acceptance per position, shrunk toward priors (default: the previous position's rate)."""
        rates, rate = [], PRIOR_ALPHA
        for position, kept in enumerate(self.kept):
            prior = priors[position] if priors else rate
            rate = (kept + PRIOR_WEIGHT * prior) / (self.judged[position] + PRIOR_WEIGHT)
            rates.append(rate)
        return rates

    def error(self, position: int, rate: float) -> float:
        """Return the standard error of a position's rate, from its evidence."""
        return math.sqrt(rate * (1 - rate) / (self.judged[position] + PRIOR_WEIGHT))


class ChangeDetector:
    """Two-sided CUSUM on rounds' deviations (accepted count against its estimate, in standard deviations)."""

    def __init__(self):
        self._up = self._down = 0.0
        self._since_up = self._since_down = 0  # rounds since each side last stood at zero

    def alarm(self, deviation: float) -> int | None:
        """Add a round; on alarm return how many rounds ago the change began (counting this one), else None."""
        self._up = max(0.0, self._up + deviation - CUSUM_SLACK)
        self._down = max(0.0, self._down - deviation - CUSUM_SLACK)
        self._since_up = self._since_up + 1 if self._up else 0
        self._since_down = self._since_down + 1 if self._down else 0
        if max(self._up, self._down) < CUSUM_ALARM:
            return None
        since = self._since_up if self._up >= CUSUM_ALARM else self._since_down
        self._up = self._down = 0.0
        self._since_up = self._since_down = 0
        return since


class AcceptanceEstimator:
    """Acceptance per position for each state (AFTER_MISS, AFTER_FULL), recent and long-run, and the current state."""

    def __init__(self, max_k: int):
        self.max_k = max_k
        self.pooled = PositionCounts(max_k, LONG_DECAY)  # all rounds: prior of the states
        self.long = [PositionCounts(max_k, LONG_DECAY, UNDRAFTED_DECAY) for _ in range(2)]  # [AFTER_MISS, AFTER_FULL]
        self.recent = [PositionCounts(max_k, DECAY, UNDRAFTED_DECAY) for _ in range(2)]
        self.state = AFTER_MISS                      # the state the next round starts in
        self.rounds = 0                              # drafting rounds recorded
        self._accepted = PRIOR_ALPHA * PRIOR_WEIGHT  # decayed accepted drafts
        self._evaluated = PRIOR_WEIGHT               # decayed drafts the target judged (accepted + first rejected)
        self._history: deque[tuple[int, int, int]] = deque(maxlen=HISTORY)  # (state, drafted, accepted)
        self._change = ChangeDetector()
        self._curves: list[list[float] | None] = [None, None]  # cached position_alpha per state
        self._prior_curves: list[list[float]] | None = None     # the estimates a new text began with (change test)
        self._prior_until = 0                                   # self.rounds up to which the test judges against them
        self._pooled_rates: list[float] | None = None          # cached pooled rates, the states' common prior

    @property
    def alpha(self) -> float:
        return self._accepted / self._evaluated

    @property
    def evidence(self) -> float:
        """Recent rounds that judged the first draft position, both states."""
        return sum(counts.judged[0] for counts in self.recent)

    def position_alpha(self, state: int | None = None) -> list[float]:
        """Return the acceptance at each draft position given all earlier ones were accepted ([K]), for a state."""
        state = self.state if state is None else state
        if self._curves[state] is None:
            if self._pooled_rates is None:
                self._pooled_rates = self.pooled.rates()
            self._curves[state] = self.recent[state].rates(self.long[state].rates(self._pooled_rates))
        return self._curves[state]

    def _forget_curves(self) -> None:
        """Drop the cached acceptance curves (the counts changed)."""
        self._curves, self._pooled_rates = [None, None], None

    def start(self) -> None:
        """Begin a new text: it starts AFTER_MISS; its first HISTORY rounds are judged against the estimates now."""
        self.state = AFTER_MISS
        self._forget_curves()
        if self.rounds:
            self._prior_curves = [self.position_alpha(AFTER_MISS), self.position_alpha(AFTER_FULL)]
            self._prior_until = self.rounds + HISTORY
            self._change = ChangeDetector()   # sums over the last text's rounds would date a change into it

    def record_plain(self, paused: bool) -> None:
        """Record a plain round; while the gate pauses, old evidence fades with each, so that probes soon decide."""
        if paused:
            for counts in self.recent:
                counts.fade()
        self.state = AFTER_MISS
        self._forget_curves()

    def record(self, num_drafted: int, num_accepted: int) -> None:
        """Record a round in which num_accepted of num_drafted (>= 1) drafts were kept."""
        self._detect_change(num_drafted, num_accepted)
        self.rounds += 1
        self._history.append((self.state, num_drafted, num_accepted))
        self._add(self.state, num_drafted, num_accepted)
        self.long[self.state].add(num_drafted, num_accepted)
        self.long[1 - self.state].fade()
        self.pooled.add(num_drafted, num_accepted)
        self._forget_curves()
        self.state = AFTER_FULL if num_accepted == num_drafted >= FULL_MIN_DRAFTS else AFTER_MISS
        self._accepted = DECAY * self._accepted + num_accepted
        self._evaluated = DECAY * self._evaluated + min(num_drafted, num_accepted + 1)

    def _add(self, state: int, num_drafted: int, num_accepted: int) -> None:
        self.recent[state].add(num_drafted, num_accepted)
        self.recent[1 - state].fade()

    def _detect_change(self, num_drafted: int, num_accepted: int) -> None:
        """Test the accepted count against the current estimates; on a change, rebuild from the rounds since."""
        judged_against = self.position_alpha()
        if self._prior_curves is not None and self.rounds < self._prior_until:
            judged_against = self._prior_curves[self.state]
        survive, mean, second = 1.0, 0.0, 0.0
        for j, rate in enumerate(judged_against[:num_drafted], start=1):
            survive *= rate        # P(accepted >= j)
            mean += survive
            second += (2 * j - 1) * survive
        deviation = (num_accepted - mean) / max(CUSUM_MIN_STD, math.sqrt(max(0.0, second - mean * mean)))
        since = self._change.alarm(deviation)
        if since is None:
            return
        changed = list(self._history)[len(self._history) - min(since - 1, len(self._history)):]
        self.recent = [PositionCounts(self.max_k, DECAY, UNDRAFTED_DECAY) for _ in range(2)]
        for state, drafted, accepted in changed:
            self._add(state, drafted, accepted)
        for counts in (self.pooled, *self.long):
            counts.fade(CHANGE_KEEP)
        self._prior_curves = None
