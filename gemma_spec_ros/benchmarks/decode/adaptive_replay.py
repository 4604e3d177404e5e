"""
Replay the adaptive controller and every fixed K over a recorded acceptance map (issue 14; needs no models).

The replay runs the bench's interleaved order.

    python -m gemma_spec_ros bench adaptive-replay test/data/acceptance_map.json

A greedy round after s emitted tokens accepts min(K, run_lengths[s]) drafts whatever came before, so the replay
is exact in tokens and rounds. Time is charged from the map's measured costs, in plain target passes: a round
with k drafts in n drafter calls costs the drafter's fixed part + n * its per-call part + k * c + verify_cost[k] +
the loop's per-round overhead (plain rounds pay it too); a round cut short by a confidence cut-off pays the
drafting of its whole K where the drafter drafts in calls of several steps (the map's cut_saves_drafting). As in the
engine, one controller per drafter sees every round of that drafter, pinned-K rounds included, and one target
cost curve, calibrated from the map's as the engine calibrates it when it loads, sees all passes; the controller is
fed the same costs, optionally with multiplicative timing noise.
"""

import argparse
import json
import random
import statistics
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

from gemma_spec_ros.engine.control import Decision, SpeculationController, TargetCost, drafts_under_cutoff
from gemma_spec_ros.engine.types import one_call_per_draft

ADAPTIVE = 0  # the system key of adaptive K (fixed systems are keyed by their K)


@dataclass
class Costs:
    verify_cost: list[float]          # [max_k + 1] target pass over n = 1.. tokens, in plain passes
    draft_cost_ratio: dict[str, float]  # per drafted token, in plain passes
    overhead: float = 0.0             # the loop's own work per round, in plain passes
    draft_fixed_ratio: dict[str, float] = field(default_factory=dict)  # per drafting round, in plain passes
    cut_saves_drafting: dict[str, bool] = field(default_factory=dict)  # False: a cut round drafts its whole K
    draft_call_ratio: dict[str, float] = field(default_factory=dict)  # per drafter call, in plain passes
    draft_calls: dict[str, list[int]] = field(default_factory=dict)   # [max_k + 1] calls of a round of k drafts
                                                                       # (absent: one per draft)

    def calls(self, drafter: str) -> Callable[[int], int]:
        """Return the drafter's calls per round of k drafts, as a function of k."""
        table = self.draft_calls.get(drafter)
        return one_call_per_draft if table is None else lambda num_drafts: table[num_drafts]

    def draft_seconds(self, drafter: str, num_drafted: int) -> float:
        if not num_drafted:
            return 0.0
        return (self.draft_fixed_ratio.get(drafter, 0.0) + num_drafted * self.draft_cost_ratio.get(drafter, 0.0)
                + self.calls(drafter)(num_drafted) * self.draft_call_ratio.get(drafter, 0.0))

    def relative_cost(self, drafter: str, num_drafted: int, num_paid: int) -> float:
        """Return a round's time over a plain round's time: num_paid drafting steps, num_drafted verified."""
        seconds = self.draft_seconds(drafter, num_paid) + self.verify_cost[num_drafted]
        return (seconds + self.overhead) / (self.verify_cost[0] + self.overhead)


@dataclass
class Tally:
    tokens: int = 0
    seconds: float = 0.0   # in plain rounds
    rounds: int = 0
    paused_rounds: int = 0
    drafted: int = 0

    @property
    def speedup(self) -> float:
        """Tokens per plain round: the speedup over plain decoding."""
        return self.tokens / self.seconds if self.seconds else 0.0


@dataclass
class Replay:
    """Per (drafter, system, category) tallies of one interleaved replay."""

    tallies: dict = field(default_factory=lambda: defaultdict(Tally))
    decisions: list[Decision] = field(default_factory=list)  # the adaptive rounds' decisions, in order


