"""
Gemma 4's syntax of tool calls and their values: written as its template's format_argument, read back to JSON.

    <|tool_call>call:pick{object:<|"|>red cup<|"|>,count:2,gentle:true}<tool_call|>

A string sits between two quote tokens, its text literal (no escapes, so it can never hold the quote token);
true, false, null; numbers as JSON writes them; objects with bare keys; arrays. No whitespace anywhere. Pure Python.
"""

import json
import math
import re

from ..types import ToolCall
from .format import QUOTE

# The grammar's name for the <|"|> token: the engine describes that token to xgrammar as this one private-use
# character (U+E000-U+E0FF is kept out of strings, so it can only ever be the token)
QUOTE_CHAR = '\ue022'
NAME_PATTERN = re.compile(r'[A-Za-z_][A-Za-z0-9_.\-]*')   # a tool's name
KEY_PATTERN = re.compile(r'[A-Za-z_][A-Za-z0-9_]*')       # a bare key: a parameter's or an object's key
CALL_PREFIX = 'call:'
_NUMBER = re.compile(r'-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?')
PRIVATE_USE = re.compile('[\ue000-\ue0ff]')
# the deepest nesting of a request's JSON text: the readers after it (jsonschema, the grammars, the chat template)
# recurse per level, and a few hundred levels exhaust Python's recursion limit
MAX_JSON_DEPTH = 64
_SURROGATE = re.compile('[\ud800-\udfff]')


def read_json(text: str, field_name: str):
    """
    Read JSON text of a request (json_schema, tools, a call's arguments); ValueError names the field.

    Besides text that is not JSON it refuses what the readers after it fail on: NaN and infinite numbers (1e400
    reads as one), integers past Python's digit limit, escapes of lone surrogates (no UTF-8 text holds them) and
    nesting deeper than MAX_JSON_DEPTH.
    """
    too_deep = '{}: nested deeper than {} levels'.format(field_name, MAX_JSON_DEPTH)
    try:
        value = json.loads(text)
    except RecursionError as exc:
        raise ValueError(too_deep) from exc
    except ValueError as exc:   # json.JSONDecodeError, or an integer of more digits than int() reads
        raise ValueError('{}: not valid JSON: {}'.format(field_name, exc)) from exc
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            if depth >= MAX_JSON_DEPTH:
                raise ValueError(too_deep)
            children = [*item, *item.values()] if isinstance(item, dict) else item
            stack += [(child, depth + 1) for child in children]
        elif isinstance(item, float) and not math.isfinite(item):
            raise ValueError('{}: {} is not a JSON number (JSON numbers are finite)'.format(field_name, item))
        elif isinstance(item, str) and _SURROGATE.search(item):
            raise ValueError('{}: a string holds an unpaired surrogate ({}), which is not text'.format(
                field_name, ascii(_SURROGATE.search(item).group())))
    return value


def call_arguments(arguments, field_name: str = 'arguments') -> dict:
    """Return a call's arguments as a dict: JSON object text (ChatMessage) or a dict; ValueError names the field."""
    if isinstance(arguments, str):
        arguments = read_json(arguments, field_name) if arguments.strip() else {}
    if not isinstance(arguments, dict):
        raise ValueError('{} must be a JSON object, got {}'.format(field_name, json_type(arguments)))
    _check_keys(arguments, field_name)
    return arguments


def _check_keys(value, field_name: str) -> None:
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str) or not KEY_PATTERN.fullmatch(key):
                raise ValueError('{}: key {!r} cannot be written bare in a Gemma 4 call (letters, digits and _, '
                                 'not first a digit)'.format(field_name, key))
            _check_keys(item, field_name)
    elif isinstance(value, list):
        for item in value:
            _check_keys(item, field_name)
    elif isinstance(value, str) and QUOTE in value:
        raise ValueError('{}: a string holds {!r}, which ends a string in a Gemma 4 call'.format(field_name, QUOTE))


def tool_result(content: str):
    """Return a tool message's result as the template writes it: a dict for JSON object text, else its text."""
    try:
        value = read_json(content, 'content')
    except (ValueError, TypeError):   # not JSON (or JSON no reader takes): shown as text
        return content
    if not isinstance(value, dict):
        return content
    try:
        _check_keys(value, 'content')
    except ValueError:
        return content   # keys a call cannot write bare: shown as text
    return value


# --- writing values and calls ----------------------------------------------------------------------------------


def format_value(value) -> str:
    """
    Write a JSON value in Gemma 4's syntax, quotes as the '<|"|>' token text; dict keys bare, in insertion order.

    Keys are written as they are (as Gemma 4's template does); only keys matching KEY_PATTERN read back with
    `parse_call`. ValueError for a string holding the quote token (it would end the string early), a non-finite
    float, a non-string key or a value JSON does not have.
    """
    if value is None:
        return 'null'
    if isinstance(value, bool):
        return 'true' if value else 'false'
    if isinstance(value, int):
        return str(int(value))
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError('a tool-call value must be a finite number, got {}'.format(value))
        return json.dumps(value)
    if isinstance(value, str):
        if QUOTE in value:
            raise ValueError('a tool-call string cannot hold the quote token {}: {!r}'.format(QUOTE, value))
        return QUOTE + value + QUOTE
    if isinstance(value, dict):
        for key in value:
            if not isinstance(key, str):
                raise ValueError('a tool-call object key must be a string, got {!r}'.format(key))
        return '{' + ','.join('{}:{}'.format(key, format_value(item)) for key, item in value.items()) + '}'
    if isinstance(value, list | tuple):
        return '[' + ','.join(format_value(item) for item in value) + ']'
    raise ValueError('a tool-call value must be JSON (null, bool, number, string, list, dict), got {}'.format(
        type(value).__name__))


