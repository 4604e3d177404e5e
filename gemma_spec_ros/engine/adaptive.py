"""
Adaptive draft length, confidence cut-off and profit gate, from online measurements (pure: no torch).

A round with K drafts emits E(K) = 1 + sum_{j<=K} a_1 * ... * a_j tokens, where a_i is the MEASURED acceptance of
draft i given that drafts 1..i-1 were accepted. Acceptance is not i.i.d.: it comes in runs (a loop, a copied span),
so the a_i are kept separately for rounds that follow a fully accepted round (of at least FULL_MIN_DRAFTS drafts)
and rounds that follow a miss, and K is chosen for the state the next round starts in. A round costs K drafter
steps, one target pass over K + 1 tokens and (when the loop measures it) the loop's own per-round work. K
maximizes E(K) / cost(K).

Costs are kept in load-free units: the target cost curve is a shape times a load factor that follows the latest
pass, so that plain decoding measured under one load is never compared with verify passes measured under another
(on a shared machine that made the gate flip). The engine starts the shape from passes of every size it times when
it loads (TargetCost.calibrate): learned only from the rare pairs a run makes, it priced long drafts too dear. A
stall, a pass or drafting round many times its estimate (a compile on first use, the process descheduled), is left
out of the costs: one 36 s pass otherwise priced its K out for the rest of the run.

The profit gate judges the policy's long-run rate (both states, weighted by how often each occurs) against plain
decoding. It pauses when even an optimistic reading of the acceptance (one standard error up) loses, and resumes
when probes show a clear gain; the band between keeps a steady gain from flipping the gate. A CUSUM test on the
accepted counts notices when the text changes character (code to prose) and rebuilds the recent estimates from the
rounds since the change, so the gate reacts within a few rounds. While paused, old evidence fades with every plain
round, so probes soon decide. In the recent and the per-state long-run estimates, the evidence of positions beyond
the drafted K fades faster than that of drafted ones. It was measured on older text, and left as it was it kept K
low on a later text that accepts far more; an undrafted position's estimate now falls back to the pooled one.

Exploration is bounded and counted: now and then one round drafts K + 1 to measure the next position, while
paused a few probe rounds run at least every probe_interval rounds (sooner when probing costs little), and with
drafter confidences a share of rounds drafts without cut-off to keep calibrating it. A cut-off is priced by what a
cut saves: the drafts not drafted and the shorter verify pass, or only the latter for a drafter that drafts in calls
of several steps (cut_saves_drafting False: the MTP assistant's greedy rounds on the fast path). Drafting is
priced per round, per drafter call and per draft (DraftCost), with the calls each K takes from the drafter of the
current request (draft_calls).
"""

import itertools
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from .stats import expected_tokens

DECAY = 0.98              # per round, weight of older rounds in the recent acceptance and draft-cost estimates
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
LOAD_DECAY = 0.7          # per target pass, weight of the older load factor (load moves fast)
SHAPE_DECAY = 0.95        # per pair of adjacent passes of different sizes, weight of the older cost shape (timing
                          # noise on a shared CPU swings single passes by tens of percent)
STALL_FACTOR = 8.0        # a pass or a drafting round this many times its estimate is a stall (a compile on first
                          # use, the process descheduled): left out of the costs, unless the next is one too (then
                          # the load changed)
PROBE_ROUNDS = 3          # speculative rounds per probe while paused
PROBE_BUDGET = 0.05       # while paused, probes may cost this share of the plain rounds' time (so a cheap drafter
                          # probes often, a dear one every probe_interval rounds)
