"""A goal's images at its prefill: the target's vision tower makes their soft tokens, timed apart from the text."""

from ..runtime.model.prefix_cache import ImageKey, image_digest, image_keys_of
from ..runtime.model.vision import SoftTokens, VisionTower
from .run import Run


def soft_tokens(vision: VisionTower | None, run: Run) -> SoftTokens | None:
    """Run the vision tower on the goal's images (None without images); its time goes into the goal's tally."""
    if not run.plan.images:
        return None
    soft = vision.encode(run.plan.images)
    run.tally.image_seconds = soft.seconds
    return soft


def image_keys(run: Run, soft: SoftTokens | None) -> tuple[ImageKey, ...] | None:
    """Name each image's run of tokens in the prompt by its pixels: a prefix cache's key past it (None without)."""
    if soft is None:
        return None
    return image_keys_of(run.tokens, soft.token_id, [image_digest(image) for image in run.plan.images])
