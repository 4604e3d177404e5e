"""What the controller tells the engine before a round."""

from dataclasses import dataclass


@dataclass
class Decision:
    num_draft_tokens: int        # K for the next round; 0 = plain round
    speculating: bool            # False while the profit gate pauses speculation
    min_confidence: float = 0.0  # the drafter ends the round at a draft it gives less probability (0 = never)
    exploring: bool = False      # an exploration or probe round (its expected loss is counted)
