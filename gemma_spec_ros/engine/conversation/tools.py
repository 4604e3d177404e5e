"""
Tools a planner offers the model, and the model's calls in Gemma 4's own syntax.

    <|tool_call>call:pick{object:<|"|>red cup<|"|>,count:2,gentle:true}<tool_call|>

Values are written as Gemma 4's chat template writes them (its `format_argument`): a string between two quote
tokens, its text literal (no escapes, so it can never hold the quote token); true, false, null; numbers as JSON
writes them; objects with bare keys; arrays. No whitespace anywhere.

`call_grammar` turns the tools' JSON Schemas into an EBNF grammar (xgrammar's syntax) of one call body, so that a
constrained call always names a tool and always carries arguments valid under its schema. Whatever the grammar
cannot enforce exactly is refused when the tools arrive (`parse_tools`), never silently loosened: a call the
planner cannot run is worse than an error up front. The grammar may be narrower than the schema (never wider):

- object keys come in the schema's property order, and only declared properties are allowed: additionalProperties
  counts as false wherever `properties` is given (the model must only use parameters the tool declares);
- an enum or const is written exactly as `format_value` writes its values (1.0 stays 1.0, not 1);
- an integer is written without fraction or exponent;
- oneOf is enforced as anyOf: keep its alternatives disjoint (a value matching two of them would be invalid).

Pure Python: the request rules and both backends read it; the token masks live in logits.
"""

import json
import math
import re
from dataclasses import dataclass, field

import jsonschema

from ..types import ToolCall
from .format import QUOTE

# The grammar's name for the <|"|> token: the engine describes that token to xgrammar as this one private-use
# character (U+E000-U+E0FF is kept out of strings, so it can only ever be the token)
QUOTE_CHAR = '\ue022'
NAME_PATTERN = re.compile(r'[A-Za-z_][A-Za-z0-9_.\-]*')   # a tool's name
KEY_PATTERN = re.compile(r'[A-Za-z_][A-Za-z0-9_]*')       # a bare key: a parameter's or an object's key
AUTO, NONE, REQUIRED = 'auto', 'none', 'required'
TOOL_CHOICES = (AUTO, NONE, REQUIRED)   # or a tool's name
CALL_PREFIX = 'call:'

_TOOL_FIELDS = ('name', 'description', 'parameters', 'strict')   # strict: OpenAI's flag; always enforced here
_WRAPPER_FIELDS = ('type', 'function')
# keywords that constrain nothing: allowed anywhere
_ANNOTATIONS = frozenset({'title', 'description', 'default', 'examples', '$comment', 'deprecated', 'readOnly',
                          'writeOnly', '$schema', '$defs', 'definitions'})
# keywords of one type, enforced by the grammar (or harmless: uniqueItems false)
_TYPE_KEYWORDS = {
    'object': frozenset({'properties', 'required', 'additionalProperties'}),
    'array': frozenset({'items', 'minItems', 'maxItems', 'uniqueItems'}),
    'string': frozenset({'minLength', 'maxLength'}),
    'integer': frozenset(), 'number': frozenset(), 'boolean': frozenset(), 'null': frozenset(),
}
_ALL_TYPE_KEYWORDS = frozenset().union(*_TYPE_KEYWORDS.values())
_LITERAL_KEYWORDS = ('enum', 'const')
_COMBINATORS = ('anyOf', 'oneOf', 'allOf')
_NUMBER = re.compile(r'-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?')
_PRIVATE_USE = re.compile('[\ue000-\ue0ff]')
_EBNF_QUOTE = r'"\ue022"'
# no surrogate code points either: UTF-8 cannot hold them (xgrammar would take their bytes as one character, and
# the text would decode to three replacement characters)
_STRING_CHARACTERS = r'[^\ue000-\ue0ff\ud800-\udfff]'
# rules every grammar may use, in the order they are written (only those used are)
_COMMON_RULES = {
    'any_value': 'string | number | "true" | "false" | "null" | any_object | any_array',
    'any_object': '"{" (key ":" any_value ("," key ":" any_value)*)? "}"',
    'any_array': '"[" (any_value ("," any_value)*)? "]"',
    'string': '{0} {1}* {0}'.format(_EBNF_QUOTE, _STRING_CHARACTERS),
    'number': '"-"? ("0" | [1-9] [0-9]*) ("." [0-9]+)? ([eE] [+-]? [0-9]+)?',
    'integer': '"-"? ("0" | [1-9] [0-9]*)',
    'boolean': '"true" | "false"',
    'key': '[A-Za-z_] [A-Za-z0-9_]*',
}
_USES = {'any_value': ('string', 'number', 'any_object', 'any_array'), 'any_object': ('key', 'any_value'),
         'any_array': ('any_value',)}