MIN_PROBE_EVERY = 4       # plain rounds between probes at least
PAUSE_Z = 1.0             # pause only when the acceptance this many standard errors up still loses
MIN_EVIDENCE = 8.0        # recent judged rounds at position 1 needed before the gate may pause
RESUME_MARGIN = 0.03      # resume only when the expected gain over plain decoding exceeds this
CUSUM_SLACK = 0.5         # CUSUM drift allowance, in standard deviations of a round's accepted count
CUSUM_ALARM = 6.0         # CUSUM alarm level: the acceptance changed
CHANGE_KEEP = 0.1         # on a change, the weight left to the long-run counts (so stale priors give way)
CUSUM_MIN_STD = 0.5       # floor of a round's standard deviation (keeps rare misses of a good drafter quiet)
HISTORY = 16              # recent rounds kept to rebuild the estimates after a change
MAX_RATE = 0.999          # acceptance readings are capped below 1 (a run never lasts forever)
EXPLORE_EVERY = 16        # speculative rounds between explorations of K + 1
EXPLORE_Z = 2.0           # explore K + 1 when its acceptance this many standard errors up would beat the best K
EXPLORE_MAX_LOSS = 0.25   # never explore a K expected to be this much slower than the best
CUTOFFS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7)  # confidence cut-offs calibrated against drafting all K
CUTOFF_ROUNDS = 64        # recent uncut rounds replayed to calibrate the cut-off
CUTOFF_MIN_ROUNDS = 32    # uncut rounds needed before a cut-off may be chosen
CUTOFF_MIN_GAIN = 0.03    # a cut-off must beat the best uncut K by this much in replay
CUTOFF_EXPLORE_EVERY = 8  # with a cut-off in use, every so many rounds draft uncut to keep calibrating


class TargetCost:
    """
    Measured seconds of a target pass as a function of the number of tokens it verifies (1 = plain decoding).

    Kept as shape(n) * load. The shape of a size is learned only against the pass just before it (of another
    size, so under the same load); the load factor follows every pass. A first pass of a new size sets its shape
    at the current load; the second sets it again where the first was a stall against it (the first pass of a run
    may compile, with no estimate yet to tell). Later stalls (StallFilter) are left out.
    """

    def __init__(self, max_tokens: int):
        self._shape: list[float | None] = [None] * (max_tokens + 1)  # index = tokens per pass; seconds at load 1
        self._passes = [0] * (max_tokens + 1)                       # recorded passes per size
        self._load = 1.0
        self._relative: list[float | None] | None = None            # cached shape estimates for every size
        self._previous: tuple[int, float] | None = None            # (tokens, seconds) of the latest pass
        self._stalls = StallFilter()
        self.last_seconds: float | None = None                     # the latest recorded pass

    def record(self, num_tokens: int, seconds: float) -> None:
        if num_tokens >= len(self._shape) or seconds <= 0:
            return
        self.last_seconds = seconds
        if self._stalls.skips(seconds, self.seconds(num_tokens)):
            return
        self._passes[num_tokens] += 1
        known = self._shape[num_tokens]
        if known is None or (self._passes[num_tokens] == 2 and known > STALL_FACTOR * seconds / self._load):
            self._shape[num_tokens] = seconds / self._load  # first of its size, or the first was a stall
        else:
            if self._previous is not None and self._previous[0] != num_tokens:
                before, before_seconds = self._previous
                before_shape = self._shape[before]
                assert before_shape is not None  # every recorded size has a shape
                paired = before_shape * seconds / before_seconds
                self._shape[num_tokens] = known * (paired / known) ** (1 - SHAPE_DECAY)
            self._load = LOAD_DECAY * self._load + (1 - LOAD_DECAY) * seconds / self._shape[num_tokens]
        self._previous = (num_tokens, seconds)
        self._relative = None

    def calibrate(self, seconds_by_size: dict[int, float]) -> None:
        """Set the shape of each size from passes timed apart from requests, all under one load (before any request)."""
        for num_tokens, seconds in seconds_by_size.items():
            if num_tokens < len(self._shape) and seconds > 0:
                self._shape[num_tokens] = seconds / self._load
                self._passes[num_tokens] = max(self._passes[num_tokens], 2)  # established: not replaced as a stall
        self._relative = None

    @property
    def load(self) -> float:
        """Seconds now per load-free second (1.0 at the first measurement)."""
        return self._load

    def relative(self) -> list[float | None]:
        """Load-free seconds per pass for 0..max tokens: measured, else interpolated, else extrapolated."""
        if self._relative is None:
            estimates = _fill(self._shape) if any(s is not None for s in self._shape) else []
            # non-decreasing: verifying more tokens never costs less, whatever load noise measured
            self._relative = list(itertools.accumulate(estimates, max)) or [None] * len(self._shape)
        return self._relative

    def curve(self) -> list[float | None]:
        """Seconds per pass now for 0..max tokens (None before any measurement)."""
        return [None if s is None else s * self._load for s in self.relative()]

    def seconds(self, num_tokens: int) -> float | None:
        """Estimated seconds of a pass verifying num_tokens tokens now (None before any measurement)."""
        shape = self.relative()[num_tokens]
        return None if shape is None else shape * self._load

    def measured(self, num_tokens: int) -> bool:
        return num_tokens < len(self._shape) and self._shape[num_tokens] is not None


