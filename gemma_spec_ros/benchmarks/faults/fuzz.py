"""
Random Generate goals through a goal's planning: each one planned, or refused naming its field; never an internal error.

``python -m gemma_spec_ros.benchmarks.faults.fuzz [--cases 10000] [--seed 0] [--target DIR]``

The strategies (hypothesis) draw every field of gemma_spec_msgs/action/Generate's goal as plain values: a dict by
field name, its chat messages, tool calls and images dicts of their messages' fields. Each field is mostly a usable
value and now and then (1 in WILD) an extreme one: random unicode with the chat format's control tokens, NUL and
the private-use marks the prompt's rendering uses; numbers at their type's ends, NaN and infinities; random JSON,
JSON that is no object, random text as json_schema, grammar and tools; images of random sizes, encodings and
formats, random bytes as pixels or as a compressed image, compressed headers that claim huge sizes.

Two runners share them. test/engine/test_fuzz_goals.py runs the node's whole path on the tests' tiny random models:
the goal message after a ROS serialization round trip, ros/conversions.goal_to_request, Engine.validate. This
module's main runs the engine's half on the bundled models (benchmarks never import the ROS side: setup.cfg's
offline_tools contract): a GenerationRequest of the same fields (its prompt_ids too, which a goal has not), raw
images handed to the engine as they are (ImageInput of their width, height and data), compressed ones left out
(decoding them is the node's), against the bundled vision target, so that images reach the engine's own rules. A
share of the valid plans (1 in GENERATE) generates up to 4 tokens. The table: cases, valid plans, refusals by the
field they name, refusals that name none and internal errors (both must be 0), seconds.
"""

import argparse
import dataclasses
import io
import json
import random
import re
import struct
import sys
import time
import traceback
import zlib
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as seed_of
from hypothesis import strategies as st

from gemma_spec_ros.engine.types import FINISH_REASONS, EngineConfig, GenerationRequest, ImageInput, parameter_name

MODELS = Path(__file__).resolve().parents[3] / 'models'
WILD = 12          # a field takes an extreme value in 1 of WILD goals
GENERATE = 8       # 1 of GENERATE valid plans also generates
GENERATED_TOKENS = 4
UINT32 = 2 ** 32 - 1
INT64 = 2 ** 63

# the fields of gemma_spec_msgs/action/Generate's goal and of the messages in it (test_fuzz_goals checks them)
GOAL_FIELDS = ('prompt', 'messages', 'images', 'compressed_images', 'max_new_tokens', 'temperature', 'top_p', 'top_k',
               'stop', 'seed', 'drafter', 'num_draft_tokens', 'client_id', 'json_schema', 'grammar',
               'json_free_whitespace', 'json_schema_unenforced', 'tools', 'tool_choice', 'parallel_tool_calls',
               'thinking', 'max_thinking_tokens')
MESSAGE_FIELDS = ('role', 'content', 'image_indices', 'tool_calls', 'name')      # gemma_spec_msgs/ChatMessage
TOOL_CALL_FIELDS = ('id', 'name', 'arguments')                                   # gemma_spec_msgs/ToolCall
IMAGE_FIELDS = ('height', 'width', 'encoding', 'is_bigendian', 'step', 'data')   # sensor_msgs/Image (no header)
COMPRESSED_FIELDS = ('format', 'data')                                           # sensor_msgs/CompressedImage
# what a refusal may name: a goal's field (a path into it, e.g. messages[2].tool_calls[0].arguments), a message's
# image_indices, a GenerationRequest's prompt_ids, or the engine parameter the goal breaks (engine.context_limit)
FIELD_NAMES = frozenset(GOAL_FIELDS + ('image_indices', 'prompt_ids'))
PARAMETERS = frozenset(parameter_name(name) for name in EngineConfig.__dataclass_fields__)
_PATH = re.compile(r'(?<![\w.\[])[a-z_]+(?:\[\d+\])*(?:\.[a-z_]+(?:\[\d+\])*)*')
_INDEX = re.compile(r'\[\d+\]')


# ------------------------------------------------------------------------------------------------- strategies
def sometimes(tame, wild, one_in: int = WILD):
    """Draw from tame, and in 1 of one_in draws from wild (shrinking goes to tame)."""
    return st.integers(0, one_in - 1).flatmap(lambda draw: wild if draw == one_in - 1 else tame)


