"""Image goals' conversions (ros/conversions.py): sensor_msgs images to the engine's RGB ImageInput; each refusal."""

import io

import pytest
from gemma_spec_msgs.action import Generate
from gemma_spec_msgs.msg import ChatMessage
from PIL import Image as PilImage
from sensor_msgs.msg import CompressedImage, Image

from gemma_spec_ros.ros.conversions import (
    ImageLimits,
    compressed_to_input,
    goal_images,
    goal_to_request,
    image_to_input,
)

# a 2x2 picture, row-major: red, green / blue, white
RGB = bytes([255, 0, 0, 0, 255, 0, 0, 0, 255, 255, 255, 255])
LIMITS = ImageLimits(max_images=2, max_pixels=16)


def raw(encoding='rgb8', width=2, height=2, step=None, data=None) -> Image:
    channels = {'rgb8': 3, 'bgr8': 3, 'mono8': 1}.get(encoding, 2)
    step = width * channels if step is None else step
    return Image(encoding=encoding, width=width, height=height, step=step,
                 data=RGB if data is None else data)


def compressed(fmt='png', size=(2, 2), pil_format=None) -> CompressedImage:
    buffer = io.BytesIO()
    PilImage.frombytes('RGB', (2, 2), RGB).resize(size).save(buffer, format=(pil_format or fmt).upper())
    return CompressedImage(format=fmt, data=buffer.getvalue())


def test_rgb8_is_taken_as_it_is():
    image = image_to_input(raw(), 'images[0]', 16)
    assert (image.width, image.height, image.rgb) == (2, 2, RGB)


def test_bgr8_and_mono8_become_rgb():
    bgr = bytes(b for pixel in range(4) for b in reversed(RGB[3 * pixel:3 * pixel + 3]))
    assert image_to_input(raw('bgr8', data=bgr), 'images[0]', 16).rgb == RGB
    mono = image_to_input(raw('mono8', data=bytes([0, 50, 100, 255])), 'images[0]', 16)
    assert mono.rgb == bytes([0, 0, 0, 50, 50, 50, 100, 100, 100, 255, 255, 255])


def test_padded_rows_are_cut_to_the_width():
    padded = RGB[:6] + b'\x07\x07' + RGB[6:] + b'\x07\x07'   # step 8: two padding bytes after each row
    assert image_to_input(raw(step=8, data=padded), 'images[0]', 16).rgb == RGB


@pytest.mark.parametrize('fmt', ['png', 'jpeg', 'rgb8; jpeg compressed bgr8', 'jpg'])
def test_compressed_images_decode_to_rgb(fmt):
    image = compressed_to_input(compressed(fmt, pil_format='jpeg' if 'jp' in fmt else 'png'),
                                'compressed_images[0]', 16)
    assert (image.width, image.height, len(image.rgb)) == (2, 2, 12)
    if fmt == 'png':  # lossless
        assert image.rgb == RGB


BAD_RAW = [
    (raw('yuv422'), "images[1].encoding: 'yuv422' is not one of rgb8, bgr8, mono8"),
    (raw(width=0, data=b''), 'images[1]: empty image (0x2 pixels)'),
    (raw(height=0, data=b''), 'images[1]: empty image (2x0 pixels)'),
    (raw(step=5), 'images[1].step: 5 bytes, less than width 2 x 3 bytes per pixel (rgb8)'),
    (raw(data=RGB[:-1]), 'images[1].data: 11 bytes, expected step 6 x height 2 = 12'),
    (raw(step=8), 'images[1].data: 12 bytes, expected step 8 x height 2 = 16'),
    (raw(width=5, height=4, data=bytes(60)), 'images[1]: 5x4 = 20 pixels, more than generation.max_image_pixels = 16'),
]


@pytest.mark.parametrize('image, expected', BAD_RAW, ids=[e.split(': ', 1)[1][:30] for _, e in BAD_RAW])
def test_bad_raw_image_is_refused_naming_the_field(image, expected):
    with pytest.raises(ValueError) as error:
        image_to_input(image, 'images[1]', LIMITS.max_pixels)
    assert str(error.value) == expected


