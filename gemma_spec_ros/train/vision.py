"""
The bundled multimodal model: a small Gemma 4 vision tower and embedder on the frozen bundled target.

The checkpoint directory holds the Gemma4Config, the vision tower and embedder in ``vision.safetensors``, and a
shard index whose text weights point at the target's file by a relative path
(``../gemma4-spec-target/model.safetensors`` for the bundled pair): the target's weights are
stored once and the text model is the target by construction. That file names its weights as a
Gemma4ForCausalLM does (``model.layers.*``), so loading needs ``key_mapping=SHARED_TEXT_KEY_MAPPING``
(`load_vision_model`); the mapping renames nothing in a real Gemma 4 checkpoint.

Gemma 4's image tokens take the ids of seven byte tokens that valid UTF-8 never produces (0xF9..0xFF), so
they lie inside the target's 4,096-token vocabulary: BOI and EOI are embedded as text (Gemma4Model embeds them;
only the image, video and audio placeholders are swapped for the vision features), and no row is added.
"""

import json
import math
import os
import random
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from PIL import Image
from safetensors.torch import load_file, save_file
from transformers import (
    AutoConfig,
    Gemma4AudioFeatureExtractor,
    Gemma4Config,
    Gemma4ForConditionalGeneration,
    Gemma4ImageProcessorPil,
    Gemma4VisionConfig,
    PreTrainedTokenizerFast,
)

from gemma_spec_ros.train.corpora.scenes import (
    QUESTION_KINDS,
    Question,
    Scene,
    held_out_scene,
    questions,
    render,
    training_scene,
)
from gemma_spec_ros.train.tokenizer import MULTIMODAL_TOKENS, convert_tokenizer

VISION_WEIGHTS = 'vision.safetensors'
# A Gemma4ForCausalLM checkpoint's text weights to Gemma4ForConditionalGeneration's names.
SHARED_TEXT_KEY_MAPPING = {r'^model\.(?=(?:embed_tokens|layers|norm)\.)': 'model.language_model.'}
END_OF_TURN = '<turn|>'


@dataclass(frozen=True)
class VisionShape:
    """
    The vision tower's knobs. 8-pixel patches pooled 2 x 2: a 128 x 128 image is 256 patches, 64 soft tokens.

    Pooling stays on: with pooling_kernel_size 1, transformers 5.24's Gemma4VisionPooler returns the padding mask
    where its caller expects the valid one, and the features come out wrong.
    """

    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int = 4
    patch_size: int = 8
    max_soft_tokens: int = 70       # the smallest budget Gemma4ImageProcessor accepts
    pooling_kernel_size: int = 2

    @classmethod
    def parse(cls, text: str) -> 'VisionShape':
        try:
            layers, hidden, intermediate = (int(part) for part in text.lower().split('x'))
        except ValueError:
            raise ValueError(f"vision shape must look like 'LAYERSxHIDDENxINTERMEDIATE', got {text!r}") from None
        if min(layers, hidden, intermediate) < 1 or hidden % cls.num_heads:
            raise ValueError(f'vision shape sizes must be positive, hidden a multiple of {cls.num_heads}: {text}')
        return cls(layers, hidden, intermediate)

    def config(self) -> Gemma4VisionConfig:
        return Gemma4VisionConfig(
            hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers, num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_heads, head_dim=self.hidden_size // self.num_heads,
            patch_size=self.patch_size, pooling_kernel_size=self.pooling_kernel_size,
            # positions run to the longest side in patches (a one-patch-high strip at most)
            position_embedding_size=self.max_soft_tokens * self.pooling_kernel_size ** 2)

    def image_processor(self) -> Gemma4ImageProcessorPil:
        return Gemma4ImageProcessorPil(patch_size=self.patch_size, max_soft_tokens=self.max_soft_tokens,
                                       pooling_kernel_size=self.pooling_kernel_size)


