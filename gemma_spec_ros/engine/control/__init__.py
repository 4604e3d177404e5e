"""
The adaptive speculation controller: K per round, the cut-off, whether speculating pays, an auto goal's drafter.

All from online measurements, in pure Python (no torch); docs/adaptive-k.md explains the method. The modules:

- controller.py: SpeculationController, the one object the engine asks (decide) and tells (start, record).
- estimator.py: acceptance per draft position and state; the CUSUM test that notices when the text changed.
- target_cost.py: seconds of a target pass by its size, as a load-free shape times a load; the stall filter.
- batch_cost.py: GoalPassCost, one goal's share of a batched pass (continuous batching), read as a target cost.
- round_cost.py: a round's load-free cost: the drafting fit (per round, call and draft), the loop's own work.
- rates.py: expected tokens per second of each K, the best K and the long-run gain over plain decoding.
- gate.py: the profit gate: pause when speculation loses, probe while paused, resume on a clear gain.
- exploration.py: rounds that draft K + 1 to measure the next position, and what exploring costs.
- cutoff.py: the confidence cut-off, calibrated by replaying recent uncut rounds.
- decision.py: Decision, what the controller tells the engine before a round.
- choice.py: DrafterChoice, the drafter of each round of an auto goal, from its members' controllers.
"""

from .batch_cost import GoalPassCost
from .choice import DrafterChoice
from .controller import SpeculationController
from .cutoff import drafts_under_cutoff
from .decision import Decision
from .target_cost import TargetCost

__all__ = ['Decision', 'DrafterChoice', 'GoalPassCost', 'SpeculationController', 'TargetCost', 'drafts_under_cutoff']