CONTROL = ('<|turn>', '<turn|>', '<|think>', '<|channel>', '<channel|>', '<|tool>', '<tool|>', '<|tool_call>',
           '<tool_call|>', '<|tool_response>', '<tool_response|>', '<|"|>', '<|image>', '<image|>', '<|image|>',
           '<bos>', '<eos>', '<pad>', '<unk>', '<start_of_turn>', '<end_of_turn>', 'call:pick{', '}')
ODD_PIECES = CONTROL + ('\x00', '\ue000', '\ue001', '\ue0000\ue001', '\ue000999\ue001', '{{ x }}', '{%', '\ud7ff',
                        '\U0010ffff', '\u202e', '\r\n', '\t', ' ' * 40, '\\', '"', "'", 'system', 'tool')
PLAIN_TEXT = st.text(max_size=24)
ODD_TEXT = st.lists(st.one_of(st.text(max_size=8), st.sampled_from(ODD_PIECES)), max_size=6).map(''.join)
TEXT = st.one_of(PLAIN_TEXT, ODD_TEXT)    # any string field's random value
LONG_TEXT = st.integers(1, 40000).map(lambda n: 'go ' * n)   # past generation.max_prompt_chars too
WORDS = st.sampled_from(['The robot picked up the red cube and', 'Which objects are on the table?', 'hi',
                         'def add(a, b):\n    return a + b\n', 'Pick up the cup, then place it on the shelf.'])
SOME_TEXT = st.one_of(WORDS, st.text(min_size=1, max_size=24))

FLOAT32 = st.floats(width=32)   # NaN, infinities, subnormals, -0.0 and the ends of float32
# unpaired surrogates: never in a string field (no UTF-8 text holds them), but JSON text escapes them ("\ud800")
SURROGATES = st.sampled_from(['\ud800', '\udfff', 'a\udc00b'])
KEYS = st.one_of(st.sampled_from(['object', 'count', 'gentle', 'x', 'answer']), TEXT, SURROGATES)
NUMBERS = st.one_of(st.integers(-2 ** 70, 2 ** 70), st.floats())
JSON_VALUES = st.recursive(st.none() | st.booleans() | NUMBERS | TEXT | SURROGATES,
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(KEYS, inner, max_size=3),
                           max_leaves=8)
ODD_JSON = st.sampled_from(['null', '1', '"x"', '[]', 'true', '{}', '{', '[1,', 'NaN', '-Infinity', '1e999', '""',
                            '{"a": 1, "a": 2}', '[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]', '\x00', ' '])
# JSON values the readers may choke on, to put into a JSON text: numbers past float or past int()'s digits,
# escaped surrogates, nesting a few levels or thousands deep
DEPTHS = st.one_of(st.sampled_from([10, 63, 64, 65, 200, 1000, 3000]), st.integers(2, 3000))
NESTED = st.builds(lambda depth, level: level[0] * depth + level[1] + level[2] * depth, DEPTHS, st.sampled_from([
    ('[', '1', ']'), ('{"a": ', '{}', '}'), ('{"items": ', '{}', '}'), ('{"anyOf": [', '{}', ']}')]))
ODD_LEAVES = st.one_of(st.sampled_from(['1e400', '-1e400', '1' + '0' * 400, '9' * 5000, '1e-400', '-0', 'NaN',
                                        'Infinity', '"\\ud800"', '"\\udc00x"', '"\\u0000"']), NESTED)


def holes(*templates: str):
    """Draw JSON texts: one of templates with an ODD_LEAVES value in its hole (%s)."""
    return st.sampled_from(templates).flatmap(lambda template: ODD_LEAVES.map(lambda leaf: template % leaf))


JSON_TEXT = st.one_of(JSON_VALUES.map(json.dumps), ODD_JSON, holes('%s', '{"a": %s}', '[%s]'))