class Simulation:
    """The engine's measurement state: one target cost curve, one controller per drafter."""

    def __init__(self, drafters: list[str], costs: Costs, max_k: int, noise: float, seed: int):
        self.costs = costs
        self.target_cost = TargetCost(max_k + 1)
        self.target_cost.calibrate({n: seconds for n, seconds in enumerate(costs.verify_cost, start=1)})  # at load
        self.controllers = {d: SpeculationController(max_k, self.target_cost, profit_gate=True, probe_interval=32,
                                                     cut_saves_drafting=costs.cut_saves_drafting.get(d, True))
                            for d in drafters}
        self._noise, self._rng = noise, random.Random(seed)

    def _observed(self, seconds: float) -> float:
        return seconds * (self._rng.lognormvariate(0.0, self._noise) if self._noise else 1.0)

    def request(self, drafter: str, k: int, mapping: dict, tally: Tally, replay: Replay | None = None) -> None:
        """Generate one prompt's output with drafter at fixed k (or ADAPTIVE); k ignored for drafter 'none'."""
        run_lengths, confidences = mapping['run_lengths'], mapping['confidences']
        total = mapping['output_tokens']
        controller = self.controllers.get(drafter)
        if controller is not None:  # as the engine: a pinned K is only measured
            controller.start(self.costs.calls(drafter), pinned_k=k != ADAPTIVE)
        emitted = 1  # the prefill's token
        while emitted < total:
            if controller is None:
                decision = Decision(0, False)
            elif k == ADAPTIVE:
                decision = controller.decide()
            else:
                decision = Decision(k, True)
            drafted = planned = min(decision.num_draft_tokens, total - emitted - 1)
            round_confidences = confidences[emitted][:drafted] if confidences[emitted] else None
            if drafted and round_confidences and decision.min_confidence:
                drafted = drafts_under_cutoff(round_confidences, drafted, decision.min_confidence)
                round_confidences = round_confidences[:drafted]
            accepted = min(drafted, run_lengths[emitted])
            paid = drafted if self.costs.cut_saves_drafting.get(drafter, True) else planned
            draft_seconds = self._observed(self.costs.draft_seconds(drafter, paid))
            self.target_cost.record(drafted + 1, self._observed(self.costs.verify_cost[drafted]))
            if controller is not None:
                overhead = self._observed(self.costs.overhead)
                controller.record(drafted, accepted, draft_seconds, confidences=round_confidences,
                                  round_seconds=draft_seconds + (self.target_cost.last_seconds or 0.0) + overhead)
            if replay is not None and k == ADAPTIVE:
                replay.decisions.append(decision)
            tally.tokens += min(accepted + 1, total - emitted)
            tally.seconds += self.costs.relative_cost(drafter, drafted, paid)
            tally.rounds += 1
            tally.paused_rounds += not decision.speculating and decision.num_draft_tokens == 0
            tally.drafted += drafted
            emitted += accepted + 1


def replay_bench(acceptance_map: dict, ks: list[int], repeats: int = 2, noise: float = 0.0, seed: int = 0,
                 overhead: float = 0.0, drafters: list[str] | None = None, per_category: int = 0) -> Replay:
    """Run plain, every fixed K and adaptive for every drafter on every prompt, shuffled per (repeat, prompt)."""
    recorded = acceptance_map['costs']
    costs = Costs(recorded['verify_cost'], recorded['draft_cost_ratio'], overhead,
                  recorded.get('draft_fixed_ratio', {}), recorded.get('cut_saves_drafting', {}),
                  recorded.get('draft_call_ratio', {}), recorded.get('draft_calls', {}))
    prompts = _take_per_category(acceptance_map['prompts'], per_category)
    drafters = drafters or sorted(prompts[0]['maps'])
    simulation = Simulation(drafters, costs, acceptance_map['max_k'], noise, seed)
    order = random.Random(seed)
    replay = Replay()
    systems = [('none', 0)] + [(d, k) for d in drafters for k in [*ks, ADAPTIVE]]
    for _ in range(repeats):
        for prompt in prompts:
            order.shuffle(systems)
            for drafter, k in systems:
                mapping = prompt['maps'][drafters[0] if drafter == 'none' else drafter]
                simulation.request(drafter, k, mapping, replay.tallies[drafter, k, prompt['category']], replay)
    return replay