def _no_parameters() -> dict:
    """Return the parameters of a tool that takes none: an empty object."""
    return {'type': 'object', 'properties': {}}


@dataclass(frozen=True)
class ToolSpec:
    """
    A tool the model may call: its name, what it does, and a JSON Schema of its arguments (an object).

    parameters is left out of the hash (a dict); treat it as read-only.
    """

    name: str
    description: str = ''
    parameters: dict = field(default_factory=_no_parameters, hash=False)


# --- the planner's tools ---------------------------------------------------------------------------------------


def parse_tools(text: str) -> tuple[ToolSpec, ...]:
    """
    Read a request's tools (JSON text of a list); '' is no tools. ValueError names the field at fault.

    A tool is {name, description, parameters} or OpenAI's {"type": "function", "function": {...}}.

    Each tool's schema is checked (jsonschema) and compiled to its grammar here, so that a schema the tool-call
    grammar cannot enforce is refused with the request, not when the model calls the tool.
    """
    if not isinstance(text, str):
        raise ValueError('tools must be a string (JSON text of a list), got {}'.format(type(text).__name__))
    if not text.strip():
        return ()
    try:
        items = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError('tools: not valid JSON: {}'.format(exc)) from exc
    if not isinstance(items, list):
        raise ValueError('tools must be a JSON list of tools, got {}'.format(_json_type(items)))
    tools: list[ToolSpec] = []
    seen: dict[str, int] = {}
    for index, item in enumerate(items):
        tool = _parse_tool(item, 'tools[{}]'.format(index))
        if tool.name in seen:
            raise ValueError('tools[{}].name: duplicate name "{}" (also tools[{}])'.format(
                index, tool.name, seen[tool.name]))
        seen[tool.name] = index
        _Grammar().tool_rule(tool, 'tools[{}]'.format(index), 'tool{}'.format(index))  # refuses what it cannot do
        tools.append(tool)
    return tuple(tools)


def _parse_tool(item, field_name: str) -> ToolSpec:
    if not isinstance(item, dict):
        raise ValueError('{} must be an object (a tool), got {}'.format(field_name, _json_type(item)))
    if 'function' in item or 'type' in item:   # OpenAI's wrapper
        _check_fields(item, _WRAPPER_FIELDS, field_name)
        if item.get('type') != 'function':
            raise ValueError('{}.type must be "function", got {}'.format(field_name, json.dumps(item.get('type'))))
        item = item.get('function')
        if not isinstance(item, dict):
            raise ValueError('{}.function must be an object (the tool), got {}'.format(field_name, _json_type(item)))
    _check_fields(item, _TOOL_FIELDS, field_name)
    name = item.get('name')
    if name is None:
        raise ValueError('{}.name: missing (every tool needs a name)'.format(field_name))
    if not isinstance(name, str):
        raise ValueError('{}.name must be a string, got {}'.format(field_name, _json_type(name)))
    if not NAME_PATTERN.fullmatch(name):
        raise ValueError('{}.name: "{}" is not a tool name (a letter or _, then letters, digits, _ . -)'.format(
            field_name, name))
    if name in TOOL_CHOICES:
        raise ValueError('{}.name: "{}" is reserved (a tool_choice value)'.format(field_name, name))
    description = item.get('description', '')
    if not isinstance(description, str):
        raise ValueError('{}.description must be a string, got {}'.format(field_name, _json_type(description)))
    parameters = item.get('parameters')
    if parameters is None or parameters == {}:
        parameters = _no_parameters()
    _check_parameters(parameters, '{}.parameters'.format(field_name))
    return ToolSpec(name, description, parameters)