SCHEMA_KEYWORDS = ('type', 'properties', 'items', 'enum', 'const', 'minimum', 'maximum', 'exclusiveMinimum',
                   'exclusiveMaximum', 'multipleOf', 'pattern', 'format', 'required', 'anyOf', 'oneOf', 'allOf', 'not',
                   '$ref', '$defs', 'definitions', 'minLength', 'maxLength', 'minItems', 'maxItems', 'uniqueItems',
                   'additionalProperties', 'prefixItems', 'contains', 'patternProperties', 'propertyNames', 'if',
                   'then', 'else', 'dependentRequired', 'minProperties', 'maxProperties', '$schema', 'default',
                   'description', 'title', 'nullable')
SCHEMA_VALUES = st.one_of(
    st.sampled_from(['object', 'string', 'integer', 'number', 'boolean', 'array', 'null', 'int', ['string', 'null'],
                     '#/$defs/a', '#', '^[a-z]+$', '(', '[', 'date-time', 'email', 'uuid', 0, -1, 1e308, 2 ** 64,
                     0.1, True, False, None, [], {}]),
    JSON_VALUES)
SCHEMAS = st.recursive(
    st.sampled_from([{}, {'type': 'string'}, {'type': 'integer'}, {'type': 'boolean'}, {'type': 'null'}, True, False]),
    lambda inner: st.one_of(
        st.dictionaries(st.sampled_from(SCHEMA_KEYWORDS), st.one_of(SCHEMA_VALUES, inner), max_size=4),
        st.builds(lambda props, required: {'type': 'object', 'properties': props, 'required': required},
                  st.dictionaries(KEYS, inner, max_size=3), st.lists(KEYS, max_size=2)),
        st.builds(lambda items, unique: {'type': 'array', 'items': items, 'uniqueItems': unique, 'maxItems': 3},
                  inner, st.booleans()),
        st.lists(inner, min_size=1, max_size=3).map(lambda options: {'anyOf': options})),
    max_leaves=6)
USABLE_SCHEMAS = st.sampled_from([
    {'type': 'object', 'properties': {'answer': {'type': 'string'}}, 'required': ['answer']},
    {'type': 'integer', 'minimum': 0, 'maximum': 9}, {'enum': ['yes', 'no']}, {'type': 'boolean'},
    {'type': 'array', 'items': {'type': 'number'}, 'maxItems': 3}, {'type': 'string', 'pattern': '^[a-z]+$'},
    {'type': 'array', 'items': {'type': 'integer'}, 'uniqueItems': True, 'maxItems': 3},
    {'type': 'object', 'additionalProperties': False}])
JSON_SCHEMA = st.one_of(USABLE_SCHEMAS.map(json.dumps), SCHEMAS.map(json.dumps), JSON_TEXT, TEXT, holes(
    '{"type": "number", "minimum": %s}', '{"type": "integer", "maximum": %s}', '{"enum": [%s]}', '{"const": %s}',
    '{"type": "string", "maxLength": %s}', '{"type": "array", "minItems": %s}', '{"type": "number", "multipleOf": %s}',
    '{"type": "object", "properties": {"a": %s}}', '{"type": "object", "properties": {"a": {"default": %s}}}'))

GRAMMARS = st.sampled_from([
    'root ::= "yes" | "no"', 'root ::= [a-z]+', 'root ::= "a" root | "b"', 'root ::= item ("," item)*\nitem ::= [0-9]',
    'root ::= x', 'rot ::= "a"', 'root ::= ', 'root ::= [', 'root ::= "\\x00"', 'root ::= "<|turn>"', 'root ::= root',
    'root ::= "a"{3,2}', 'root ::= [^]', 'root ::= "\\uD800"', 'root ::= "é" | "🤖"', '::=', 'root ::= ""',
    'root ::= (("a"))*', 'root ::= "a" "b" "c"\nroot ::= "d"'])
GRAMMAR = st.one_of(GRAMMARS, GRAMMARS.flatmap(lambda grammar: TEXT.map(lambda text: grammar + text)), TEXT)

TOOL_NAMES = st.sampled_from(['pick', 'place', 'move_to'])
USABLE_TOOLS = [
    {'name': 'pick', 'description': 'pick an object up', 'parameters': {
        'type': 'object', 'properties': {'object': {'type': 'string'}, 'gentle': {'type': 'boolean'}},
        'required': ['object']}},
    {'type': 'function', 'function': {'name': 'place', 'description': 'put it down', 'parameters': {
        'type': 'object', 'properties': {'x': {'type': 'number'}, 'count': {'type': 'integer', 'minimum': 1}}}}},
    {'name': 'move_to', 'parameters': {'type': 'object', 'properties': {
        'where': {'enum': ['shelf', 'table']}}, 'required': ['where']}}]
