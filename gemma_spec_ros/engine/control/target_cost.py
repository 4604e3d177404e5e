"""
The target's cost per pass, by the tokens it verifies, and the filter that keeps stalls out of every cost.

Costs are kept in load-free units: the curve is a shape times a load factor that follows the latest pass, so that
plain decoding measured under one load is never compared with verify passes measured under another (on a shared
machine that would make the profit gate flip). The engine sets the shape from passes of every size it times when it
loads (TargetCost.calibrate): the pairs of adjacent passes of different sizes that requests make are rare, and a
shape learned from them alone prices long drafts too dear.
"""

import itertools

LOAD_DECAY = 0.7          # per target pass, weight of the older load factor (load moves fast)
SHAPE_DECAY = 0.95        # per pair of adjacent passes of different sizes, weight of the older cost shape (timing
                          # noise on a shared CPU swings single passes by tens of percent)
STALL_FACTOR = 8.0        # a pass or a drafting round this many times its estimate is a stall (a compile on first
                          # use, the process descheduled): left out of the costs, where a single one would price a K
                          # out for the rest of the run, unless the next is one too (then the load changed)


class StallFilter:
    """Tells a stall from a measurement: a time over STALL_FACTOR x its estimate, unless the one before was one too."""

    def __init__(self):
        self._stalled = False

    def skips(self, seconds: float, estimate: float | None) -> bool:
        stall = estimate is not None and seconds > STALL_FACTOR * estimate and not self._stalled
        self._stalled = stall
        return stall


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
            self._relative = None
        else:
            if self._previous is not None and self._previous[0] != num_tokens:
                before, before_seconds = self._previous
                before_shape = self._shape[before]
                assert before_shape is not None  # every recorded size has a shape
                paired = before_shape * seconds / before_seconds
                self._shape[num_tokens] = known * (paired / known) ** (1 - SHAPE_DECAY)
                self._relative = None
            # the load alone changes no load-free estimate: plain decoding (one size) keeps them cached
            self._load = LOAD_DECAY * self._load + (1 - LOAD_DECAY) * seconds / self._shape[num_tokens]
        self._previous = (num_tokens, seconds)

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
            estimates = _complete_shape(self._shape) if any(s is not None for s in self._shape) else []
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


def _complete_shape(shape: list[float | None]) -> list[float]:
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
