"""
The drafter of each round of an `auto` goal, priced by each drafter's own controller: no estimate of its own.

Every member drafter of an auto goal keeps its SpeculationController (its acceptance, drafting cost and profit
gate). Before a round, among the members that can draft now (the caller tells: the n-gram drafter only where its
context has a match) and whose gates are open, the one whose best K promises the most tokens per load-free second
(SpeculationController.expected_rate) drafts, and its controller decides K as it would alone. Acceptance comes in
runs, so each is priced in an acceptance state (after a fully accepted round, or after a miss): its own where the
previous round judged its drafts, else the state the previous round left the text in, whoever drafted it.

- A member never measured goes first, once, so that it has a price; an open one whose drafts went unjudged for
  engine.probe_interval rounds drafts one round (a probe), so that a price measured on another text does not keep
  it out for good (its estimator's change test resets its acceptance at once when it now does better).
- A member whose profit gate paused it is no candidate. Its gate counts the rounds that run plain, as alone (its
  probes take the place of plain rounds), and the member drafts its probe rounds before the others. Its gate
  probes in a round others draft too when the member went unjudged for PAUSED_PROBE_EVERY x engine.probe_interval
  rounds, or when its evidence (prompt lookup's judged unrun drafts) clears the gate's resume margin.
- The round is plain when no member with an open gate can draft, or when the fastest does not beat plain decoding
  (SpeculationController.expected_rate(0)) by the gates' resume margin in its state: plain decoding wins when no
  drafter pays (with engine.profit_gate off, a member always drafts).

A sampled goal with a pinned K (a seeded one always is) chooses without timings, so that its seed reproduces its
tokens: the first member in the caller's order that can draft.
"""

from .controller import SpeculationController
from .decision import Decision
from .estimator import AFTER_FULL, AFTER_MISS, FULL_MIN_DRAFTS
from .gate import RESUME_MARGIN

PAUSED_PROBE_EVERY = 8  # a paused member probes at least every this many x engine.probe_interval rounds: there its
                        # probes displace a drafter that pays, not a plain round


class DrafterChoice:
    """Chooses the drafter of each round among an auto goal's members (name -> controller, in order of preference)."""

    def __init__(self, controllers: dict[str, SpeculationController]):
        self.controllers = controllers   # shared with the goal: a member that fails is dropped from it
        self._ticked: list[str] = []     # paused members that counted the round without drafting it
        self._text_state = AFTER_MISS    # the acceptance state the previous round left the text in

    def choose(self, ready: set[str], pinned_k: int = 0, timed: bool = True) -> tuple[str | None, Decision]:
        """
        Return the round's drafter (None: a plain round) and its Decision.

        ready: the members that can draft now; pinned_k: the request's K (0: adaptive); timed: False when the
        choice must not depend on measured times (a sampled goal with a pinned K).
        """
        self._ticked = []
        candidates = [name for name in self.controllers if name in ready]
        if pinned_k:
            if not candidates:
                return None, Decision(0, True)
            return candidates[0] if not timed else self._pick(candidates, pinned_k)[0], Decision(pinned_k, True)
        open_gates = [name for name in candidates if self.controllers[name].speculating]
        wanting = {}
        for name, controller in self.controllers.items():
            if controller.speculating:
                continue
            if open_gates and not controller.gate.probing:  # a round another member drafts: not a plain one
                if name not in ready or not self._probes_now(controller):
                    continue
                controller.start()  # its gate probes at once
            decision = controller.decide()  # a paused gate counts the round: plain, a probe, or it resumes
            if decision.num_draft_tokens and name in ready:
                wanting[name] = decision
            else:
                self._ticked.append(name)
        if wanting:
            name = self.fastest(list(wanting), 0)
            self._ticked += [other for other in wanting if other != name]
            return name, wanting[name]
        if not open_gates:
            return None, Decision(0, False)
        name, rate = self._pick(open_gates, 0)
        controller = self.controllers[name]
        plain = controller.expected_rate(0)
        if controller.gate.enabled and rate is not None and plain is not None and rate <= (1 + RESUME_MARGIN) * plain:
            return None, Decision(0, True)  # in this state not even the fastest beats plain decoding clearly
        return name, controller.decide()

    @staticmethod
    def _probes_now(controller: SpeculationController) -> bool:
        """Whether a paused member probes in a round others draft: unjudged too long, or its evidence would resume."""
        if controller.rounds_unjudged >= PAUSED_PROBE_EVERY * controller.gate.probe_interval:
            return True
        if controller.rounds_unjudged:  # no new evidence since it last was
            return False
        gain = controller.rates.gain()  # a judged unrun draft (prompt lookup) may show that it pays again
        return gain is not None and gain > 1 + RESUME_MARGIN

    def _pick(self, names: list[str], k: int) -> tuple[str, float | None]:
        """Return the member of names to draft and its rate: one unjudged too long (a probe, None), else the fastest."""
        stale = [name for name in names
                 if self.controllers[name].rounds_unjudged >= self.controllers[name].gate.probe_interval]
        return (stale[0], None) if stale else self._fastest(names, k)

    def fastest(self, names: list[str], k: int) -> str:
        """Return the member of names with the best expected rate (k drafts, 0: its best K); unmeasured first."""
        return self._fastest(names, k)[0]

    def _fastest(self, names: list[str], k: int) -> tuple[str, float | None]:
        rates = {name: self.controllers[name].expected_rate(k or None, self._state(name)) for name in names}
        unmeasured = [name for name in names if rates[name] is None]
        name = unmeasured[0] if unmeasured else max(names, key=lambda name: rates[name])
        return name, rates[name]

    def _state(self, name: str) -> int | None:
        """Return the state to price a member in: its own (None) where the last round judged it, else the text's."""
        return None if self.controllers[name].rounds_unjudged == 0 else self._text_state

    def after_round(self, num_drafted: int, num_accepted: int, judged: set[str]) -> None:
        """
        Note how the round went (after its controller recorded it): the text's state, which members it judged.

        The paused members that counted the round without drafting it record it as a plain round.
        """
        full = num_drafted >= FULL_MIN_DRAFTS and num_accepted == num_drafted
        self._text_state = AFTER_FULL if full else AFTER_MISS
        for name in self._ticked:
            if name in self.controllers:
                self.controllers[name].record(0, 0, 0.0)
        self._ticked = []
        for name, controller in self.controllers.items():
            controller.rounds_unjudged = 0 if name in judged else controller.rounds_unjudged + 1
