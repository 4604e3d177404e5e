"""
The `auto` drafter of a goal: every round, the loaded drafter expected to yield the most tokens per second.

An auto goal holds every loaded drafter but none (its members: the model drafters whose models loaded, and prompt
lookup) with that drafter's controller; plain decoding is what a round falls back to. Which member drafts a round
is control.DrafterChoice's call, from the members' own controllers; the n-gram drafter is a candidate only where
its context has a match (Drafter.has_proposal), the MTP assistant only where the last pass gave it its state.

It stays lossless as every drafter does: whichever member drafts, the target verifies its drafts. Members that keep
state see every target pass, whoever drafted it (Rounds.accept lets each observe it): the MTP assistant takes the
pass's hidden state, the draft model feeds its cache the tokens it has not seen when it next drafts (its cache
holds only accepted tokens, so it is never ahead of the goal). A member that raises leaves the goal; the others go
on.

A greedy goal also judges, after each round another member drafted, what prompt lookup would have drafted: a
greedy target's tokens do not depend on the drafts, so its acceptance is measured exactly, at no model cost, and
its controller follows the text while it does not draft (SpeculationController.record_unrun).
"""

from ..control import Decision, DrafterChoice, SpeculationController
from ..drafters.base import Drafter
from ..drafters.ngram import NgramDrafter

PREFERENCE = ('ngram', 'mtp', 'draft')  # the members' order: the choice without timings takes the first that drafts


class AutoDrafting:
    """An auto goal's members (drafter and controller by name) and the state of its current round."""

    def __init__(self, drafters: dict[str, Drafter], controllers: dict[str, SpeculationController]):
        order = sorted(drafters, key=lambda name: PREFERENCE.index(name) if name in PREFERENCE else len(PREFERENCE))
        self.drafters = {name: drafters[name] for name in order}
        self.controllers = {name: controllers[name] for name in order}
        self.choice = DrafterChoice(self.controllers)
        self._unrun: tuple[SpeculationController, list[int]] | None = None  # prompt lookup's draft, to judge
        self._judged: set[str] = set()  # the members whose drafts the round judges: its drafter, prompt lookup

    def members(self) -> list[Drafter]:
        return list(self.drafters.values())

    def for_batch(self, slot: int) -> dict[str, Drafter]:
        """Take the members' drafters of a batch slot (Drafter.for_batch); return the engine's shared ones by name."""
        shared = dict(self.drafters)
        self.drafters.update((name, drafter.for_batch(slot)) for name, drafter in shared.items())
        return shared

    def drop(self, drafter: Drafter) -> bool:
        """Take a member that raised out of the goal; False if it is no member."""
        name = next((name for name, member in self.drafters.items() if member is drafter), None)
        if name is None:
            return False
        del self.drafters[name], self.controllers[name]
        return True

    def choose(self, tokens: list[int], pinned_k: int,
               greedy: bool) -> tuple[Drafter | None, SpeculationController | None, Decision]:
        """
        Choose the round's member and its controller (None: a plain round), and its Decision (under their lock).

        A greedy goal keeps prompt lookup's draft of the round when another member drafts, to judge it after.
        """
        ready = {name for name, drafter in self.drafters.items() if drafter.has_proposal(tokens)}
        name, decision = self.choice.choose(ready, pinned_k, timed=greedy or not pinned_k)
        self._unrun, self._judged = None, {name}
        lookup = self.drafters.get('ngram')
        if greedy and isinstance(lookup, NgramDrafter) and name != 'ngram':
            controller = self.controllers['ngram']
            self._unrun = controller, lookup.lookup(tokens, pinned_k or controller.max_k)  # judged as far as it can
            self._judged.add('ngram')
        return self.drafters.get(name), self.controllers.get(name), decision

    def after_record(self, num_drafted: int, num_accepted: int) -> None:
        """After the round's record: the choice notes how it went (control.DrafterChoice.after_round)."""
        self.choice.after_round(num_drafted, num_accepted, self._judged)

    def main_controller(self, rounds_by_drafter: dict[str, int]) -> SpeculationController | None:
        """Return the controller of the member that drafted the most rounds (None: no member left)."""
        return max(self.controllers.items(), key=lambda item: rounds_by_drafter.get(item[0], 0),
                   default=(None, None))[1]

    def after_round(self, round_tokens: list[int]) -> None:
        """
        Judge the unrun lookup draft exactly, from the round's tokens (its accepted drafts and the next token).

        Drafts that match the round's tokens were accepted, the first that differs was rejected; a draft longer
        than the round's tokens is judged only as far as they reach. Call it under the controllers' lock.
        """
        if self._unrun is None:
            return
        controller, draft = self._unrun
        self._unrun = None
        reach = min(len(draft), len(round_tokens))
        kept = next((index for index in range(reach) if draft[index] != round_tokens[index]), None)
        if kept is not None:                      # draft kept + 1 rejected
            controller.record_unrun(len(draft), kept)
        else:                                     # all judged ones accepted
            controller.record_unrun(reach, reach)


def preferred(controllers: dict[str, SpeculationController]) -> SpeculationController | None:
    """Return the controller an auto default shows: the fastest open member, else any (None: no member)."""
    names = [name for name, controller in controllers.items() if controller.speculating] or list(controllers)
    return controllers[DrafterChoice(controllers).fastest(names, 0)] if names else None