def _check_fields(item: dict, known: tuple[str, ...], field_name: str) -> None:
    """Refuse unknown fields: a misspelt one ('parameter') would silently give a tool without arguments."""
    for key in item:
        if key not in known:
            raise ValueError('{}: unknown field "{}" (known: {})'.format(field_name, key, ', '.join(known)))


def _check_parameters(parameters, field_name: str) -> None:
    if not isinstance(parameters, dict):
        raise ValueError('{} must be a JSON Schema of an object, got {}'.format(field_name, _json_type(parameters)))
    try:
        jsonschema.validators.validator_for(parameters).check_schema(parameters)
    except jsonschema.SchemaError as exc:
        raise ValueError('{}: {} at {}'.format(field_name, exc.message, _path(exc.absolute_path))) from exc
    if not (parameters.get('type') == 'object' or ('type' not in parameters and 'properties' in parameters)):
        raise ValueError('{} must be the schema of an object (type "object" or properties): the arguments of a call '
                         'are an object'.format(field_name))


def check_tool_choice(choice: str, tools: tuple[ToolSpec, ...]) -> str:
    """
    Return the tool choice to use: 'auto', 'none', 'required' or a tool's name; ValueError 'tool_choice: ...'.

    '' is 'auto' with tools and 'none' without; 'auto' without tools is 'none' too (there is nothing to call).
    """
    if not isinstance(choice, str):
        raise ValueError('tool_choice must be a string, got {}'.format(type(choice).__name__))
    names = [tool.name for tool in tools]
    if choice in ('', AUTO):
        return AUTO if tools else NONE
    if choice == NONE:
        return NONE
    if not tools:
        what = '"required"' if choice == REQUIRED else 'a tool ("{}")'.format(choice)
        raise ValueError('tool_choice: {} needs tools, and the request has none'.format(what))
    if choice == REQUIRED or choice in names:
        return choice
    raise ValueError('tool_choice: no tool is named "{}" (tools: {}); use {} or a tool\'s name'.format(
        choice, ', '.join(names), ', '.join(TOOL_CHOICES)))


def call_arguments(arguments, field_name: str = 'arguments') -> dict:
    """Return a call's arguments as a dict: JSON object text (ChatMessage) or a dict; ValueError names the field."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as exc:
            raise ValueError('{}: not valid JSON: {}'.format(field_name, exc)) from exc
    if not isinstance(arguments, dict):
        raise ValueError('{} must be a JSON object, got {}'.format(field_name, _json_type(arguments)))
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


def check_history_call(call, field_name: str) -> None:
    """Check an earlier assistant turn's call ({name, arguments[, id]}); ValueError names the field."""
    if not isinstance(call, dict) or not isinstance(call.get('name'), str):
        raise ValueError('{} needs a string "name" and "arguments" (JSON object text), got {!r}'.format(
            field_name, call))
    if not NAME_PATTERN.fullmatch(call['name']):
        raise ValueError('{}.name: {!r} is not a tool name (letters, digits, _ . -, not first a digit)'.format(
            field_name, call['name']))
    call_arguments(call.get('arguments', ''), field_name + '.arguments')


def tool_result(content: str):
    """Return a tool message's result as the template writes it: a dict for JSON object text, else its text."""
    try:
        value = json.loads(content)
    except (json.JSONDecodeError, TypeError):
        return content
    if not isinstance(value, dict):
        return content
    try:
        _check_keys(value, 'content')
    except ValueError:
        return content   # keys a call cannot write bare: shown as text
    return value