# ------------------------------------------------------------------------------------------ tokenizer and files
def multimodal_tokenizer(tokenizer_dir: Path, out_dir: Path) -> PreTrainedTokenizerFast:
    """Copy the bundled tokenizer (Gemma 4's image and audio tokens included) into out_dir for Gemma4Processor."""
    tokenizer = convert_tokenizer(tokenizer_dir, out_dir)
    settings = json.loads((out_dir / 'tokenizer_config.json').read_text())
    settings['processor_class'] = 'Gemma4Processor'
    (out_dir / 'tokenizer_config.json').write_text(json.dumps(settings, indent=2) + '\n')
    return tokenizer


def write_processor_config(out_dir: Path, shape: VisionShape, image_seq_length: int) -> None:
    """processor_config.json for Gemma4Processor: its image processor, audio feature extractor and video processor."""
    image = shape.image_processor().to_dict()
    image['image_processor_type'] = 'Gemma4ImageProcessor'
    video = {'video_processor_type': 'Gemma4VideoProcessor', 'patch_size': shape.patch_size,
             'max_soft_tokens': shape.max_soft_tokens, 'pooling_kernel_size': shape.pooling_kernel_size,
             'do_sample_frames': True, 'num_frames': 8}
    config = {'processor_class': 'Gemma4Processor', 'image_seq_length': image_seq_length,
              'image_processor': image, 'video_processor': video,
              'feature_extractor': Gemma4AudioFeatureExtractor().to_dict()}
    (out_dir / 'processor_config.json').write_text(json.dumps(config, indent=2, sort_keys=True, default=str) + '\n')


# ------------------------------------------------------------------------------------------------------ model
def multimodal_config(target_dir: Path, shape: VisionShape, tokenizer) -> Gemma4Config:
    text = AutoConfig.from_pretrained(str(target_dir))
    if text.model_type != 'gemma4_text':
        raise ValueError(f'{target_dir} is a {text.model_type!r} model; the vision model needs a Gemma4ForCausalLM')
    ids = {name: tokenizer.convert_tokens_to_ids(content) for name, (content, _) in MULTIMODAL_TOKENS.items()}
    return Gemma4Config(text_config=text.to_dict(), vision_config=shape.config().to_dict(), audio_config=None,
                        boi_token_id=ids['boi_token'], eoi_token_id=ids['eoi_token'],
                        image_token_id=ids['image_token'], boa_token_id=ids['boa_token'],
                        eoa_token_index=ids['eoa_token'], audio_token_id=ids['audio_token'],
                        video_token_id=ids['video_token'], dtype='float32')


def build_model(target_dir: Path, config: Gemma4Config, output_scale: float) -> Gemma4ForConditionalGeneration:
    """Build a fresh vision tower and embedder on the target's weights, the text model frozen."""
    model = Gemma4ForConditionalGeneration(config)
    text_weights = {name.replace('model.', 'model.language_model.', 1): tensor.float()
                    for name, tensor in load_file(target_dir / 'model.safetensors').items()}
    missing, unexpected = model.load_state_dict(text_weights, strict=False)
    untouched = [n for n in missing if not n.startswith(('model.vision_tower.', 'model.embed_vision.', 'lm_head.'))]
    if untouched or unexpected:
        raise ValueError(f'the target does not fit the text model: missing {untouched[:3]}, unexpected '
                         f'{unexpected[:3]}')
    model.tie_weights()
    model.model.language_model.requires_grad_(False)
    model.lm_head.requires_grad_(False)
    _scale_embedder_outputs(model, output_scale)
    return model


def _scale_embedder_outputs(model: Gemma4ForConditionalGeneration, times_text: float) -> None:
    """
    Start the soft tokens at times_text x the RMS of the target's scaled token embeddings (the input is unit RMS).

    The frozen target is a weak, non-chat model; soft tokens of text size barely move its answers (the loss stayed
    near 6 nats). Larger ones keep their direction through the pre-norm residual stream of all 12 layers, which
    steers it like a prefix.
    """
    text = model.model.language_model.embed_tokens
    rms = (text.weight.float().pow(2).mean() ** 0.5 * text.embed_scale).item()
    projection = model.model.embed_vision.embedding_projection
    torch.nn.init.normal_(projection.weight, std=times_text * rms / math.sqrt(projection.in_features))