class StallFilter:
    """Tells a stall from a measurement: a time over STALL_FACTOR x its estimate, unless the one before was one too."""

    def __init__(self):
        self._stalled = False

    def skips(self, seconds: float, estimate: float | None) -> bool:
        stall = estimate is not None and seconds > STALL_FACTOR * estimate and not self._stalled
        self._stalled = stall
        return stall


def _fill(shape: list[float | None]) -> list[float]:
    """Every size's shape: measured, else interpolated between neighbours, else extrapolated (last slope, or flat)."""
    if None not in shape[1:]:  # every size timed (the engine calibrates them all): at most size 0 to fill
        return [shape[1] if shape[0] is None else shape[0], *shape[1:]]
    known = [(n, s) for n, s in enumerate(shape) if s is not None]
    filled, above = [], 0  # known[above] is the first measured size >= n
    for n in range(len(shape)):
        while above < len(known) and known[above][0] < n:
            above += 1
        if above < len(known) and (known[above][0] == n or above == 0):
            filled.append(known[above][1])
        elif above < len(known):
            (n0, s0), (n1, s1) = known[above - 1], known[above]
            filled.append(s0 + (s1 - s0) * (n - n0) / (n1 - n0))
        elif len(known) >= 2:
            (n0, s0), (n1, s1) = known[-2], known[-1]
            filled.append(s1 + max(0.0, (s1 - s0) / (n1 - n0)) * (n - n1))
        else:
            filled.append(known[-1][1])
    return filled


def one_call_per_draft(num_drafts: int) -> int:
    """Drafter calls of a round of num_drafts drafts for a drafter that runs one step per call."""
    return num_drafts


def drafts_under_cutoff(confidences: list[float], cap: int, cutoff: float) -> int:
    """Drafts a round of at most cap proposes under a confidence cut-off: up to the first one below it, included."""
    low = next((i for i, confidence in enumerate(confidences[:cap]) if confidence < cutoff), cap - 1)
    return min(cap, low + 1)


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
        self._sums = [DECAY * total + term for total, term in zip(self._sums, terms, strict=True)]
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


@dataclass
class Decision:
    num_draft_tokens: int        # K for the next round; 0 = plain round
    speculating: bool            # False while the profit gate pauses speculation
    min_confidence: float = 0.0  # the drafter ends the round at a draft it gives less probability (0 = never)
    exploring: bool = False      # an exploration or probe round (its expected loss is counted)


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


@dataclass
class _Round:
    """An uncut round, kept to replay under each cut-off."""

    num_drafted: int
    num_accepted: int
    drafted_under: tuple[int, ...]  # [len(CUTOFFS)] drafts it would have proposed under each cut-off