def validate_arguments(tool: ToolSpec, arguments: dict) -> None:
    """ValueError naming the tool and the path when arguments are not valid under the tool's parameters."""
    validator = jsonschema.validators.validator_for(tool.parameters)(tool.parameters)
    error = jsonschema.exceptions.best_match(validator.iter_errors(arguments))
    if error is not None:
        raise ValueError('call of {}: arguments: {} at {}'.format(tool.name, error.message, _path(error.absolute_path)))


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


def parse_call(body: str, tools: tuple[ToolSpec, ...], index: int) -> ToolCall:
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


# --- the grammar of a call -------------------------------------------------------------------------------------


def call_grammar(tools: tuple[ToolSpec, ...], names: tuple[str, ...] | None = None) -> str:
    """
    EBNF (xgrammar, root rule `root`) of one call body 'call:NAME{args}' of the tools named (None: all).

    Arguments are valid under the tool's parameters (see the module's notes). The quote token is QUOTE_CHAR;
    nothing follows the closing '}' (the engine adds <tool_call|>). The same tools give the same text.
    """
    by_name = {tool.name: index for index, tool in enumerate(tools)}
    if isinstance(names, str):
        raise ValueError('names must be a tuple of tool names, got a string ({!r})'.format(names))
    chosen = tuple(by_name) if names is None else tuple(dict.fromkeys(names))   # in order, each once
    if not chosen:
        raise ValueError('a tool-call grammar needs at least one tool')
    grammar = _Grammar()
    alternatives = []
    for name in chosen:
        if name not in by_name:
            raise ValueError('no tool is named "{}" (tools: {})'.format(name, ', '.join(by_name) or 'none'))
        index = by_name[name]
        rule = grammar.tool_rule(tools[index], 'tools[{}]'.format(index), 'tool{}'.format(index))
        alternatives.append('{} {}'.format(_literal(name), rule))
    body = alternatives[0] if len(alternatives) == 1 else '({})'.format(' | '.join(alternatives))
    return grammar.text('{} {}'.format(_literal(CALL_PREFIX), body))


class _Refused(ValueError):
    """A part of a schema the grammar cannot enforce exactly; the tool's field is added by `tool_rule`."""


class _Grammar:
    """The rules of one grammar: named per tool by counters, so that the same tools give the same text."""

    def __init__(self):
        self.rules: dict[str, str] = {}
        self.common: set[str] = set()

    def use(self, rule: str) -> str:
        if rule not in self.common:
            self.common.add(rule)
            for used in _USES.get(rule, ()):
                self.use(used)
        return rule

    def tool_rule(self, tool: ToolSpec, field_name: str, prefix: str) -> str:
        """Return the rule of a tool's arguments; ValueError '<field>.parameters: ...' for what it refuses."""
        try:
            return _ToolRules(self, prefix, tool.parameters).arguments()
        except _Refused as exc:
            raise ValueError('{}.parameters: {}'.format(field_name, exc)) from None

    def text(self, root: str) -> str:
        lines = ['root ::= ' + root]
        lines += ['{} ::= {}'.format(name, body) for name, body in self.rules.items()]
        lines += ['{} ::= {}'.format(name, body) for name, body in _COMMON_RULES.items() if name in self.common]
        return '\n'.join(lines) + '\n'


