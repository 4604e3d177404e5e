"""
The grammar of one Gemma 4 tool call, built from the tools' JSON Schemas (EBNF in xgrammar's syntax).

A constrained call always names a declared tool and always carries arguments valid under its schema. Whatever
the grammar cannot enforce exactly is refused (ValueError naming `tools[i].parameters` and the schema path), never
silently loosened; the grammar may be narrower than the schema (tools.py's notes). Pure Python.
"""

import json

import jsonschema

from .format import QUOTE
from .syntax import CALL_PREFIX, KEY_PATTERN, PRIVATE_USE, QUOTE_CHAR, format_value

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



# --- the grammar of a call -------------------------------------------------------------------------------------


def call_grammar(tools: tuple, names: tuple[str, ...] | None = None) -> str:
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


def check_enforceable(tool, field_name: str) -> None:
    """Raise ValueError '<field_name>.parameters: ...' when the grammar cannot enforce the tool's schema exactly."""
    _Grammar().tool_rule(tool, field_name, 'tool')


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

    def tool_rule(self, tool, field_name: str, prefix: str) -> str:
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
        if QUOTE in value or PRIVATE_USE.search(value):
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