TOOL = st.one_of(
    st.fixed_dictionaries({'name': st.one_of(TOOL_NAMES, TEXT)},
                          optional={'description': st.one_of(TEXT, JSON_VALUES),
                                    'parameters': st.one_of(SCHEMAS, JSON_VALUES, st.builds(
                                        lambda props: {'type': 'object', 'properties': props},
                                        st.dictionaries(KEYS, SCHEMAS, max_size=3))),
                                    'strict': st.booleans(), 'parameter': st.just({})}),
    st.sampled_from(USABLE_TOOLS))
TOOLS = st.one_of(
    st.lists(st.sampled_from(USABLE_TOOLS), min_size=1, max_size=3, unique_by=lambda tool: json.dumps(tool)).map(
        json.dumps),
    st.lists(st.one_of(TOOL, TOOL.map(lambda tool: {'type': 'function', 'function': tool}), JSON_VALUES),
             max_size=3).map(json.dumps),
    JSON_TEXT, TEXT, holes(
        '[{"name": "pick", "parameters": {"type": "object", "properties": {"a": {"enum": [%s]}}}}]',
        '[{"name": "pick", "parameters": {"type": "object", "properties": {"a": %s}}}]',
        '[{"name": "pick", "parameters": {"type": "object", "properties": {"a": {"type": "string", '
        '"maxLength": %s}}}}]',
        '[{"name": "pick", "description": %s}]', '[{"name": %s}]'))

ENCODINGS = ('rgb8', 'bgr8', 'mono8')
ODD_ENCODINGS = ('rgba8', 'bgra8', 'mono16', '16UC1', '32FC1', 'bayer_rggb8', 'yuv422', 'RGB8', '', ' rgb8', 'rgb8\x00')
CHANNELS = {'rgb8': 3, 'bgr8': 3, 'mono8': 1}
FORMATS = ('png', 'jpeg')
ODD_FORMATS = ('jpg', 'PNG', 'JPEG', 'rgb8; jpeg compressed bgr8', 'bgr8; png compressed rgb8', 'png jpeg', 'gif',
               'bmp', 'tiff', 'webp', '', 'pngx', 'jpeg2000', 'compressedDepth png')
# (PIL format, mode) pairs PIL writes: what a compressed image's bytes may be, whatever its format says
ENCODED = (('PNG', 'RGB'), ('PNG', 'L'), ('PNG', 'RGBA'), ('PNG', 'P'), ('PNG', '1'), ('PNG', 'I;16'), ('PNG', 'LA'),
           ('PNG', 'I;16B'), ('TIFF', 'I;16'), ('JPEG', 'RGB'), ('JPEG', 'L'), ('JPEG', 'CMYK'), ('GIF', 'P'),
           ('BMP', 'RGB'), ('TIFF', 'F'), ('TIFF', 'RGB'), ('WEBP', 'RGB'), ('ICO', 'RGBA'), ('PPM', 'RGB'))
SMALL_SIDE = st.integers(1, 8)
ANY_SIDE = st.one_of(st.integers(0, UINT32), st.sampled_from([0, 1, 4096, 4097, 65535, 65536, 2 ** 31, UINT32]))


def random_bytes(size: int):
    """Draw size random bytes from one drawn seed (drawing each byte would overrun hypothesis's buffer)."""
    return st.integers(0, UINT32).map(lambda seed: random.Random(seed).randbytes(size))


def encode(kind: str, mode: str, width: int, height: int, seed: int) -> bytes:
    """Return a width x height picture of random pixels in PIL mode, written as kind (PNG, JPEG, ...)."""
    from PIL import Image

    picture = Image.frombytes('RGB', (width, height), random.Random(seed).randbytes(3 * width * height))
    buffer = io.BytesIO()
    picture.convert(mode).save(buffer, format=kind)
    return buffer.getvalue()