class AdaptiveK:
    """Per-drafter controller: acceptance per position and state, drafter step cost, cut-off; shared target cost."""

    def __init__(self, max_k: int, target_cost: TargetCost, profit_gate: bool, probe_interval: int,
                 cut_saves_drafting: bool = True):
        self.max_k = max_k
        self.cut_saves_drafting = cut_saves_drafting  # False: a cut round costs the drafting of the planned K
        self._draft_calls: Callable[[int], int] = one_call_per_draft
        self.target_cost = target_cost
        self.profit_gate = profit_gate
        self.probe_interval = max(1, probe_interval)
        self.speculating = True
        self.exploration = ExplorationCost()
        self._pooled = PositionCounts(max_k, LONG_DECAY)  # all rounds: prior of the states
        self._long = [PositionCounts(max_k, LONG_DECAY, UNDRAFTED_DECAY) for _ in range(2)]  # [AFTER_MISS, AFTER_FULL]
        self._recent = [PositionCounts(max_k, DECAY, UNDRAFTED_DECAY) for _ in range(2)]
        self._state = AFTER_MISS                     # the state the next round starts in
        self._accepted = PRIOR_ALPHA * PRIOR_WEIGHT  # decayed accepted drafts
        self._evaluated = PRIOR_WEIGHT               # decayed drafts the target judged (accepted + first rejected)
        self._draft_cost = DraftCost()               # load-free seconds of drafting k tokens in n calls
        self._draft_stalls = StallFilter()
        self._overhead_stalls = StallFilter()
        self._overhead = 0.0                         # load-free seconds per round outside drafting and target pass
        self._history: deque[tuple[int, int, int]] = deque(maxlen=HISTORY)  # (state, drafted, accepted)
        self._cusum_up = self._cusum_down = 0.0
        self._since_up = self._since_down = 0        # rounds since each CUSUM side last stood at zero
        self._uncut: deque[_Round] = deque(maxlen=CUTOFF_ROUNDS)   # rounds drafted without cut-off, with confidences
        self._cutoff = 0.0
        self._cutoffs: dict[int, tuple[int, float]] = {}  # K -> (round calibrated at, cut-off)
        self._rounds = 0                             # speculative rounds recorded
        self._paused_rounds = 0                      # plain rounds since the gate paused or last probed
        self._probe_left = 0                         # probe rounds still to run while paused
        self._probed = False                         # a probe just finished: re-evaluate the gate
        self._pending: Decision | None = None        # the last decision, to account its exploration cost
        self._curves: list[list[float] | None] = [None, None]  # cached position_alpha per state
        self._pooled_rates: list[float] | None = None          # cached pooled rates, the states' common prior
        self._drafting_costs: list[float] | None = None        # cached _drafting(k) for k = 0..max_k

    # ------------------------------------------------------------------------------------------ estimates
    @property
    def alpha(self) -> float:
        return self._accepted / self._evaluated

    def position_alpha(self, state: int | None = None) -> list[float]:
        """Return the acceptance at each draft position given all earlier ones were accepted ([K]), for a state."""
        state = self._state if state is None else state
        if self._curves[state] is None:
            if self._pooled_rates is None:
                self._pooled_rates = self._pooled.rates()
            self._curves[state] = self._recent[state].rates(self._long[state].rates(self._pooled_rates))
        return self._curves[state]

    def _forget_curves(self) -> None:
        """Drop the cached acceptance curves (the counts changed)."""
        self._curves, self._pooled_rates = [None, None], None

    @property
    def draft_calls(self) -> Callable[[int], int]:
        """Drafter calls of a round of k drafts; set per request (Drafter.draft_calls)."""
        return self._draft_calls

    @draft_calls.setter
    def draft_calls(self, calls: Callable[[int], int]) -> None:
        self._draft_calls, self._drafting_costs = calls, None

    @property
    def draft_token_seconds(self) -> float | None:
        """Seconds per drafted token at the current load, its share of the fixed part per round included."""
        per_token = self._draft_cost.per_token()
        return None if per_token is None else per_token * self.target_cost.load

    @property
    def cutoff(self) -> float:
        """The calibrated confidence cut-off (0 = draft all K)."""
        return self._cutoff

    def _round_cost(self, k: int, shape: list[float | None]) -> float | None:
        verify = shape[k + 1]
        if verify is None or (k and self._draft_cost.step is None):
            return None
        return self._drafting(k) + verify + self._overhead

    def _drafting(self, k: int) -> float:
        """Load-free seconds of drafting k tokens (0 for a plain round)."""
        return self._drafting_table()[k] if k else 0.0

    def _drafting_table(self) -> list[float]:
        """_drafting(k) for k = 0..max_k ([max_k + 1]), once drafting was measured; kept until the next one."""
        if self._drafting_costs is None:  # each round reads ~3 x max_k of them
            self._drafting_costs = [self._draft_cost.seconds(k, self._draft_calls(k)) for k in range(self.max_k + 1)]
        return self._drafting_costs

    def rate(self, k: int, curve: list[float | None] | None = None, rates: list[float] | None = None) -> float | None:
        """Return expected tokens per load-free second with k drafts (k = 0: plain), or None before measurements."""
        cost = self._round_cost(k, curve or self.target_cost.relative())
        if cost is None:
            return None
        return expected_tokens(rates if rates is not None else self.position_alpha(), k) / cost

    def _choices(self, rates: list[float], shape: list[float | None]) -> list[tuple] | None:
        """Return (rate, K, expected tokens, chance all K are accepted, cost) for K = 1..max_k (None: unmeasured)."""
        if self._draft_cost.step is None or shape[1] is None:
            return None
        choices, tokens, survive, drafting = [], 1.0, 1.0, self._drafting_table()
        for k in range(1, self.max_k + 1):
            survive *= rates[k - 1]
            tokens += survive
            cost = drafting[k] + shape[k + 1] + self._overhead
            choices.append((tokens / cost, k, tokens, survive, cost))
        return choices

    def _best(self, rates: list[float], shape: list[float | None]) -> tuple[int, float | None]:
        """Return the K >= 1 with the highest expected rate and that rate (max_k // 2, None before measurements)."""
        choices = self._choices(rates, shape)
        if choices is None:
            return max(1, self.max_k // 2), None
        rate, k, *_ = max(choices)
        return k, rate

    def best_k(self) -> int:
        """Return the K >= 1 with the highest expected rate in the current state (max_k // 2 before measurements)."""
        return self._best(self.position_alpha(), self.target_cost.relative())[0]

    def break_even_tau(self, k: int) -> float:
        """Tokens per round a round with k drafts needs to match plain decoding: cost(k) / cost(plain)."""
        shape = self.target_cost.relative()
        plain, cost = self._round_cost(0, shape), self._round_cost(k, shape)
        if plain is None or cost is None:
            return 1.0
        return cost / plain

    def _policy_rate(self, curves: list[list[float]], shape: list[float | None]) -> float | None:
        """Long-run tokens per load-free second of the best K in each state, the states weighted as they occur."""
        best = [self._choices(curve, shape) for curve in curves]
        if any(choices is None for choices in best):
            return None
        # per state: the best K's tokens, chance that the next round starts AFTER_FULL, cost
        _, ks, tokens, survive, costs = zip(*(max(choices) for choices in best), strict=True)
        full = [all_kept if k >= FULL_MIN_DRAFTS else 0.0 for k, all_kept in zip(ks, survive, strict=True)]
        share_full = full[AFTER_MISS] / (1 - full[AFTER_FULL] + full[AFTER_MISS])  # stationary two-state chain
        weights = (1 - share_full, share_full)
        return sum(w * t for w, t in zip(weights, tokens, strict=True)) / sum(
            w * c for w, c in zip(weights, costs, strict=True))

    def _gain(self, reading: int = 0) -> float | None:
        """
        Return the long-run speedup over plain decoding (None before measurements).

        reading -1 / 1 reads the first draft position's acceptance PAUSE_Z standard errors down / up: every round
        judges it, and it caps all later positions (whose sparse evidence would otherwise make the reading useless).
        """
        shape = self.target_cost.relative()
        plain = self.rate(0, shape)
        curves = []
        for state in (AFTER_MISS, AFTER_FULL):
            curve = self.position_alpha(state)
            error = self._recent[state].error(0, curve[0])
            curves.append([min(MAX_RATE, max(0.0, curve[0] + reading * PAUSE_Z * error))] + curve[1:])
        rate = self._policy_rate(curves, shape)
        return None if plain is None or rate is None else rate / plain

    # ------------------------------------------------------------------------------------------ recording
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
        load = self.target_cost.load
        self.exploration.total_seconds += draft_seconds + target_seconds
        if round_seconds is not None:
            overhead = max(0.0, round_seconds - draft_seconds - target_seconds) / load
            plain = self.target_cost.relative()[1]  # a stall is judged against a round's scale, not the overhead's
            if not self._overhead_stalls.skips(overhead, None if plain is None else self._overhead + plain):
                self._overhead = DECAY * self._overhead + (1 - DECAY) * overhead
        if num_drafted == 0:
            if decision is not None and not decision.speculating:
                for counts in self._recent:  # paused: old evidence fades, so that probes soon decide
                    counts.fade()
            self._state = AFTER_MISS
            self._forget_curves()
            return
        if decision is not None and decision.exploring:
            self._count_exploration(decision, num_drafted)
        self._detect_change(num_drafted, num_accepted)
        self._rounds += 1
        self._history.append((self._state, num_drafted, num_accepted))
        self._add(self._state, num_drafted, num_accepted)
        self._long[self._state].add(num_drafted, num_accepted)
        self._long[1 - self._state].fade()
        self._pooled.add(num_drafted, num_accepted)
        self._forget_curves()
        self._state = AFTER_FULL if num_accepted == num_drafted >= FULL_MIN_DRAFTS else AFTER_MISS
        self._accepted = DECAY * self._accepted + num_accepted
        self._evaluated = DECAY * self._evaluated + min(num_drafted, num_accepted + 1)
        cutoff = decision.min_confidence if decision is not None else 0.0
        calls = self.draft_calls(num_drafted)
        estimate = None if self._draft_cost.step is None else self._draft_cost.seconds(num_drafted, calls)
        stalled = self._draft_stalls.skips(draft_seconds / load, estimate)
        if not stalled and (self.cut_saves_drafting or not cutoff):  # else: seconds of drafts it did not keep
            self._draft_cost.record(num_drafted, calls, draft_seconds / load)
            self._drafting_costs = None
        if confidences is not None and cutoff == 0.0 and len(confidences) == num_drafted:
            self._uncut.append(_Round(num_drafted, num_accepted, tuple(
                drafts_under_cutoff(confidences, num_drafted, level) for level in CUTOFFS)))

    def _add(self, state: int, num_drafted: int, num_accepted: int) -> None:
        self._recent[state].add(num_drafted, num_accepted)
        self._recent[1 - state].fade()

    def _count_exploration(self, decision: Decision, num_drafted: int) -> None:
        """Add the expected extra seconds of an exploration or probe round against the choice it displaced."""
        shape = self.target_cost.relative()
        rates = self.position_alpha()
        cost = self._round_cost(num_drafted, shape)
        if decision.speculating:
            self.exploration.explore_rounds += 1
            reference = self._best(rates, shape)[1]
        else:
            self.exploration.probe_rounds += 1
            reference = self.rate(0, shape, rates)
        if cost is None or reference is None:
            return
        lost = cost - expected_tokens(rates, num_drafted) / reference
        self.exploration.lost_seconds += max(0.0, lost) * self.target_cost.load

    def _detect_change(self, num_drafted: int, num_accepted: int) -> None:
        """Two-sided CUSUM on the accepted count against the current estimates; on alarm, rebuild from the change."""
        survive, mean, second = 1.0, 0.0, 0.0
        for j, rate in enumerate(self.position_alpha()[:num_drafted], start=1):
            survive *= rate        # P(accepted >= j)
            mean += survive
            second += (2 * j - 1) * survive
        deviation = (num_accepted - mean) / max(CUSUM_MIN_STD, math.sqrt(max(0.0, second - mean * mean)))
        self._cusum_up = max(0.0, self._cusum_up + deviation - CUSUM_SLACK)
        self._cusum_down = max(0.0, self._cusum_down - deviation - CUSUM_SLACK)
        self._since_up = self._since_up + 1 if self._cusum_up else 0
        self._since_down = self._since_down + 1 if self._cusum_down else 0
        if max(self._cusum_up, self._cusum_down) < CUSUM_ALARM:
            return
        since = self._since_up if self._cusum_up >= CUSUM_ALARM else self._since_down
        changed = list(self._history)[len(self._history) - min(since - 1, len(self._history)):]
        self._recent = [PositionCounts(self.max_k, DECAY, UNDRAFTED_DECAY) for _ in range(2)]
        for state, drafted, accepted in changed:
            self._add(state, drafted, accepted)
        for counts in (self._pooled, *self._long):
            counts.fade(CHANGE_KEEP)
        self._cusum_up = self._cusum_down = 0.0
        self._since_up = self._since_down = 0

    # ------------------------------------------------------------------------------------------ deciding
    def decide(self) -> Decision:
        """K (and cut-off) for the next round, applying the profit gate, probes and bounded exploration."""
        self._pending = self._decide()
        return self._pending

    def _decide(self) -> Decision:
        if not self.target_cost.measured(1):
            return Decision(0, self.speculating)  # measure plain decoding once first
        if not self.profit_gate:
            self.speculating = True
            return self._speculate()
        if self._probe_left > 0:
            self._probe_left -= 1
            return Decision(self.best_k(), False, exploring=True)
        if not self.speculating:
            gain = self._gain() if self._probed else None
            self._probed = False
            if gain is None or gain <= 1 + RESUME_MARGIN:
                self._paused_rounds += 1
                if self._paused_rounds < self._probe_every():
                    return Decision(0, False)
                self._paused_rounds = 0
                self._probe_left = PROBE_ROUNDS - 1
                self._probed = True
                return Decision(self.best_k(), False, exploring=True)
            self.speculating = True
            return self._speculate()
        evidence = sum(counts.judged[0] for counts in self._recent)
        optimistic = self._gain(1) if evidence >= MIN_EVIDENCE else None
        if optimistic is not None and optimistic < 1.0:
            self.speculating = False
            self._paused_rounds = 0
            return Decision(0, False)
        return self._speculate()

    def start(self) -> None:
        """Note that a new request begins (optional): its text may differ, so a paused gate probes at once."""
        self._state = AFTER_MISS
        self._forget_curves()
        if not self.speculating and not self._probe_left:
            self._paused_rounds = self.probe_interval - 1

    def _probe_every(self) -> int:
        """Plain rounds between probes: as many as keep the probes' expected loss within PROBE_BUDGET."""
        shape = self.target_cost.relative()
        k = self.best_k()
        plain, cost = self._round_cost(0, shape), self._round_cost(k, shape)
        if plain is None or cost is None:
            return self.probe_interval
        loss = PROBE_ROUNDS * max(0.0, cost - expected_tokens(self.position_alpha(), k) * plain)
        return min(self.probe_interval, max(MIN_PROBE_EVERY, math.ceil(loss / (PROBE_BUDGET * plain))))

    def _speculate(self) -> Decision:
        """Return the best K (now and then K + 1, to measure the next position) with the calibrated cut-off."""
        shape = self.target_cost.relative()
        rates = self.position_alpha()
        k, best = self._best(rates, shape)
        calibrated = self._cutoffs.get(k)  # the replay costs ~1 ms: per K, at most every CUTOFF_EXPLORE_EVERY rounds
        if calibrated is None or self._rounds - calibrated[0] >= CUTOFF_EXPLORE_EVERY:
            calibrated = self._cutoffs[k] = (self._rounds, self._calibrate_cutoff(k, shape))
        self._cutoff = calibrated[1]
        if self._cutoff > 0 and self._rounds % CUTOFF_EXPLORE_EVERY == CUTOFF_EXPLORE_EVERY - 1:
            return Decision(k, True, 0.0, exploring=True)
        if best is not None and k < self.max_k and self._rounds % EXPLORE_EVERY == EXPLORE_EVERY - 1:
            # upper confidence bound on the next position: rarely judged positions get tried, measured ones not
            error = self._recent[self._state].error(k, rates[k])
            hopeful = rates[:k] + [min(MAX_RATE, rates[k] + EXPLORE_Z * error)] + rates[k + 1:]
            longer, optimistic = self.rate(k + 1, shape, rates), self.rate(k + 1, shape, hopeful)
            if longer is not None and optimistic > best and longer >= (1 - EXPLORE_MAX_LOSS) * best:
                return Decision(k + 1, True, self._cutoff, exploring=True)
        return Decision(k, True, self._cutoff)

    def _calibrate_cutoff(self, k: int, shape: list[float | None]) -> float:
        """Replay recent uncut rounds of at least k drafts under each cut-off; keep one only if it clearly pays."""
        rounds = [r for r in self._uncut if r.num_drafted >= k]
        if len(rounds) < CUTOFF_MIN_ROUNDS or self._draft_cost.step is None:
            return 0.0
        costs = [self._round_cost(drafted, shape) or 0.0 for drafted in range(k + 1)]  # [k + 1] by drafts kept
        drafting = self._drafting
        cut_costs = costs if self.cut_saves_drafting else [  # a cut round pays the drafting of all k
            cost + drafting(k) - drafting(drafted) for drafted, cost in enumerate(costs)]

        def replay_rate(drafted: list[int], round_costs: list[float]) -> float:  # drafted: [rounds] drafts kept
            tokens = sum(min(r.num_accepted, d) for r, d in zip(rounds, drafted, strict=True)) + len(rounds)
            return tokens / sum(round_costs[d] for d in drafted)

        # against the best uncut K up to k: a cut-off that only shortens drafts at random is no better than that
        uncut = max(replay_rate([cap] * len(rounds), costs) for cap in range(1, k + 1))
        gain, cutoff = max((replay_rate([min(k, r.drafted_under[index]) for r in rounds], cut_costs) / uncut, cutoff)
                           for index, cutoff in enumerate(CUTOFFS))
        return cutoff if gain > 1 + CUTOFF_MIN_GAIN else 0.0

    def may_speculate_next(self) -> bool:
        """Tell whether the next round may draft (False only when decide() will surely run it plain)."""
        if not self.profit_gate or self.speculating or self._probe_left or self._probed:
            return True
        return not self.target_cost.measured(1) or self._paused_rounds + 1 >= self._probe_every()
