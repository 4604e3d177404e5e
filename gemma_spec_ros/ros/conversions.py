"""Conversions between gemma_spec_msgs and the engine's types. Imports no torch."""

import io
import re
from dataclasses import dataclass

import numpy as np
from gemma_spec_msgs.action import Generate
from gemma_spec_msgs.msg import ToolCall as ToolCallMsg
from PIL import Image as PilImage

from gemma_spec_ros.engine.requests import check_image_count, check_image_indices, check_image_size
from gemma_spec_ros.engine.types import GenerationRequest, GenerationResult, ImageInput, StreamDelta, ToolCall

CHANNELS = {'rgb8': 3, 'bgr8': 3, 'mono8': 1}   # sensor_msgs/Image encodings a goal may send, bytes per pixel
COMPRESSED_FORMATS = ('jpeg', 'png')
# a CompressedImage format is 'jpeg' or 'png', or image_transport's '<encoding>; jpeg compressed <encoding>'
_FORMAT_WORD = re.compile(r'\b(jpeg|jpg|png)\b')
_PIL_FORMATS = {'JPEG': 'jpeg', 'PNG': 'png'}


@dataclass(frozen=True)
class ImageLimits:
    """A goal's bounds on images (the node's generation.max_images_per_goal and generation.max_image_pixels)."""

    max_images: int
    max_pixels: int


def stats_to_msg(stats, msg):
    """Copy engine GenerationStats fields into a gemma_spec_msgs/GenerationStats message (same field names)."""
    for name, kind in msg.get_fields_and_field_types().items():
        value = getattr(stats, name, None)
        if value is None:
            continue
        if kind.startswith('sequence<float'):
            value = [float(v) for v in value]
        elif kind.startswith('float'):
            value = float(value)
        elif kind.startswith('uint') or kind.startswith('int'):
            value = max(0, int(value))
        setattr(msg, name, value)
    return msg


def goal_to_request(goal, limits: ImageLimits) -> GenerationRequest:
    """
    Build a GenerationRequest from the goal's fields as they are (0, '' and -1 mean what the action says).

    Its images are goal.images then goal.compressed_images, decoded to RGB (a message's image_indices count them in
    that order, and must show each); limits bound their count and size before anything is decoded. ValueError
    naming the bad field.
    """
    messages = [message_to_dict(m) for m in goal.messages]
    if messages:   # a raw prompt's images go before its text; messages place theirs
        check_image_indices(messages, len(goal.images) + len(goal.compressed_images), key='image_indices')
    return GenerationRequest(
        prompt='' if messages else goal.prompt, messages=messages or None, max_new_tokens=int(goal.max_new_tokens),
        temperature=float(goal.temperature), top_p=float(goal.top_p), top_k=int(goal.top_k), stop=list(goal.stop),
        seed=int(goal.seed), drafter=goal.drafter, num_draft_tokens=int(goal.num_draft_tokens),
        json_schema=goal.json_schema, grammar=goal.grammar, json_free_whitespace=bool(goal.json_free_whitespace),
        json_schema_unenforced=goal.json_schema_unenforced,
        images=goal_images(goal.images, goal.compressed_images, limits), tools=goal.tools,
        tool_choice=goal.tool_choice, parallel_tool_calls=bool(goal.parallel_tool_calls), thinking=bool(goal.thinking),
        max_thinking_tokens=int(goal.max_thinking_tokens))


def message_to_dict(message) -> dict:
    """
    Return a ChatMessage as the engine's chat turn {role, content}.

    'images' (its image_indices) only when it shows any, 'tool_calls' ({id, name, arguments}) only when it makes
    any, 'name' only when it names a tool (the engine checks them and names the field at fault).
    """
    turn = {'role': message.role, 'content': message.content}
    if len(message.image_indices):
        turn['images'] = [int(index) for index in message.image_indices]
    if len(message.tool_calls):
        turn['tool_calls'] = [{'id': call.id, 'name': call.name, 'arguments': call.arguments}
                              for call in message.tool_calls]
    if message.name:
        turn['name'] = message.name
    return turn


def tool_calls_to_msgs(calls: list[ToolCall]) -> list[ToolCallMsg]:
    """Return the engine's tool calls as gemma_spec_msgs/ToolCall messages."""
    return [ToolCallMsg(id=call.id, name=call.name, arguments=call.arguments) for call in calls]


