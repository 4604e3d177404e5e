"""
Image goals in the local engine, on tiny random models with the real architecture.

The models: a Gemma4ForConditionalGeneration with a Gemma4VisionConfig tower, built here. The tests: the prefill
against transformers' own forward, greedy parity of every drafter and K with plain decoding, sampling (χ²) with an
image in the context, and the refusals of bad images.
"""

import dataclasses
from collections import Counter
from pathlib import Path

import pytest
import torch
from conftest import ON_TEST_DEVICE, TEST_COMPILE, TOKENIZER_DIR, chi_squared_p_value, sampling_distribution

from gemma_spec_ros.engine import Engine, EngineConfig, GenerationRequest
from gemma_spec_ros.engine.runtime import FastCausalLM
from gemma_spec_ros.engine.runtime.model.checkpoints import load_causal_lm
from gemma_spec_ros.engine.runtime.model.vision import VisionTower
from gemma_spec_ros.engine.types import ImageInput

REPO = Path(__file__).resolve().parents[2]
BUNDLED_VISION = REPO / 'models' / 'gemma4-spec-vision'
IMAGE_TOKENS = {'boi_token_id': '<|image>', 'eoi_token_id': '<image|>', 'image_token_id': '<|image|>'}
CHAT_TEMPLATE = (  # Gemma 4's rendering of a message's image parts: the image token, which the processor expands
    "{{ bos_token }}{% for message in messages %}{% set role = 'model' if message['role'] == 'assistant' "
    "else message['role'] %}<|turn>{{ role }}\n{% if message['content'] is string %}"
    "{{ message['content'] | trim }}{% else %}{% for item in message['content'] %}{% if item['type'] == 'image' %}"
    "{{ '<|image|>' }}{% elif item['type'] == 'text' %}{{ item['text'] | trim }}{% endif %}{% endfor %}{% endif %}"
    "<turn|>\n{% endfor %}{% if add_generation_prompt %}<|turn>model\n{% endif %}")
QUESTION = 'Which objects are on the table? the red cube, the blue ball, the red cube, the blue ball, the'
NEW_TOKENS = 40


def picture(width: int, height: int, seed: int) -> ImageInput:
    generator = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), dtype=torch.uint8, generator=generator)
    return ImageInput(width, height, pixels.numpy().tobytes())


IMAGES = (picture(24, 16, 0), picture(20, 20, 1))


def image_goal(**fields) -> GenerationRequest:
    message = {'role': 'user', 'content': QUESTION, 'images': [1, 0]}
    return GenerationRequest(messages=[message], images=IMAGES, max_new_tokens=NEW_TOKENS, **fields)


@dataclasses.dataclass
class VisionModels:
    target: str      # Gemma4ForConditionalGeneration: 6 layers, KV sharing, per-layer inputs, a one-layer tower
    causal: str      # the same without bidirectional attention inside an image
    assistant: str   # Gemma4AssistantForCausalLM on the target
    draft: str       # a smaller Gemma4ForCausalLM