BAD_COMPRESSED = [
    (CompressedImage(format='bmp', data=b'BM'), "compressed_images[0].format: 'bmp' is not one of jpeg, png"),
    (CompressedImage(format='png', data=b''), 'compressed_images[0].data: empty'),
    (CompressedImage(format='png', data=b'\x89PNG but not really'),
     'compressed_images[0].data: not a readable png image (no known image format)'),
    (compressed('png', pil_format='jpeg'), 'compressed_images[0].data: a jpeg image, but format says png'),
    (compressed('png', size=(5, 4)),
     'compressed_images[0]: 5x4 = 20 pixels, more than generation.max_image_pixels = 16'),
]


@pytest.mark.parametrize('image, expected', BAD_COMPRESSED, ids=[e.split(': ', 1)[1][:30] for _, e in BAD_COMPRESSED])
def test_bad_compressed_image_is_refused_naming_the_field(image, expected):
    with pytest.raises(ValueError) as error:
        compressed_to_input(image, 'compressed_images[0]', LIMITS.max_pixels)
    assert str(error.value).startswith(expected)


def test_a_truncated_png_is_refused():
    whole = compressed('png', size=(4, 4)).data
    with pytest.raises(ValueError, match=r'^compressed_images\[0\]\.data: not a readable png image \(image file is '
                                         r'truncated'):
        compressed_to_input(CompressedImage(format='png', data=whole[:-30]), 'compressed_images[0]', 16)


def test_too_many_images_are_refused_before_decoding():
    unreadable = CompressedImage(format='png', data=b'x')   # never decoded: the count is checked first
    with pytest.raises(ValueError, match=r'^images \+ compressed_images: 3 images, more than '
                                         r'generation.max_images_per_goal = 2$'):
        goal_images([raw(), raw()], [unreadable], LIMITS)


def test_goal_images_count_raw_then_compressed():
    goal = Generate.Goal(messages=[ChatMessage(role='user', content='What is on the table?', image_indices=[1, 0])],
                         images=[raw('mono8', data=bytes(4))], compressed_images=[compressed('png')])
    request = goal_to_request(goal, LIMITS)
    assert request.messages == [{'role': 'user', 'content': 'What is on the table?', 'images': [1, 0]}]
    assert [image.rgb for image in request.images] == [bytes(12), RGB]


def test_text_goal_converts_as_before():
    goal = Generate.Goal(messages=[ChatMessage(role='user', content='hi')], max_new_tokens=3)
    request = goal_to_request(goal, LIMITS)
    assert request.messages == [{'role': 'user', 'content': 'hi'}] and request.images == ()


BAD_INDICES = [
    ([ChatMessage(role='user', content='see', image_indices=[0, 2])], 2,
     'messages[0].image_indices[1]: 2 is not an index into the 2 image(s)'),
    ([ChatMessage(role='user', content='see', image_indices=[0])], 2,
     "image(s) [1] are shown by no message: list them in a message's image_indices"),
    ([ChatMessage(role='user', content='see', image_indices=[0])], 0,
     'messages[0].image_indices[0]: 0 is not an index into the 0 image(s)'),
]


@pytest.mark.parametrize('messages, count, expected', BAD_INDICES, ids=[e[:30] for _, _, e in BAD_INDICES])
def test_image_indices_must_show_every_image_and_no_other(messages, count, expected):
    goal = Generate.Goal(prompt='see', messages=messages, images=[raw()] * count)
    with pytest.raises(ValueError) as error:
        goal_to_request(goal, ImageLimits(max_images=4, max_pixels=16))
    assert str(error.value) == expected


def test_a_prompt_goal_takes_its_images_as_they_are():   # the engine puts them before the prompt's text
    request = goal_to_request(Generate.Goal(prompt='see', images=[raw()]), LIMITS)
    assert request.prompt == 'see' and request.messages is None and request.images[0].rgb == RGB
