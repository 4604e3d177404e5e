"""
The image side of a multimodal target, run eager once per goal before the target's prefill (never when decoding).

VisionTower holds a Gemma4ForConditionalGeneration's vision tower, its embedder and its image processor. An image
becomes soft tokens: the processor resizes it (aspect ratio kept) to at most max_soft_tokens x pooling_kernel_size**2
patches, the tower encodes them and pools each pooling_kernel_size**2 block into one soft token, and the embedder
projects those to the text model's width. In the prompt an image is its placeholder run, as Gemma4Processor writes
it: begin-of-image, one image token per soft token, end-of-image (VisionTower.placeholder_ids). The target's prefill
reads the soft tokens at the image tokens' positions (SoftTokens; model.LeanGemma4.prefill,
causal_lm.DynamicCausalLM.prefill).
"""

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ...types import ImageInput


@dataclass(frozen=True)
class SoftTokens:
    """A goal's images as the target's prefill reads them: features at the positions that hold token_id."""

    token_id: int            # the image token: its positions in the prompt take the features, in order
    features: torch.Tensor   # [image tokens, hidden] the embedder's output
    seconds: float           # what the processor, the tower and the embedder took


class VisionTower:
    """
    Images to soft tokens for a Gemma4ForConditionalGeneration with a vision tower (VisionTower.of).

    Holds the transformers modules (the tower and the embedder, which the lean forward never reads) and the image
    processor of the checkpoint directory (processor_config.json or preprocessor_config.json; without one,
    Gemma4ImageProcessor's defaults at the tower's patch and pooling sizes).
    """

    def __init__(self, model, directory: str):
        config, vision = model.config, model.config.vision_config
        self._model = model.model  # Gemma4Model: get_image_features runs vision_tower and embed_vision only
        self.image_token_id = config.image_token_id
        self.begin_id, self.end_id = config.boi_token_id, config.eoi_token_id
        self.processor = _image_processor(directory, vision)

    @classmethod
    def of(cls, model, directory: str) -> 'VisionTower | None':
        """Return the image side of a loaded target, or None for a target that reads text only."""
        tower = getattr(getattr(model, 'model', None), 'vision_tower', None)
        return None if tower is None else cls(model, directory)

    def soft_token_count(self, width: int, height: int) -> int:
        """Soft tokens of a width x height image (the processor's resize, without touching pixels)."""
        from transformers.models.gemma4.image_processing_pil_gemma4 import get_aspect_ratio_preserving_size

        processor = self.processor
        kernel = processor.pooling_kernel_size
        resized = get_aspect_ratio_preserving_size(height, width, processor.patch_size,
                                                   processor.max_soft_tokens * kernel ** 2, kernel)
        return resized[0] // processor.patch_size * (resized[1] // processor.patch_size) // kernel ** 2

    def placeholder_ids(self, image: ImageInput) -> list[int]:
        """Return an image's run in the prompt: begin-of-image, one image token per soft token, end-of-image."""
        return [self.begin_id] + [self.image_token_id] * self.soft_token_count(image.width, image.height) + \
            [self.end_id]

    @torch.inference_mode()
    def encode(self, images: tuple[ImageInput, ...]) -> SoftTokens:
        """Run the processor, the tower and the embedder on images: their soft tokens, one image after another."""
        from PIL import Image

        started = time.perf_counter()
        pictures = [Image.frombytes('RGB', (image.width, image.height), image.rgb) for image in images]
        batch = self.processor(pictures, return_tensors='np')
        device = self._model.vision_tower.device
        tower_dtype = next(self._model.vision_tower.parameters()).dtype
        pixels = torch.from_numpy(np.asarray(batch['pixel_values'])).to(device, tower_dtype)
        positions = torch.from_numpy(np.asarray(batch['image_position_ids'])).to(device)
        out = self._model.get_image_features(pixels, positions, return_dict=True)
        features = torch.cat(out.pooler_output)  # in the tower's dtype: the model's, as the text embeddings
        expected = sum(self.soft_token_count(image.width, image.height) for image in images)
        if features.shape[0] != expected:  # the placeholder runs were sized by soft_token_count
            raise RuntimeError('the vision tower made {} soft tokens for {} placeholders'.format(
                features.shape[0], expected))
        if device.type == 'cuda':
            torch.cuda.synchronize(device)
        return SoftTokens(self.image_token_id, features, time.perf_counter() - started)


def image_blocks(input_ids: torch.Tensor, token_id: int, ring_size: int) -> torch.Tensor:
    """
    [n, ring_size + n] which of a prefill's sliding-layer pairs lie inside one image's run of token_id.

    input_ids [n] are the new tokens, the keys the ring's ring_size old entries (never an image of this prefill)
    and then the new tokens: what Gemma4Model's mask lets attend both ways with use_bidirectional_attention 'vision'.
    """
    image = input_ids == token_id
    starts = image & ~torch.cat((image.new_zeros(1), image[:-1]))
    run = torch.where(image, starts.cumsum(0), 0)  # k: the k-th image's run, 0: text
    keys = torch.cat((run.new_zeros(ring_size), run))
    return (run[:, None] == keys[None, :]) & (run[:, None] > 0)


def _image_processor(directory: str, vision_config):
    from transformers import Gemma4ImageProcessorPil

    try:
        processor = Gemma4ImageProcessorPil.from_pretrained(directory, local_files_only=True)
    except OSError:  # no processor config beside the weights: Gemma 4's defaults at the tower's sizes
        processor = Gemma4ImageProcessorPil(patch_size=vision_config.patch_size,
                                            pooling_kernel_size=vision_config.pooling_kernel_size)
    for name in ('patch_size', 'pooling_kernel_size'):
        if getattr(processor, name) != getattr(vision_config, name):
            raise ValueError('the image processor in {} has {} {} but the vision tower {}'.format(
                Path(directory), name, getattr(processor, name), getattr(vision_config, name)))
    return processor