def format_call(name: str, arguments: dict) -> str:
    """'call:NAME{...}': a call's body, as the model writes it between <|tool_call> and <tool_call|>."""
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise ValueError('a tool call needs a tool name, got {!r}'.format(name))
    if not isinstance(arguments, dict):
        raise ValueError('the arguments of a tool call are an object (dict), got {}'.format(type(arguments).__name__))
    return CALL_PREFIX + name + format_value(arguments)


# --- reading calls ---------------------------------------------------------------------------------------------


def parse_call(body: str, tools: tuple, index: int) -> ToolCall:
    """
    Read a call's body ('call:NAME{...}', quotes as '<|"|>' or QUOTE_CHAR) as the reply's call number index.

    ValueError for malformed text or a tool not offered. The arguments are not checked against the schema (the
    grammar did that; see `validate_arguments`). A key given twice keeps its last value, as JSON readers do.
    """
    reader = _Reader(body)
    reader.expect(CALL_PREFIX)
    name = reader.match(NAME_PATTERN, 'a tool name')
    names = [tool.name for tool in tools]
    if name not in names:
        raise ValueError('tool call: unknown tool "{}" (tools: {})'.format(name, ', '.join(names) or 'none'))
    if not reader.at('{'):
        reader.fail('"{" (the arguments)')
    try:
        arguments = reader.value()
    except RecursionError as exc:
        raise ValueError('tool call: arguments nested too deeply in {}'.format(reader.shown())) from exc
    if reader.position != len(body):
        reader.fail('the end of the call after its arguments')
    return ToolCall('call_{}'.format(index), name, json.dumps(arguments, separators=(',', ':'), ensure_ascii=False))


class _Reader:
    """A recursive-descent reader of one call body; the quote is whichever form the body uses."""

    def __init__(self, body: str):
        if not isinstance(body, str):
            raise ValueError('tool call: the body must be a string, got {}'.format(type(body).__name__))
        self.body = body
        self.position = 0
        self.quote = QUOTE if QUOTE in body else QUOTE_CHAR

    def at(self, text: str) -> bool:
        return self.body.startswith(text, self.position)

    def expect(self, text: str) -> None:
        if not self.at(text):
            self.fail(json.dumps(text, ensure_ascii=False))
        self.position += len(text)

    def match(self, pattern: re.Pattern, what: str) -> str:
        found = pattern.match(self.body, self.position)
        if found is None:
            self.fail(what)
        self.position = found.end()
        return found.group()

    def value(self):
        if self.at('{'):
            return self.object()
        if self.at('['):
            return self.array()
        if self.at(self.quote):
            start = self.position + len(self.quote)
            end = self.body.find(self.quote, start)
            if end < 0:
                self.fail('a string to end with a quote')
            self.position = end + len(self.quote)
            return self.body[start:end]
        for word, value in (('true', True), ('false', False), ('null', None)):
            if self.at(word):
                self.position += len(word)
                return value
        text = self.match(_NUMBER, 'a value')
        if not any(mark in text for mark in '.eE'):
            return int(text)
        number = float(text)
        if not math.isfinite(number):
            raise ValueError('tool call: number {} is out of range in {}'.format(text, self.shown()))
        return number

    def object(self) -> dict:
        self.expect('{')
        result = {}
        if self.at('}'):
            self.position += 1
            return result
        while True:
            key = self.match(KEY_PATTERN, 'a key')
            self.expect(':')
            result[key] = self.value()
            if self.at('}'):
                self.position += 1
                return result
            self.expect(',')

    def array(self) -> list:
        self.expect('[')
        result = []
        if self.at(']'):
            self.position += 1
            return result
        while True:
            result.append(self.value())
            if self.at(']'):
                self.position += 1
                return result
            self.expect(',')

    def shown(self) -> str:
        return repr(self.body if len(self.body) <= 200 else self.body[:200] + '...')

    def fail(self, expected: str):
        raise ValueError('tool call: expected {} at character {} of {}'.format(expected, self.position, self.shown()))


def schema_path(parts) -> str:
    """Return the JSON path ('$.properties.x', '$.items[0]') of jsonschema's path parts."""
    return '$' + ''.join('[{}]'.format(part) if isinstance(part, int) else '.{}'.format(part) for part in parts)


def json_type(value) -> str:
    """Return how an error names the JSON type of value ('an object', 'a list', ...)."""
    names = {dict: 'an object', list: 'a list', str: 'a string', bool: 'a boolean', int: 'a number',
             float: 'a number', type(None): 'null'}
    return names.get(type(value), type(value).__name__)
