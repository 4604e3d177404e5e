"""A goal's images at its prefill: the target's vision tower makes their soft tokens, timed apart from the text."""

from ..runtime.vision import SoftTokens, VisionTower
from .run import Run


def soft_tokens(vision: VisionTower | None, run: Run) -> SoftTokens | None:
    """Run the vision tower on the goal's images (None without images); its time goes into the goal's tally."""
    if not run.plan.images:
        return None
    soft = vision.encode(run.plan.images)
    run.tally.image_seconds = soft.seconds
    return soft