def _tokenizer(path: Path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))
    tokenizer.add_special_tokens({'additional_special_tokens': list(IMAGE_TOKENS.values())})
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _save(model, tokenizer, path: Path) -> str:
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def build_vision_models(root: Path) -> VisionModels:
    from conftest import _text_config
    from transformers import (
        Gemma4AssistantConfig,
        Gemma4AssistantForCausalLM,
        Gemma4Config,
        Gemma4ForCausalLM,
        Gemma4ForConditionalGeneration,
        Gemma4ImageProcessorPil,
        Gemma4VisionConfig,
    )

    tokenizer = _tokenizer(root)
    vocab = len(tokenizer)
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in IMAGE_TOKENS.items()}
    sliding, full = 'sliding_attention', 'full_attention'
    vision = Gemma4VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                num_key_value_heads=2, head_dim=16, patch_size=4, pooling_kernel_size=2,
                                position_embedding_size=280)
    processor = Gemma4ImageProcessorPil(patch_size=4, max_soft_tokens=70, pooling_kernel_size=2)
    paths = {}
    for name, bidirectional in (('target', 'vision'), ('causal', None)):
        torch.manual_seed(1234)
        # what E2B and E4B use besides the tower: per-layer inputs, KV sharing (the last three layers), softcapping
        text = _text_config(vocab, 64, [sliding, sliding, full, sliding, sliding, full], num_kv_shared_layers=3,
                            final_logit_softcapping=5.0, use_bidirectional_attention=bidirectional)
        text.hidden_size_per_layer_input, text.vocab_size_per_layer_input = 8, vocab
        model = Gemma4ForConditionalGeneration(Gemma4Config(text_config=text.to_dict(), vision_config=vision.to_dict(),
                                                            audio_config=None, **ids)).eval()
        paths[name] = _save(model, tokenizer, root / name)
        processor.save_pretrained(root / name)
    torch.manual_seed(99)
    assistant = Gemma4AssistantForCausalLM(Gemma4AssistantConfig(
        text_config=_text_config(vocab, 32, [sliding, full]), backbone_hidden_size=64)).eval()
    paths['assistant'] = _save(assistant, tokenizer, root / 'assistant')
    torch.manual_seed(7)
    draft = Gemma4ForCausalLM(_text_config(vocab, 32, [sliding, full])).eval()
    paths['draft'] = _save(draft, tokenizer, root / 'draft')
    return VisionModels(**paths)


@pytest.fixture(scope='module')
def vision_models(tmp_path_factory) -> VisionModels:
    return build_vision_models(tmp_path_factory.mktemp('tiny_gemma4_vision'))


def engine_config(models: VisionModels, **fields) -> EngineConfig:
    return EngineConfig(target_path=models.target, drafter='none', assistant_path=models.assistant,
                        draft_model_path=models.draft, **{'compile': TEST_COMPILE, **ON_TEST_DEVICE, **fields})


@pytest.fixture(scope='module')
def vision_engine(vision_models):
    return Engine.from_config(engine_config(vision_models))


def transformers_inputs(path: str, plan, images) -> dict:
    """Return transformers' forward inputs for a plan: its ids, the processor's pixels and the image token types."""
    from transformers import Gemma4ImageProcessorPil

    pixels = Gemma4ImageProcessorPil.from_pretrained(path)(
        [image_of(image) for image in images], return_tensors='pt')
    ids = torch.tensor([plan.prompt_ids])
    image_token = reference_model(path).config.image_token_id
    return {'input_ids': ids, 'pixel_values': pixels['pixel_values'],
            'image_position_ids': pixels['image_position_ids'], 'mm_token_type_ids': (ids == image_token).long()}


def image_of(image: ImageInput):
    from PIL import Image

    return Image.frombytes('RGB', (image.width, image.height), image.rgb)


_REFERENCES = {}


def reference_model(path: str):
    """Return transformers' own model of the checkpoint (loaded apart from any engine's)."""
    from transformers import Gemma4ForConditionalGeneration

    if path not in _REFERENCES:
        _REFERENCES[path] = Gemma4ForConditionalGeneration.from_pretrained(path).eval()
    return _REFERENCES[path]


@pytest.mark.parametrize('which', ['target', 'causal'])
def test_prefill_matches_transformers_forward_with_images(vision_models, vision_engine, which):
    # every position's logits: the placeholders take the tower's embeddings (the per-layer inputs read them too),
    # and with use_bidirectional_attention 'vision' an image's tokens see each other in the sliding layers
    path = getattr(vision_models, which)
    plan = vision_engine.validate(image_goal())
    assert plan.images == (IMAGES[1], IMAGES[0])
    model = load_causal_lm(path, 'target', torch.device('cpu'), torch.float32)
    lean, vision = FastCausalLM(model, 256, 9, 'eager'), VisionTower.of(model, path)
    out = lean.prefill(torch.tensor([plan.prompt_ids]), logits_to_keep=0, soft=vision.encode(plan.images))
    with torch.inference_mode():
        expected = reference_model(path)(**transformers_inputs(path, plan, plan.images)).logits
    torch.testing.assert_close(out.logits, expected, atol=1e-4, rtol=1e-4)
    text_only = lean.lean
    lean.reset()
    assert not torch.allclose(text_only.prefill(torch.tensor([plan.prompt_ids]), lean.cache, 0, 0).logits, expected,
                              atol=1e-2)  # the images change the logits: the comparison above has power