def _take_per_category(prompts: list[dict], count: int) -> list[dict]:
    """Keep the first count prompts of each category, in map order (all when count is 0)."""
    taken: dict[str, int] = defaultdict(int)
    kept = []
    for prompt in prompts:
        taken[prompt['category']] += 1
        if not count or taken[prompt['category']] <= count:
            kept.append(prompt)
    return kept


@dataclass
class Row:
    drafter: str
    category: str
    best_k: int
    best_speedup: float
    adaptive_speedup: float
    paused_rounds: int

    @property
    def ratio(self) -> float:
        return self.adaptive_speedup / self.best_speedup


def table(replay: Replay, ks: list[int]) -> list[Row]:
    """Per drafter and category: the best fixed K in hindsight, its speedup, adaptive's speedup and pauses."""
    rows = []
    keys = sorted({(d, c) for d, _, c in replay.tallies if d != 'none'})
    for drafter, category in keys:
        best_k = max(ks, key=lambda k: replay.tallies[drafter, k, category].speedup)
        adaptive = replay.tallies[drafter, ADAPTIVE, category]
        rows.append(Row(drafter, category, best_k, replay.tallies[drafter, best_k, category].speedup,
                        adaptive.speedup, adaptive.paused_rounds))
    return rows


def best_single_k(replay: Replay, ks: list[int], drafter: str) -> tuple[int, float, float]:
    """Return the fixed K with the best mean speedup over categories, that mean, and adaptive's mean."""
    categories = sorted({c for d, _, c in replay.tallies if d == drafter})

    def mean(k):
        return statistics.mean(replay.tallies[drafter, k, c].speedup for c in categories)

    best = max(ks, key=mean)
    return best, mean(best), mean(ADAPTIVE)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog='python -m gemma_spec_ros bench adaptive-replay',
                                     description=__doc__.split('\n\n')[0])
    parser.add_argument('map', help='an acceptance map (bench.acceptance_map)')
    parser.add_argument('--ks', default='1,2,3,4,5,6,7,8', help='fixed K values to compare against')
    parser.add_argument('--repeats', type=int, default=2)
    parser.add_argument('--noise', type=float, default=0.1, help='lognormal sigma of observed timings')
    parser.add_argument('--overhead', type=float, default=0.02, help='per-round loop overhead, in plain passes')
    parser.add_argument('--seeds', type=int, default=3)
    parser.add_argument('--per-category', type=int, default=0, help='prompts per category (0 = all)')
    args = parser.parse_args(argv)
    with open(args.map, encoding='utf-8') as f:
        acceptance_map = json.load(f)
    ks = [int(k) for k in args.ks.split(',')]
    print('| seed | drafter | category | best fixed K | its speedup | adaptive | ratio | paused rounds |')
    print('|---|---|---|---|---|---|---|---|')
    for seed in range(args.seeds):
        replay = replay_bench(acceptance_map, ks, args.repeats, args.noise, seed, args.overhead,
                              per_category=args.per_category)
        for row in table(replay, ks):
            print('| {} | {} | {} | K{} | {:.2f}x | {:.2f}x | {:.0%} | {} |'.format(
                seed, row.drafter, row.category, row.best_k, row.best_speedup, row.adaptive_speedup, row.ratio,
                row.paused_rounds))
        for drafter in sorted(acceptance_map['prompts'][0]['maps']):
            k, best, adaptive = best_single_k(replay, ks, drafter)
            print('| {} | {} | mean | K{} | {:.2f}x | {:.2f}x | {:.0%} | |'.format(seed, drafter, k, best, adaptive,
                                                                            adaptive / best))
    return 0


if __name__ == '__main__':
    raise SystemExit(main())