def png_claiming(width: int, height: int, depth: int = 8, color: int = 2) -> bytes:
    """Return a PNG whose header claims width x height, no pixels after it (sizes are refused before decoding)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack('>I', len(data)) + kind + data + struct.pack('>I', zlib.crc32(kind + data))

    header = struct.pack('>IIBBBBB', width, height, depth, color, 0, 0, 0)
    return b'\x89PNG\r\n\x1a\n' + chunk(b'IHDR', header) + chunk(b'IDAT', zlib.compress(b'\x00' * 7)) + \
        chunk(b'IEND', b'')


@st.composite
def encoded_images(draw, kinds=ENCODED) -> bytes:
    kind, mode = draw(st.sampled_from(kinds))
    return encode(kind, mode, draw(SMALL_SIDE), draw(SMALL_SIDE), draw(st.integers(0, UINT32)))


@st.composite
def raw_images(draw) -> dict:
    """Draw a sensor_msgs/Image's fields: mostly a small frame of a known encoding, step x height bytes of data."""
    encoding = draw(sometimes(st.sampled_from(ENCODINGS), st.one_of(st.sampled_from(ODD_ENCODINGS), TEXT)))
    width, height = draw(sometimes(SMALL_SIDE, ANY_SIDE)), draw(sometimes(SMALL_SIDE, ANY_SIDE))
    channels = CHANNELS.get(encoding, 3)
    step = min(UINT32, draw(sometimes(st.integers(0, 3).map(lambda pad: width * channels + pad),
                                      st.integers(0, UINT32))))
    size = step * height
    data = draw(sometimes(random_bytes(size) if size <= 1 << 16 else random_bytes(64),
                          st.integers(0, 64).flatmap(random_bytes)))
    return {'height': height, 'width': width, 'encoding': encoding, 'is_bigendian': draw(st.integers(0, 255)),
            'step': step, 'data': data}


@st.composite
def compressed_images(draw) -> dict:
    """Draw a sensor_msgs/CompressedImage's fields: mostly a small PNG or JPEG its format names."""
    format_ = draw(sometimes(st.sampled_from(FORMATS), st.one_of(st.sampled_from(ODD_FORMATS), TEXT)))
    declared = 'JPEG' if 'jp' in format_.lower() else 'PNG'
    valid = encoded_images([(declared, mode) for kind, mode in ENCODED if kind == declared])
    whole = draw(encoded_images())
    odd = st.one_of(
        encoded_images(), st.integers(1, max(1, len(whole) - 1)).map(lambda cut: whole[:cut]),   # truncated
        st.integers(0, len(whole) - 1).map(lambda at: whole[:at] + bytes([whole[at] ^ 0xFF]) + whole[at + 1:]),
        st.integers(0, 64).flatmap(random_bytes), st.just(b''),
        st.builds(png_claiming, ANY_SIDE.map(lambda side: min(side, 2 ** 31 - 1)),
                  ANY_SIDE.map(lambda side: min(side, 2 ** 31 - 1)), st.sampled_from([1, 8, 16]),
                  st.sampled_from([0, 2, 3, 6, 7])))
    return {'format': format_, 'data': draw(sometimes(valid, odd))}


@st.composite
def tool_calls(draw) -> dict:
    """Draw a gemma_spec_msgs/ToolCall's fields: mostly a call of a usable tool with JSON object arguments."""
    arguments = st.dictionaries(st.sampled_from(['object', 'gentle', 'x', 'where']), st.one_of(
        st.sampled_from(['cup', 'shelf', 1, 2.5, True]), JSON_VALUES), max_size=2).map(json.dumps)
    return {'id': draw(sometimes(st.just('call_0'), TEXT)), 'name': draw(sometimes(TOOL_NAMES, TEXT)),
            'arguments': draw(sometimes(arguments, st.one_of(JSON_TEXT, TEXT, holes('{"object": %s}'))))}