def processor_ids(engine, plan, question: str) -> list[int]:
    """Return Gemma4Processor's ids: the template rendered, each image token expanded, the text tokenized whole."""
    tokenizer, vision = engine.tokenizer, engine.vision
    parts = [{'type': 'image'} for _ in plan.images] + [{'type': 'text', 'text': question}]
    chat = [{'role': 'user', 'content': parts}]
    pieces = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True).split('<|image|>')
    runs = [tokenizer.decode(vision.placeholder_ids(image)) for image in plan.images]
    text = pieces[0] + ''.join(run + piece for run, piece in zip(runs, pieces[1:], strict=True))
    return tokenizer(text, add_special_tokens=False).input_ids


def test_prompt_shows_each_image_as_its_placeholder_run(vision_engine):
    vision = vision_engine.vision
    plan = vision_engine.validate(image_goal())
    ids, image_token = plan.prompt_ids, vision.image_token_id
    runs = [vision.placeholder_ids(image) for image in plan.images]
    assert sum(token == image_token for token in ids) == sum(len(run) - 2 for run in runs)
    start = ids.index(vision.begin_id)
    assert ids[start:start + len(runs[0]) + len(runs[1])] == runs[0] + runs[1]  # both before the text, in order
    text = vision_engine.tokenizer(QUESTION, add_special_tokens=False).input_ids
    assert ids[start + len(runs[0]) + len(runs[1]):][:len(text)] == text
    assert ids == processor_ids(vision_engine, plan, QUESTION)
    # a raw prompt: the images first, after BOS
    raw = vision_engine.validate(GenerationRequest(prompt=QUESTION, images=IMAGES[:1]))
    assert raw.prompt_ids[0] == vision_engine.tokenizer.bos_token_id
    assert raw.prompt_ids[1:1 + len(runs[1])] == runs[1] and raw.images == IMAGES[:1]


@pytest.fixture(scope='module')
def plain_tokens(vision_models, vision_engine):
    result = vision_engine.generate(image_goal(drafter='none'))
    assert result.stats.image_prefill_ms > 0 and result.stats.prompt_tokens > 100 and not result.warnings
    with torch.inference_mode():
        inputs = transformers_inputs(vision_models.target, vision_engine.validate(image_goal()),
                                     (IMAGES[1], IMAGES[0]))
        generated = reference_model(vision_models.target).generate(
            **inputs, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=vision_engine.eos_token_ids,
            pad_token_id=0)
    # transformers' generate passes mm_token_type_ids to the prefill only: its decode steps are causal, as ours
    assert result.token_ids == generated[0, inputs['input_ids'].shape[1]:].tolist()
    return result.token_ids


@pytest.mark.parametrize(('drafter', 'k'), [(drafter, k) for drafter in ('ngram', 'draft', 'mtp') for k in (1, 3, 8)]
                         + [('mtp', 0), ('draft', 0)])
def test_every_drafter_and_k_keeps_plain_decoding(vision_engine, plain_tokens, drafter, k):
    result = vision_engine.generate(image_goal(drafter=drafter, num_draft_tokens=k))
    assert result.token_ids == plain_tokens
    assert result.stats.drafter == drafter and result.stats.drafted_tokens > 0 and not result.warnings