class _ToolRules:
    """Turns one tool's parameters schema into rules named <prefix>_<n>."""

    def __init__(self, grammar: _Grammar, prefix: str, root: dict):
        self.grammar = grammar
        self.prefix = prefix
        self.root = root
        self.validator = jsonschema.validators.validator_for(root)(root)
        self.references: dict[str, str] = {}   # '$ref' -> its rule
        self.count = 0

    def arguments(self) -> str:
        """Return the rule of the arguments: the root schema, an object (its own rule: '#' may refer to it)."""
        for keyword in self.root:
            if keyword not in _ANNOTATIONS and keyword not in _TYPE_KEYWORDS['object'] and keyword != 'type':
                raise _Refused(_not_enforced(keyword, '$'))
        return self.reference('#', '$')

    def new_rule(self) -> str:
        self.count += 1
        return '{}_{}'.format(self.prefix, self.count)

    def rule(self, body: str, name: str = '') -> str:
        name = name or self.new_rule()
        self.grammar.rules[name] = body
        return name

    def value(self, schema, path: str) -> str:
        """Return an expression (a rule, a literal or a group in parentheses) of the values valid under schema."""
        if schema is True:
            return self.grammar.use('any_value')
        if not isinstance(schema, dict):
            raise _Refused('the schema at {} allows no value; remove the property or loosen it'.format(path))
        if any(keyword in schema for keyword in _LITERAL_KEYWORDS):
            return self.literals(schema, path)
        if '$ref' in schema:
            self.only_annotations(schema, '$ref', path)
            return self.reference(schema['$ref'], path)
        combinators = [keyword for keyword in _COMBINATORS if keyword in schema]
        if combinators:
            self.only_annotations(schema, combinators[0], path)
            return self.combination(combinators[0], schema[combinators[0]], path)
        for keyword in schema:
            if keyword not in _ANNOTATIONS and keyword not in _ALL_TYPE_KEYWORDS and keyword != 'type':
                raise _Refused(_not_enforced(keyword, path))
        types = self.types(schema, path)
        if types is None:
            return self.grammar.use('any_value')
        return _alternatives([self.typed(schema, kind, path) for kind in types])

    def types(self, schema: dict, path: str) -> list[str] | None:
        """Return the schema's types; without 'type', the one type its keywords are about (None: any value)."""
        declared = schema.get('type')
        if declared is not None:
            return [declared] if isinstance(declared, str) else list(declared)
        if schema.get('uniqueItems') is True:
            raise _Refused(_not_enforced('uniqueItems', path))
        kinds = [kind for kind, keywords in _TYPE_KEYWORDS.items() if keywords & schema.keys() - {'uniqueItems'}]
        if len(kinds) > 1:
            raise _Refused("the schema at {} has keywords of {} but no 'type'; give its type".format(
                path, ' and '.join(kinds)))
        return kinds or None

    def typed(self, schema: dict, kind: str, path: str) -> str:
        if kind == 'object':
            body = self.object(schema, path)
            return body if body in ('"{}"', 'any_object') else self.rule(body)
        if kind == 'array':
            return self.array(schema, path)
        if kind == 'string':
            return self.string(schema, path)
        return self.grammar.use(kind) if kind != 'null' else '"null"'

    def object(self, schema: dict, path: str) -> str:
        """Return the body of an object's rule: declared properties in order, or any bare keys without them."""
        required = schema.get('required', [])
        if 'properties' not in schema:
            if required:
                raise _Refused("'required' without 'properties' at {} is not enforced by the tool-call grammar; "
                               "declare the properties".format(path))
            extra = schema.get('additionalProperties', True)
            if extra is True:
                return self.grammar.use('any_object')
            if extra is False:
                return '"{}"'
            item = '{} ":" {}'.format(self.grammar.use('key'), self.value(extra, path + '.additionalProperties'))
            return '"{{" ({0} ("," {0})*)? "}}"'.format(item)
        properties = schema['properties']
        for key in required:
            if key not in properties:
                raise _Refused("required property '{}' at {} is not in its properties (only declared properties "
                               "may be written)".format(key, path))
        if not properties:
            return '"{}"'
        items, optional = [], []
        for key, subschema in properties.items():
            if not KEY_PATTERN.fullmatch(key):
                raise _Refused("property name '{}' at {}.properties is not a bare key (a letter or _, then letters, "
                               "digits or _)".format(key, path))
            items.append('{} {}'.format(_literal(key + ':'), self.value(subschema, '{}.properties.{}'.format(
                path, key))))
            optional.append(key not in required)
        return '"{{" {} "}}"'.format(self.properties(items, optional))

    def properties(self, items: list[str], optional: list[bool]) -> str:
        """
        Any subset of items holding the required ones, in order, comma separated.

        The first item written is one of those up to the first required one; after it, each later item is
        ',' item, optional or not. The tails are chained rules, so the text grows linearly with the properties.
        """
        count = len(items)
        pieces = ['"," {}'.format(item) if not skip else '("," {})?'.format(item)
                  for item, skip in zip(items, optional, strict=True)]
        first_required = optional.index(False) if False in optional else None
        starts = range(count if first_required is None else first_required + 1)
        if first_required == 0:
            return ' '.join([items[0]] + pieces[1:])
        tails = [''] * (count + 1)
        for index in range(count - 1, 0, -1):
            tails[index] = self.rule(' '.join(filter(None, (pieces[index], tails[index + 1]))))
        body = '({})'.format(' | '.join(' '.join(filter(None, (items[start], tails[start + 1]))) for start in starts))
        return body + '?' if first_required is None else body

    def array(self, schema: dict, path: str) -> str:
        if schema.get('uniqueItems') is True:
            raise _Refused(_not_enforced('uniqueItems', path))
        low, high = self.bounds(schema, 'minItems', 'maxItems', path)
        items = schema.get('items', True)
        if isinstance(items, list):
            raise _Refused("'items' as a list (a tuple) at {} is not enforced by the tool-call grammar; give one "
                           "schema for every item".format(path))
        if high == 0 or items is False:
            if low > 0:
                raise _Refused("no items are allowed at {} but 'minItems' is {}".format(path, low))
            return '"[]"'
        item = self.value(items, path + '.items')
        body = item if high == 1 else '{0} ("," {0}){1}'.format(item, _repeat(max(low - 1, 0), _less(high)))
        return self.rule('"[" {} "]"'.format(body if low > 0 else '({})?'.format(body)))

    def string(self, schema: dict, path: str) -> str:
        low, high = self.bounds(schema, 'minLength', 'maxLength', path)
        if low == 0 and high is None:
            return self.grammar.use('string')
        return '({0} {1}{2} {0})'.format(_EBNF_QUOTE, _STRING_CHARACTERS, _repeat(low, high))

    def bounds(self, schema: dict, low_keyword: str, high_keyword: str, path: str) -> tuple[int, int | None]:
        low = int(schema.get(low_keyword, 0))
        high = None if high_keyword not in schema else int(schema[high_keyword])
        if high is not None and high < low:
            raise _Refused("'{}' {} is above '{}' {} at {}: no value fits".format(low_keyword, low, high_keyword, high,
                                                                                   path))
        return low, high

    def literals(self, schema: dict, path: str) -> str:
        """Return the enum's (or const's) values valid under the whole schema, written as format_value does."""
        values = schema['enum'] if 'enum' in schema else [schema['const']]
        allowed = []
        for value in values:
            if not self.validator.evolve(schema=schema).is_valid(value):
                continue
            problem = _unwritable(value)
            if problem:
                raise _Refused('the value {} at {} cannot be written in a tool call: {}'.format(
                    json.dumps(value), path, problem))
            literal = _literal(format_value(value).replace(QUOTE, QUOTE_CHAR))
            if literal not in allowed:
                allowed.append(literal)
        if not allowed:
            raise _Refused('no value of the enum or const at {} is valid under its schema'.format(path))
        return _alternatives(allowed)

    def reference(self, reference, path: str) -> str:
        """Return the rule of '#' or '#/$defs/NAME' ('#/definitions/NAME'): one per definition (may recurse)."""
        if reference in self.references:
            return self.references[reference]
        parts = reference.split('/') if isinstance(reference, str) else []
        parts = [part.replace('~1', '/').replace('~0', '~') for part in parts]
        if reference == '#':
            target, target_path = self.root, '$'
        elif len(parts) == 3 and parts[0] == '#' and parts[1] in ('$defs', 'definitions') \
                and isinstance(self.root.get(parts[1]), dict) and parts[2] in self.root[parts[1]]:
            target, target_path = self.root[parts[1]][parts[2]], '$.{}.{}'.format(parts[1], parts[2])
        else:
            raise _Refused("'$ref' {} at {} is not enforced by the tool-call grammar: only '#', '#/$defs/NAME' and "
                           "'#/definitions/NAME' of the same schema are".format(json.dumps(reference), path))
        name = self.references[reference] = self.new_rule()
        if target is self.root:
            self.rule(self.object(target, target_path), name)
        else:
            self.rule(self.value(target, target_path), name)
        return name

    def combination(self, keyword: str, schemas, path: str) -> str:
        if keyword == 'allOf' and len(schemas) != 1:
            raise _Refused("'allOf' with more than one schema at {} is not enforced by the tool-call grammar; "
                           "merge them".format(path))
        options = [self.value(schema, '{}.{}[{}]'.format(path, keyword, index)) for index, schema in enumerate(schemas)]
        return options[0] if len(options) == 1 else self.rule(' | '.join(options))

    def only_annotations(self, schema: dict, keyword: str, path: str) -> None:
        for other in schema:
            if other != keyword and other not in _ANNOTATIONS:
                raise _Refused("'{}' beside '{}' at {} is not enforced by the tool-call grammar; move it into "
                               "the {}".format(other, keyword, path, 'definition' if keyword == '$ref' else
                                               'alternatives'))


