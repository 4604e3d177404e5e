"""The bundled multimodal model loads offline, keeps the target's text weights, and answers held-out scenes."""

from pathlib import Path

import pytest
import torch

from gemma_spec_ros.train import vision
from gemma_spec_ros.train.corpora import scenes

MODELS = Path(__file__).resolve().parents[2] / 'models'
VISION_DIR = MODELS / 'gemma4-spec-vision'
TARGET_DIR = MODELS / 'gemma4-spec-target'


@pytest.fixture(scope='module')
def model():
    torch.set_num_threads(1)
    return vision.load_vision_model(VISION_DIR)


@pytest.fixture(scope='module')
def encoder():
    from transformers import AutoImageProcessor, AutoTokenizer

    return vision.SceneEncoder(AutoTokenizer.from_pretrained(str(VISION_DIR)),
                               AutoImageProcessor.from_pretrained(str(VISION_DIR)))


def test_text_model_is_the_target_unchanged(model):
    from safetensors.torch import load_file

    target = load_file(TARGET_DIR / 'model.safetensors')
    text = model.model.language_model.state_dict()
    assert sorted(text) == sorted(name.removeprefix('model.') for name in target)
    for name, tensor in target.items():
        assert torch.equal(text[name.removeprefix('model.')], tensor.float()), name
    assert model.lm_head.weight.data_ptr() == model.model.language_model.embed_tokens.weight.data_ptr()


def test_text_only_logits_equal_the_targets(model):
    from transformers import Gemma4ForCausalLM

    target = Gemma4ForCausalLM.from_pretrained(str(TARGET_DIR)).eval()
    ids = torch.tensor([[2, 4, 1000, 2000, 3000, 17, 5, 4, 99]])
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, target(input_ids=ids).logits)


def test_image_tokens_lie_inside_the_targets_vocabulary(model, encoder):
    tokenizer, config = encoder.tokenizer, model.config
    vocabulary = config.text_config.vocab_size
    ids = {config.boi_token_id, config.eoi_token_id, config.image_token_id, config.audio_token_id,
           config.video_token_id, config.boa_token_id, config.eoa_token_index}
    assert len(ids) == 7 and max(ids) < vocabulary == len(tokenizer)
    assert tokenizer.convert_tokens_to_ids(tokenizer.image_token) == config.image_token_id
    assert tokenizer.convert_tokens_to_ids(tokenizer.boi_token) == config.boi_token_id
    # plain text encodes as with the bundled tokenizer
    from transformers import AutoTokenizer
    text = 'def f(x):\n    return "þÿ" + x  # ünïcode'
    assert tokenizer(text).input_ids == AutoTokenizer.from_pretrained(str(MODELS / 'tokenizer'))(text).input_ids


def test_prompt_layout_follows_the_chat_template(encoder):
    ids = encoder.prompt_ids('Is the door open?', soft_tokens=64)
    tokenizer = encoder.tokenizer
    text = tokenizer.decode(ids)
    assert text.startswith('<bos><|turn>user\n\n\n<|image>') and text.endswith('<|turn>model\n')
    assert ids.count(tokenizer.image_token_id) == 64
    start = ids.index(tokenizer.convert_tokens_to_ids(tokenizer.boi_token))
    assert ids[start + 65] == tokenizer.convert_tokens_to_ids(tokenizer.eoi_token)


# Held-out scenes whose question the bundled model answers right, with both answers where the kind has two, so
# that a model which ignores the image cannot pass (see the model card for its accuracy over 40 scenes).
ANSWERED = [(0, 'door'), (1, 'door'), (4, 'door')]


@pytest.mark.parametrize(('seed', 'kind'), ANSWERED)
def test_held_out_scene_question_answered_right(model, encoder, seed, kind):
    scene = scenes.held_out_scene(seed)
    assert scenes.is_held_out(scene)
    question = next(q for q in scenes.questions(scene) if q.kind == kind)
    assert vision.answer(model, encoder, scenes.render(scene), question.text) == question.answer


def test_answers_follow_the_image():
    """The chosen scenes do not all share one answer: a model that ignored the image could not pass them all."""
    answers = {next(q.answer for q in scenes.questions(scenes.held_out_scene(seed)) if q.kind == kind)
               for seed, kind in ANSWERED}
    assert len(answers) > 1