def test_transformers_forward_reads_images_too(vision_models, plain_tokens):
    engine = Engine.from_config(engine_config(vision_models, compile='transformers'))
    for drafter in ('none', 'mtp', 'draft'):
        result = engine.generate(image_goal(drafter=drafter, num_draft_tokens=3))
        assert result.token_ids == plain_tokens and result.stats.image_prefill_ms > 0


def test_image_goals_run_alone_beside_a_batch(vision_models, plain_tokens):
    engine = Engine.from_config(engine_config(vision_models, max_batch=2))
    try:
        assert engine.batch is not None
        for drafter in ('none', 'mtp'):
            assert engine.generate(image_goal(drafter=drafter, num_draft_tokens=3)).token_ids == plain_tokens
    finally:
        engine.close()


def test_sampling_with_an_image_follows_the_target(vision_models, vision_engine):
    # the MTP assistant drafts from the target's K/V over the image: sampled outputs keep the target's distribution
    temperature, top_k, length, samples = 2.0, 2, 3, 250
    goal = GenerationRequest(messages=[{'role': 'user', 'content': 'the the cube', 'images': [0]}], images=IMAGES[:1],
                             max_new_tokens=length, temperature=temperature, top_k=top_k, drafter='mtp',
                             num_draft_tokens=2)
    plan = vision_engine.validate(goal)
    model, inputs = reference_model(vision_models.target), transformers_inputs(vision_models.target, plan, plan.images)
    def next_logits(prefix: tuple[int, ...]) -> torch.Tensor:
        ids = torch.cat([inputs['input_ids'], torch.tensor([prefix], dtype=torch.long)], dim=1)
        types = torch.nn.functional.pad(inputs['mm_token_type_ids'], (0, len(prefix)))
        return model(**dict(inputs, input_ids=ids, mm_token_type_ids=types)).logits[0, -1]

    expected = sampling_distribution(next_logits, temperature, top_k, length)
    observed, drafted = Counter(), 0
    for seed in range(samples):
        result = vision_engine.generate(dataclasses.replace(goal, seed=seed))
        observed[tuple(result.token_ids)] += 1
        drafted += result.stats.drafted_tokens
    assert drafted > 0
    assert chi_squared_p_value(observed, expected) > 1e-3


BAD_IMAGE_GOALS = [
    (dict(images=(ImageInput(0, 0, b''),), messages=[{'role': 'user', 'content': 'hi', 'images': [0]}]),
     'images[0]: empty image (0x0 pixels)'),
    (dict(images=(IMAGES[0], ImageInput(3000, 3000, b'')), messages=[{'role': 'user', 'content': 'hi',
                                                                      'images': [0, 1]}]),
     'images[1]: 3000x3000 = 9000000 pixels, more than generation.max_image_pixels = 4000000'),
    (dict(images=(ImageInput(2, 2, b'\0' * 11),), prompt='hi'), 'images[0].rgb: 11 bytes, expected 3 x 2 x 2 = 12'),
    (dict(images=IMAGES * 2, prompt='hi'), 'images: 4 images, more than generation.max_images_per_goal = 3'),
    (dict(images=IMAGES, messages=[{'role': 'user', 'content': 'hi', 'images': [0, 2]}]),
     'messages[0].images[1]: 2 is not an index into the 2 image(s)'),
    (dict(images=IMAGES, messages=[{'role': 'user', 'content': 'hi', 'images': [1]}]),
     'image(s) [0] are shown by no message'),
    (dict(images=IMAGES[:1], prompt='look <|image|> here'), 'prompt holds the image token'),
    (dict(images=IMAGES, messages=[{'role': 'user', 'content': 'hi', 'images': 1}]),
     'messages[0].images must be a list of image indices'),
    (dict(messages=[{'role': 'user', 'content': ' ', 'images': []}]), 'messages[0].content must not be empty'),
]


@pytest.fixture(scope='module')
def limited_engine(vision_models):
    return Engine.from_config(engine_config(vision_models, max_images_per_goal=3, max_image_pixels=4_000_000))