def _not_enforced(keyword: str, path: str) -> str:
    return '{!r} at {} is not enforced by the tool-call grammar; remove it'.format(keyword, path)


def _unwritable(value) -> str:
    """Why a value cannot appear in a call ('' when it can): strings with the quote, keys that are not bare."""
    if isinstance(value, str):
        if QUOTE in value or _PRIVATE_USE.search(value):
            return 'its text holds the quote token or a private-use character (U+E000-U+E0FF)'
        if any(0xD800 <= ord(char) <= 0xDFFF for char in value):
            return 'its text holds a lone surrogate'
    if isinstance(value, dict):
        for key, item in value.items():
            if not KEY_PATTERN.fullmatch(key):
                return 'key "{}" is not a bare key'.format(key)
            if _unwritable(item):
                return _unwritable(item)
    if isinstance(value, list):
        return next((problem for problem in map(_unwritable, value) if problem), '')
    return ''


def _less(high: int | None) -> int | None:
    return None if high is None else high - 1


def _alternatives(options: list[str]) -> str:
    return options[0] if len(options) == 1 else '({})'.format(' | '.join(options))


def _repeat(low: int, high: int | None) -> str:
    if high is None:
        return {0: '*', 1: '+'}.get(low, '{{{},}}'.format(low))
    if (low, high) == (0, 1):
        return '?'
    return '{{{},{}}}'.format(low, high)


def _literal(text: str) -> str:
    """Return an EBNF string literal of text, ASCII only: other characters as u escapes."""
    out = []
    for char in text:
        if char in '"\\':
            out.append('\\' + char)
        elif ' ' <= char <= '~':
            out.append(char)
        elif ord(char) <= 0xFFFF:
            out.append('\\u{:04x}'.format(ord(char)))
        else:
            out.append('\\U{:08x}'.format(ord(char)))
    return '"{}"'.format(''.join(out))


def _path(parts) -> str:
    """Return the JSON path ('$.properties.x', '$.items[0]') of jsonschema's path parts."""
    return '$' + ''.join('[{}]'.format(part) if isinstance(part, int) else '.{}'.format(part) for part in parts)


def _json_type(value) -> str:
    names = {dict: 'an object', list: 'a list', str: 'a string', bool: 'a boolean', int: 'a number',
             float: 'a number', type(None): 'null'}
    return names.get(type(value), type(value).__name__)