def load_tower(model: Gemma4ForConditionalGeneration, vision_dir: Path) -> None:
    """Load a vision model directory's tower and embedder (vision.safetensors) into model; the text stays."""
    weights = {name: tensor.float() for name, tensor in load_file(vision_dir / VISION_WEIGHTS).items()}
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if unexpected or any(name.startswith(('model.vision_tower.', 'model.embed_vision.')) for name in missing):
        raise ValueError(f'{vision_dir} does not fit this vision shape: unexpected {unexpected[:3]}')


def load_vision_model(path: Path, dtype: torch.dtype = torch.float32) -> Gemma4ForConditionalGeneration:
    return Gemma4ForConditionalGeneration.from_pretrained(str(path), key_mapping=SHARED_TEXT_KEY_MAPPING,
                                                          dtype=dtype).eval()


def save_vision_model(model: Gemma4ForConditionalGeneration, out_dir: Path, target_dir: Path, report: dict) -> None:
    """Write config.json, vision.safetensors (float16) and the shard index that takes the text from the target."""
    target_file = target_dir / 'model.safetensors'
    out_dir.mkdir(parents=True, exist_ok=True)
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(str(out_dir))
    model.generation_config.save_pretrained(str(out_dir))
    vision = {name: tensor.detach().to(torch.float16).contiguous() for name, tensor in model.state_dict().items()
              if name.startswith(('model.vision_tower.', 'model.embed_vision.'))}
    save_file(vision, out_dir / VISION_WEIGHTS, metadata={'format': 'pt'})
    # relative, so the pair of directories can move (installed under share/, copied to a robot)
    shared = os.path.relpath(target_file.resolve(), out_dir.resolve())
    weight_map = {name: VISION_WEIGHTS for name in vision}
    weight_map.update({name: shared for name in load_file(target_file)})
    index = {'metadata': {'text_weights': f'{shared}, loaded with key_mapping=SHARED_TEXT_KEY_MAPPING'},
             'weight_map': dict(sorted(weight_map.items()))}
    (out_dir / 'model.safetensors.index.json').write_text(json.dumps(index, indent=2) + '\n')
    (out_dir / 'training.json').write_text(json.dumps(report, indent=2) + '\n')


# ------------------------------------------------------------------------------------------------------- data
@dataclass
class Encoded:
    input_ids: torch.Tensor          # (batch, length), right-padded with <pad>
    attention_mask: torch.Tensor
    labels: torch.Tensor             # -100 except the answer and its <turn|>
    pixel_values: torch.Tensor
    image_position_ids: torch.Tensor


class SceneEncoder:
    """Prompts as Gemma4Processor builds them: the chat template, then <|image|> -> BOI, soft tokens, EOI."""

    def __init__(self, tokenizer, image_processor):
        self.tokenizer = tokenizer
        self.image_processor = image_processor

    def prompt_ids(self, question: str, soft_tokens: int) -> list[int]:
        messages = [{'role': 'user', 'content': [{'type': 'image'}, {'type': 'text', 'text': question}]}]
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        tokens = self.tokenizer
        text = text.replace(tokens.image_token, tokens.boi_token + tokens.image_token * soft_tokens + tokens.eoi_token)
        return tokens(text, add_special_tokens=False).input_ids

    def encode(self, images: list[Image.Image], asked: list[tuple[str, str | None]]) -> Encoded:
        """Encode images with (question, answer) pairs; answer None leaves the prompt open (for generation)."""
        pixels = self.image_processor(images, return_tensors='pt')
        rows, labels = [], []
        for soft_tokens, (question, answer) in zip(pixels['num_soft_tokens_per_image'], asked, strict=True):
            prompt = self.prompt_ids(question, int(soft_tokens))
            reply = [] if answer is None else self.tokenizer(answer + END_OF_TURN, add_special_tokens=False).input_ids
            rows.append(prompt + reply)
            labels.append([-100] * len(prompt) + reply)
        width = max(map(len, rows))
        pad = self.tokenizer.pad_token_id
        if any(a is None for _, a in asked) and len(set(map(len, rows))) > 1:
            raise ValueError('open prompts (for generation) must have equal lengths; encode them one at a time')
        return Encoded(torch.tensor([r + [pad] * (width - len(r)) for r in rows]),
                       torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows]),
                       torch.tensor([lab + [-100] * (width - len(lab)) for lab in labels]),
                       pixels['pixel_values'], pixels['image_position_ids'])