@st.composite
def chat_messages(draw, num_images: int = 0) -> dict:
    """Draw a gemma_spec_msgs/ChatMessage's fields: mostly a user, system or assistant turn of plain text."""
    role = draw(sometimes(st.sampled_from(['user', 'user', 'system', 'assistant', 'tool']), TEXT))
    calls = draw(sometimes(st.just([]), st.lists(tool_calls(), max_size=3)))
    indices = draw(sometimes(st.just([]), st.lists(
        st.one_of(st.integers(0, num_images + 1), st.sampled_from([UINT32, 2 ** 31])), max_size=3)))
    return {'role': role, 'content': draw(sometimes(SOME_TEXT, st.one_of(st.just(''), TEXT, LONG_TEXT))),
            'image_indices': indices, 'tool_calls': calls, 'name': draw(sometimes(st.just(''), st.one_of(
                TOOL_NAMES, TEXT)))}


@st.composite
def conversations(draw, num_images: int = 0) -> list[dict]:
    """Draw a goal's messages: none, random turns, or a tool's call and its result; mostly every image shown."""
    plain = {'role': 'user', 'content': draw(SOME_TEXT), 'image_indices': [], 'tool_calls': [], 'name': ''}
    called = [dict(plain), {'role': 'assistant', 'content': '', 'image_indices': [], 'name': '',
                            'tool_calls': [draw(tool_calls())]},
              {'role': 'tool', 'content': draw(st.one_of(JSON_VALUES.map(json.dumps), SOME_TEXT, JSON_TEXT)),
               'image_indices': [], 'tool_calls': [], 'name': draw(st.sampled_from(['', 'pick', 'place']))}]
    messages = draw(st.one_of(st.just([]), st.just([plain]), st.just(called),
                              st.lists(chat_messages(num_images), min_size=1, max_size=4)))
    if messages and num_images and draw(sometimes(st.just(True), st.just(False))):
        messages[0] = dict(messages[0], image_indices=list(range(num_images)))   # every image shown
    return messages


@st.composite
def goals(draw, compressed: bool = True, prompt_ids: bool = False, images_one_in: int = 6) -> dict:
    """
    Draw a Generate goal's fields (GOAL_FIELDS) as plain values, mostly usable, each now and then extreme.

    compressed: draw compressed_images too (the node's path); prompt_ids: add a GenerationRequest's prompt_ids;
    images_one_in: 1 in how many goals have images (and 1 in how many compressed ones).
    """
    images = draw(sometimes(st.just([]), st.lists(raw_images(), min_size=1, max_size=draw(sometimes(
        st.just(2), st.just(6)))), one_in=images_one_in))
    packed = draw(sometimes(st.just([]), st.lists(compressed_images(), min_size=1, max_size=2),
                            one_in=images_one_in)) if compressed else []
    num_images = len(images) + len(packed)
    fields = {
        'prompt': draw(sometimes(SOME_TEXT, st.one_of(st.just(''), TEXT, LONG_TEXT))),
        'messages': draw(conversations(num_images) if num_images else sometimes(
            st.just([]), conversations(), one_in=3)),
        'images': images,
        'compressed_images': packed,
        'max_new_tokens': draw(sometimes(st.integers(0, 24), st.one_of(
            st.integers(0, UINT32), st.sampled_from([2048, 2049, 4096, UINT32])))),
        'temperature': draw(sometimes(st.sampled_from([0.0, 0.0, 0.7, 1.0]), st.one_of(
            FLOAT32, st.sampled_from([2.0, 2.0000002, -0.0, 1e-45, float('nan')])))),
        'top_p': draw(sometimes(st.sampled_from([0.0, 0.9, 1.0]), FLOAT32)),
        'top_k': draw(sometimes(st.sampled_from([0, 40]), st.integers(0, UINT32))),
        'stop': draw(sometimes(st.one_of(st.just([]), st.lists(st.sampled_from(['\n', '.', 'cube']), max_size=2)),
                               st.lists(TEXT, max_size=20))),
        'seed': draw(sometimes(st.one_of(st.just(-1), st.integers(0, 1000)), st.integers(-INT64, INT64 - 1))),
        'drafter': draw(sometimes(st.sampled_from(['', 'none', 'ngram', 'mtp', 'draft']), TEXT)),
        'num_draft_tokens': draw(sometimes(st.integers(0, 8), st.integers(0, UINT32))),
        'client_id': draw(TEXT),
        'json_schema': draw(sometimes(st.just(''), JSON_SCHEMA, one_in=4)),
        'grammar': draw(sometimes(st.just(''), GRAMMAR, one_in=8)),
        'json_free_whitespace': False,   # drawn below: it needs json_schema
        'json_schema_unenforced': draw(sometimes(st.just(''), st.one_of(st.sampled_from(['refuse', 'check', 'Check']),
                                                                         TEXT))),
        'tools': draw(sometimes(st.just(''), TOOLS, one_in=4)),
        'tool_choice': draw(sometimes(st.just(''), st.one_of(st.sampled_from(['auto', 'none', 'required', 'pick',
                                                                                'place']), TEXT), one_in=5)),
        'parallel_tool_calls': draw(sometimes(st.just(True), st.just(False), one_in=3)),
        'thinking': draw(sometimes(st.just(False), st.just(True), one_in=5)),
        'max_thinking_tokens': draw(sometimes(st.just(0), st.one_of(st.integers(1, 64), st.just(UINT32)))),
    }
    fields['json_free_whitespace'] = draw(st.booleans() if fields['json_schema'] else sometimes(
        st.just(False), st.just(True)))
    if prompt_ids:
        fields['prompt_ids'] = draw(sometimes(st.just(None), st.lists(st.one_of(
            st.integers(0, 5000), st.integers(-2 ** 40, 2 ** 40)), max_size=24), one_in=6))
    return fields