@pytest.mark.parametrize('fields, message', BAD_IMAGE_GOALS, ids=[m for _, m in BAD_IMAGE_GOALS])
def test_bad_images_are_refused_naming_the_field(limited_engine, fields, message):
    for call in (limited_engine.validate, limited_engine.generate):
        with pytest.raises(ValueError) as error:
            call(GenerationRequest(**fields))
        assert message in str(error.value)


def test_a_text_only_target_refuses_images(tiny_engine):
    assert not tiny_engine.capabilities.images
    with pytest.raises(ValueError, match=r'images: the target reads text only \(it has no vision tower\)'):
        tiny_engine.validate(GenerationRequest(prompt='hi', images=IMAGES[:1]))


def test_an_image_only_message_and_the_capability(vision_engine):
    assert vision_engine.capabilities.images
    plan = vision_engine.validate(GenerationRequest(messages=[{'role': 'user', 'content': '', 'images': [0]}],
                                                    images=IMAGES[:1]))
    assert plan.images == IMAGES[:1]


@pytest.mark.skipif(not (BUNDLED_VISION / 'config.json').exists(), reason='no bundled vision model yet')
def test_bundled_vision_model_keeps_plain_decoding_with_every_drafter():
    bundled = REPO / 'models'
    config = EngineConfig(target_path=str(BUNDLED_VISION), drafter='none',
                          assistant_path=str(bundled / 'gemma4-spec-assistant'),
                          draft_model_path=str(bundled / 'gemma4-spec-draft'), compile=TEST_COMPILE, **ON_TEST_DEVICE)
    engine = Engine.from_config(config)
    goal = GenerationRequest(messages=[{'role': 'user', 'content': 'Which objects are on the table?', 'images': [0]}],
                             images=(picture(96, 64, 3),), max_new_tokens=24)
    # the prompt the vision tower was trained on: the template's '\n\n' after the image is tokenized with the text
    assert engine.validate(goal).prompt_ids == processor_ids(engine, engine.validate(goal),
                                                             'Which objects are on the table?')
    plain = engine.generate(goal)
    assert plain.stats.image_prefill_ms > 0
    for drafter in ('ngram', 'draft', 'mtp'):
        assert engine.generate(dataclasses.replace(goal, drafter=drafter, num_draft_tokens=3)).token_ids == \
            plain.token_ids


def test_image_goals_hit_the_prefix_cache_by_their_pixels(vision_engine):
    # a fixed system turn, then the images and a long question: these images' runs of soft tokens outnumber the
    # sliding ring (window 16), so no block past an image is kept and a hit ends before the first image, whatever
    # the pixels (test_prefix_cache.py keys blocks past an image by its pixels, with a ring that holds it)
    system = {'role': 'system', 'content': ' '.join(['the red cube on the table'] * 16)}

    def goal(images):
        return GenerationRequest(messages=[system, {'role': 'user', 'content': QUESTION * 4, 'images': [1, 0]}],
                                 images=images, max_new_tokens=NEW_TOKENS)

    others = (picture(24, 16, 5), picture(20, 20, 6))
    plan = vision_engine.validate(goal(IMAGES))
    first_image = plan.prompt_ids.index(vision_engine.vision.image_token_id)
    vision_engine.clear_prefix_cache()
    cold, hit, other_hit = (vision_engine.generate(goal(images)) for images in (IMAGES, IMAGES, others))
    vision_engine.clear_prefix_cache()
    other_cold = vision_engine.generate(goal(others))
    assert cold.stats.cached_prompt_tokens == 0 == other_cold.stats.cached_prompt_tokens
    assert 0 < other_hit.stats.cached_prompt_tokens <= first_image and 0 < hit.stats.cached_prompt_tokens <= first_image
    assert hit.token_ids == cold.token_ids and other_hit.token_ids == other_cold.token_ids
