"""Image goals on the vLLM backend, without a server: refused with the reason unless vllm.images, else sent as PNG."""

import base64
import io

import pytest
from PIL import Image as PilImage

from gemma_spec_ros.engine.backends.vllm import VllmBackend, VllmConfig
from gemma_spec_ros.engine.types import EngineConfig, GenerationRequest, ImageInput

PIXELS = bytes([255, 0, 0, 0, 255, 0, 0, 0, 255, 255, 255, 255])   # 2x2: red, green / blue, white
IMAGE = ImageInput(2, 2, PIXELS)


def backend(images: bool) -> VllmBackend:
    return VllmBackend(EngineConfig(), VllmConfig(url='http://127.0.0.1:9', model='target', images=images))


def image_goal(**fields) -> GenerationRequest:
    messages = [{'role': 'system', 'content': 'You see for a robot.'},
                {'role': 'user', 'content': 'What is on the table?', 'images': [0]}]
    return GenerationRequest(**dict(dict(messages=messages, images=(IMAGE,)), **fields))


def test_a_text_only_server_refuses_image_goals_with_the_reason():
    text_only = backend(images=False)
    assert not text_only.capabilities.images
    with pytest.raises(ValueError, match=r'^images: vllm.images is false: the vLLM server at http://127.0.0.1:9 is '
                                         r'taken to serve a text-only model'):
        text_only.validate(image_goal())
    text_only.validate(GenerationRequest(messages=[{'role': 'user', 'content': 'hi'}]))   # text goals still pass


def test_images_go_before_their_message_text_as_png_data_urls():
    multimodal = backend(images=True)
    assert multimodal.capabilities.images and multimodal.capabilities.image_refusal == ''
    path, body = multimodal.request_body(multimodal.validate(image_goal()))
    assert path == '/v1/chat/completions'
    assert body['messages'][0] == {'role': 'system', 'content': 'You see for a robot.'}
    image_part, text_part = body['messages'][1]['content']
    assert text_part == {'type': 'text', 'text': 'What is on the table?'}
    prefix, encoded = image_part['image_url']['url'].split(',', 1)
    assert image_part['type'] == 'image_url' and prefix == 'data:image/png;base64'
    with PilImage.open(io.BytesIO(base64.b64decode(encoded))) as sent:
        assert (sent.format, sent.size, sent.convert('RGB').tobytes()) == ('PNG', (2, 2), PIXELS)


@pytest.mark.parametrize('fields, expected', [
    (dict(messages=[{'role': 'user', 'content': 'see', 'images': [1]}]),
     r'^messages\[0\]\.images\[0\]: 1 is not an index into the 1 image\(s\)$'),
    (dict(messages=None, prompt='see'), '^images need chat messages that show them'),
    (dict(images=(ImageInput(2, 2, PIXELS[:-1]),)), r'^images\[0\]\.rgb: 11 bytes, expected 3 x 2 x 2 = 12$'),
    (dict(images=(IMAGE,) * 5), r'^images: 5 images, more than generation.max_images_per_goal = 4$'),
])
def test_bad_images_are_refused_naming_the_field(fields, expected):
    with pytest.raises(ValueError, match=expected):
        backend(images=True).validate(image_goal(**fields))