# ------------------------------------------------------------------------------------------------- outcomes
def named_field(message: str) -> str | None:
    """
    Return the field a refusal names, indices dropped (messages[].tool_calls[].arguments), or its parameter.

    The path the message opens with when a colon or 'must' follows it ('temperature must ...', 'tools[0].name: ...'),
    else the engine parameter it names ('... exceeds the context limit (engine.context_limit ...'), else the first
    field path in it; None: it names none.
    """
    paths = [match for match in _PATH.finditer(message)
             if re.split(r'[.\[]', match.group())[0] in FIELD_NAMES or match.group() in PARAMETERS]
    if not paths:
        return None
    opening = paths[0].start() == 0 and message[paths[0].end():].startswith((':', ' must'))
    first = paths[0] if opening else next((match for match in paths if match.group() in PARAMETERS), paths[0])
    return _INDEX.sub('[]', first.group())


@dataclasses.dataclass
class Outcome:
    """A goal's planning: its plan, or the refusal's message and the field it names (None: it names none)."""

    plan: object = None
    message: str = ''
    field: str | None = None


def plan_or_refusal(plan_goal: Callable[[], object]) -> Outcome:
    """Run plan_goal(): its plan, or its ValueError (the node's refusal) as a refusal; anything else raises."""
    try:
        return Outcome(plan=plan_goal())
    except ValueError as error:
        return Outcome(message=str(error), field=named_field(str(error)))


def generate_briefly(engine, plan, tokens: int = GENERATED_TOKENS):
    """Generate up to tokens tokens of a valid plan; AssertionError when the result breaks the interface."""
    result = engine.generate(dataclasses.replace(plan, max_new_tokens=min(plan.max_new_tokens, tokens)))
    assert result.finish_reason in FINISH_REASONS, result.finish_reason
    assert len(result.token_ids) <= tokens and isinstance(result.text, str), result
    return result


# ------------------------------------------------------------------------------------------- the engine's half
def engine_request(fields: dict) -> GenerationRequest:
    """Return the goal's fields as the engine's request: raw images as they are, messages as the node makes them."""
    messages = []
    for message in fields['messages']:
        turn = {'role': message['role'], 'content': message['content']}
        if message['image_indices']:
            turn['images'] = list(message['image_indices'])
        if message['tool_calls']:
            turn['tool_calls'] = [dict(call) for call in message['tool_calls']]
        if message['name']:
            turn['name'] = message['name']
        messages.append(turn)
    scalars = {name: fields[name] for name in GOAL_FIELDS
               if name not in ('prompt', 'messages', 'images', 'compressed_images', 'client_id')}
    return GenerationRequest(
        prompt='' if messages else fields['prompt'], messages=messages or None, prompt_ids=fields.get('prompt_ids'),
        images=tuple(ImageInput(image['width'], image['height'], image['data']) for image in fields['images']),
        **scalars)