def training_batch(encoder: SceneEncoder, rng: random.Random, scenes: int, kinds: tuple[str, ...]) -> Encoded:
    """Every question of each scene (of kinds): each step shows every kind, which the answers must tell apart."""
    images, asked = [], []
    for scene in (training_scene(rng) for _ in range(scenes)):
        image = render(scene)
        for question in (q for q in questions(scene) if q.kind in kinds):
            images.append(image)
            asked.append((question.text, question.answer))
    return encoder.encode(images, asked)


def vision_step(model: Gemma4ForConditionalGeneration, encoder: SceneEncoder, scenes: int, seed: int,
                kinds: tuple[str, ...]):
    if not kinds or set(kinds) - set(QUESTION_KINDS):
        raise ValueError(f'question kinds must be some of {QUESTION_KINDS}, got {kinds}')

    def step(index: int) -> tuple[torch.Tensor, int]:
        batch = training_batch(encoder, random.Random(f'{seed} {index}'), scenes, kinds)
        hidden = model.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                             pixel_values=batch.pixel_values,
                             image_position_ids=batch.image_position_ids).last_hidden_state
        answered = batch.labels[:, 1:] != -100   # the LM head only where a loss is taken
        logits = model.lm_head(hidden[:, :-1][answered])
        losses = F.cross_entropy(logits.float(), batch.labels[:, 1:][answered], reduction='none')
        # every question counts alike: a listing of three objects is 15 tokens, a yes 2
        per_token = answered.sum(dim=1, keepdim=True).expand_as(answered)[answered]
        return (losses / per_token).sum() / len(answered), int(batch.attention_mask.sum())
    return step


# ------------------------------------------------------------------------------------------------- evaluation
@torch.no_grad()
def answer(model: Gemma4ForConditionalGeneration, encoder: SceneEncoder, image: Image.Image, question: str,
           max_new_tokens: int = 16) -> str:
    """Answer greedily with transformers' generate; special tokens dropped."""
    batch = encoder.encode([image], [(question, None)])
    out = model.generate(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                         pixel_values=batch.pixel_values, image_position_ids=batch.image_position_ids,
                         max_new_tokens=max_new_tokens, do_sample=False)
    return encoder.tokenizer.decode(out[0, batch.input_ids.shape[1]:], skip_special_tokens=True).strip()


@dataclass
class HeldOutResult:
    exact_match: dict[str, float]    # by question kind, and 'all'
    examples: list[dict]             # the first few (question, answer, given)


def held_out_accuracy(model, encoder: SceneEncoder, scenes: int, first_seed: int = 0) -> HeldOutResult:
    """Exact match of greedy answers on every question of held-out scenes first_seed .. first_seed + scenes - 1."""
    right: dict[str, list[bool]] = {}
    examples = []
    for seed in range(first_seed, first_seed + scenes):
        scene: Scene = held_out_scene(seed)
        image = render(scene)
        for question in questions(scene):
            given = answer(model, encoder, image, question.text)
            right.setdefault(question.kind, []).append(given == question.answer)
            if len(examples) < 10:
                examples.append({'seed': seed, 'question': question.text, 'answer': question.answer, 'given': given})
    every = [hit for hits in right.values() for hit in hits]
    rates = {kind: round(sum(hits) / len(hits), 3) for kind, hits in sorted(right.items())}
    return HeldOutResult({**rates, 'all': round(sum(every) / len(every), 3)}, examples)


def demo_example(seed: int, kind: str = 'door') -> tuple[Image.Image, Question]:
    """
    Return a held-out scene's image and its question of kind, with the right answer.

    The door question is the default: the bundled model answers it right on every held-out scene it was checked
    on; its listing of objects is never right (models/README.md has the accuracy of each kind).
    """
    scene = held_out_scene(seed)
    asked = [q for q in questions(scene) if q.kind == kind]
    if not asked:
        raise ValueError(f'held-out scene {seed} has no {kind!r} question (kinds: {QUESTION_KINDS})')
    return render(scene), asked[0]