def goal_images(images, compressed_images, limits: ImageLimits) -> tuple[ImageInput, ...]:
    """Decode a goal's sensor_msgs/Image and CompressedImage lists, in that order; ValueError naming the field."""
    check_image_count(len(images) + len(compressed_images), limits.max_images, 'images + compressed_images')
    return tuple([image_to_input(image, 'images[{}]'.format(i), limits.max_pixels)
                  for i, image in enumerate(images)] +
                 [compressed_to_input(image, 'compressed_images[{}]'.format(i), limits.max_pixels)
                  for i, image in enumerate(compressed_images)])


def image_to_input(image, field: str, max_pixels: int) -> ImageInput:
    """
    Decode a sensor_msgs/Image (rgb8, bgr8 or mono8) to RGB; rows may be padded (step > width x bytes per pixel).

    field names the image in errors, e.g. 'images[1]'.
    """
    channels = CHANNELS.get(image.encoding)
    if channels is None:
        raise ValueError('{}.encoding: {!r} is not one of {}'.format(field, image.encoding, ', '.join(CHANNELS)))
    width, height, step = int(image.width), int(image.height), int(image.step)
    check_image_size(field, width, height, max_pixels)
    if step < width * channels:
        raise ValueError('{}.step: {} bytes, less than width {} x {} bytes per pixel ({})'.format(
            field, step, width, channels, image.encoding))
    data = bytes(image.data)
    if len(data) != step * height:
        raise ValueError('{}.data: {} bytes, expected step {} x height {} = {}'.format(
            field, len(data), step, height, step * height))
    pixels = np.frombuffer(data, dtype=np.uint8).reshape(height, step)[:, :width * channels]
    pixels = pixels.reshape(height, width, channels)
    if image.encoding == 'bgr8':
        pixels = pixels[:, :, ::-1]
    elif image.encoding == 'mono8':
        pixels = np.repeat(pixels, 3, axis=2)
    return ImageInput(width, height, np.ascontiguousarray(pixels).tobytes())


def compressed_to_input(image, field: str, max_pixels: int) -> ImageInput:
    """Decode a sensor_msgs/CompressedImage (format jpeg or png) to RGB; its size is checked before decoding."""
    match = _FORMAT_WORD.search(image.format.lower())
    if match is None:
        raise ValueError('{}.format: {!r} is not one of {}'.format(field, image.format, ', '.join(COMPRESSED_FORMATS)))
    declared = 'jpeg' if match.group(1) == 'jpg' else match.group(1)
    data = bytes(image.data)
    if not data:
        raise ValueError('{}.data: empty'.format(field))
    try:
        with PilImage.open(io.BytesIO(data)) as decoded:   # reads the header only: the size is known, no pixels yet
            actual = _PIL_FORMATS.get(decoded.format, decoded.format)
            if actual != declared:
                raise ValueError('{}.data: a {} image, but format says {}'.format(field, actual, declared))
            check_image_size(field, decoded.width, decoded.height, max_pixels)
            rgb = decoded.convert('RGB')
    except (OSError, SyntaxError, PilImage.DecompressionBombError) as error:  # PIL's errors for unreadable data
        why = 'no known image format' if isinstance(error, PilImage.UnidentifiedImageError) else str(error)
        raise ValueError('{}.data: not a readable {} image ({})'.format(field, declared, why)) from error
    return ImageInput(rgb.width, rgb.height, rgb.tobytes())


def delta_to_feedback(delta: StreamDelta) -> Generate.Feedback:
    return Generate.Feedback(text_delta=delta.text, token_ids_delta=[int(t) for t in delta.token_ids],
                             tokens_generated=int(delta.tokens_generated), tau=float(delta.tau),
                             reasoning_delta=delta.reasoning, tool_calls_delta=tool_calls_to_msgs(delta.tool_calls))


def result_to_msg(result: GenerationResult | None, error: str = '', finish_reason: str = '') -> Generate.Result:
    """Build the action result; error and finish_reason, when given, override the engine's."""
    msg = Generate.Result()
    if result is not None:
        msg.text, msg.token_ids = result.text, [int(t) for t in result.token_ids]
        msg.finish_reason = result.finish_reason
        stats_to_msg(result.stats, msg.stats)
        msg.warnings = list(result.warnings)
        msg.structure_complete = bool(result.structure_complete)
        msg.reasoning = result.reasoning
        msg.tool_calls = tool_calls_to_msgs(result.tool_calls)
    msg.error = error
    msg.finish_reason = finish_reason or msg.finish_reason
    return msg