@dataclasses.dataclass
class Tally:
    """What a fuzz run found."""

    cases: int = 0
    plans: int = 0
    generated: int = 0
    refusals: Counter = dataclasses.field(default_factory=Counter)   # by the field they name
    unnamed: list = dataclasses.field(default_factory=list)         # refusals naming no field
    errors: list = dataclasses.field(default_factory=list)          # internal errors: (fields, traceback)
    seconds: float = 0.0

    def table(self) -> str:
        per_case = self.seconds / self.cases if self.cases else 0.0
        rows = [('cases', self.cases), ('valid plans', self.plans),
                ('... generated (<= {} tokens)'.format(GENERATED_TOKENS), self.generated),
                ('refusals naming a field', sum(self.refusals.values()))]
        rows += [('... ' + field, count) for field, count in sorted(self.refusals.items(),
                                                                    key=lambda item: (-item[1], item[0]))]
        rows += [('refusals naming no field (must be 0)', len(self.unnamed)),
                 ('internal errors (must be 0)', len(self.errors)),
                 ('seconds', '{:.1f} ({:.1f} ms per case)'.format(self.seconds, 1000 * per_case))]
        width = max(len(name) for name, _ in rows)
        return '\n'.join('| {:<{}} | {:>8} |'.format(name, width, value) for name, value in rows)


def run(plan_goal: Callable[[dict], object], engine, cases: int, seed: int, strategy=None) -> Tally:
    """Plan cases random goals with plan_goal(fields); generate briefly with 1 in GENERATE valid plans."""
    tally = Tally()
    started = time.perf_counter()

    @settings(max_examples=cases, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @seed_of(seed)
    @given(strategy if strategy is not None else goals(), st.integers(0, GENERATE - 1))
    def case(fields, pick):
        tally.cases += 1
        try:
            outcome = plan_or_refusal(lambda: plan_goal(fields))
            if outcome.plan is not None:
                tally.plans += 1
                if pick == 0:
                    generate_briefly(engine, outcome.plan)
                    tally.generated += 1
            elif outcome.field is not None:
                tally.refusals[outcome.field] += 1
            else:
                tally.unnamed.append((fields, outcome.message))
        except Exception:  # noqa: BLE001 (an internal error: counted, the run goes on)
            tally.errors.append((fields, traceback.format_exc()))

    case()
    tally.seconds = time.perf_counter() - started
    return tally


def bundled_engine(target: str):
    """Load the bundled models on the eager lean forward, every drafter (the vision target reads images)."""
    from gemma_spec_ros.engine import Engine

    return Engine.from_config(EngineConfig(
        target_path=target, assistant_path=str(MODELS / 'gemma4-spec-assistant'),
        draft_model_path=str(MODELS / 'gemma4-spec-draft'), drafter='ngram', device='cpu', dtype='float32',
        compile='eager', warmup='off', num_threads=1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog='python -m gemma_spec_ros bench fuzz',
                                     description=__doc__.strip().split('\n\n')[0])
    parser.add_argument('--cases', type=int, default=10000, help='random goals (default 10000)')
    parser.add_argument('--seed', type=int, default=0, help='seed of the draws (default 0)')
    parser.add_argument('--target', default=str(MODELS / 'gemma4-spec-vision'),
                        help='target directory (default: the bundled vision target)')
    parser.add_argument('--show', type=int, default=3, help='internal errors and unnamed refusals to print')
    args = parser.parse_args(argv)
    engine = bundled_engine(args.target)
    try:
        tally = run(lambda fields: engine.validate(engine_request(fields)), engine, args.cases, args.seed,
                    goals(compressed=False, prompt_ids=True))
    finally:
        engine.close()
    print('fuzz: {} random goals, seed {}, the engine\'s half on {}'.format(args.cases, args.seed,
                                                                         Path(args.target).name))
    print(tally.table())
    for fields, message in tally.unnamed[:args.show]:
        print('\nrefusal naming no field: {}\n  goal: {!r}'.format(message, fields))
    for fields, trace in tally.errors[:args.show]:
        print('\ninternal error:\n{}  goal: {!r}'.format(trace, fields))
    return 1 if tally.errors or tally.unnamed else 0


if __name__ == '__main__':
    sys.exit(main())
