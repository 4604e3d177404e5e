"""
Tools and tool calls in Gemma 4's syntax: parsing the planner's tools, writing and reading calls, the call grammar.

The grammar is checked with xgrammar's string matcher (no tokenizer): it must accept every call `format_call`
writes for arguments valid under the tool's schema, and only such calls.
"""

import json

import jsonschema
import pytest
import xgrammar
import xgrammar.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from gemma_spec_ros.engine.conversation.format import QUOTE
from gemma_spec_ros.engine.conversation.tools import (
    KEY_PATTERN,
    NAME_PATTERN,
    QUOTE_CHAR,
    TOOL_CHOICES,
    ToolSpec,
    call_grammar,
    check_tool_choice,
    format_call,
    format_value,
    parse_call,
    parse_tools,
    validate_arguments,
)
from gemma_spec_ros.engine.types import ToolCall

OBJECT = 'object'
PICK = {'type': OBJECT, 'properties': {'object': {'type': 'string'}, 'count': {'type': 'integer'},
                                       'gentle': {'type': 'boolean'}}, 'required': ['object']}
MOVE = {'type': OBJECT, 'properties': {
    'mode': {'enum': ['walk', 'run']}, 'speed': {'type': 'number'}, 'label': {'type': 'string', 'maxLength': 4},
    'waypoints': {'type': 'array', 'items': {'type': 'integer'}, 'minItems': 1, 'maxItems': 3},
    'note': {'type': ['string', 'null']}}, 'required': ['speed'], 'additionalProperties': False}
# nested objects, arrays, a recursive $ref, anyOf, a free object and a mixed enum
PLAN = {'type': OBJECT, '$defs': {
    'Pose': {'type': OBJECT, 'properties': {'x': {'type': 'number'}, 'y': {'type': 'number'}}, 'required': ['x', 'y']},
    'Step': {'type': OBJECT, 'properties': {
        'action': {'enum': ['go', 'pick', 'place']},
        'target': {'anyOf': [{'$ref': '#/$defs/Pose'}, {'type': 'string', 'minLength': 1}]},
        'then': {'type': 'array', 'items': {'$ref': '#/$defs/Step'}}}, 'required': ['action']}},
    'properties': {'steps': {'type': 'array', 'items': {'$ref': '#/$defs/Step'}, 'minItems': 1},
                   'priority': {'enum': [1, 'high', None, True]},
                   'extra': {'type': OBJECT},
                   'any': {}},
    'required': ['steps']}
FREE = {'type': OBJECT}
TOOLS = (ToolSpec('pick', 'Pick an object up.', PICK), ToolSpec('move', 'Move.', MOVE),
         ToolSpec('plan', 'Run a plan.', PLAN), ToolSpec('free', 'Anything.', FREE), ToolSpec('stop', 'Stop.'))


def grammar_text(tools=TOOLS, names=None) -> str:
    return call_grammar(tools, names)


@pytest.fixture(scope='module')
def matcher():
    grammar = xgrammar.Grammar.from_ebnf(grammar_text())
    return xgrammar.testing._get_matcher_from_grammar(grammar)


def accepts(matcher, body: str) -> bool:
    """Whether the grammar accepts the whole body, quotes written as the grammar's QUOTE_CHAR."""
    matcher.reset()
    return matcher.accept_string(body.replace(QUOTE, QUOTE_CHAR)) and matcher.is_terminated()


# --- writing values and calls ----------------------------------------------------------------------------------

@pytest.mark.parametrize('value, text', [
    (None, 'null'), (True, 'true'), (False, 'false'), (0, '0'), (-42, '-42'), (1.5, '1.5'), (-0.25, '-0.25'),
    (2.0, '2.0'), (1e20, '1e+20'), (2e-7, '2e-07'), ('', '<|"|><|"|>'), ('red cup', '<|"|>red cup<|"|>'),
    ('a "b" \\n\n{c}:,', '<|"|>a "b" \\n\n{c}:,<|"|>'), ('café ☕', '<|"|>café ☕<|"|>'),
    ([], '[]'), ({}, '{}'), ([1, 'a', None], '[1,<|"|>a<|"|>,null]'), ((1, 2), '[1,2]'),
    ({'b': 1, 'a': {'c': [True, {}]}}, '{b:1,a:{c:[true,{}]}}'),
])
def test_format_value_writes_gemma_syntax(value, text):
    assert format_value(value) == text


@pytest.mark.parametrize('value, message', [
    ('say <|"|> here', 'cannot hold the quote token'), (float('nan'), 'finite'), (float('inf'), 'finite'),
    ({1: 'a'}, 'key must be a string'), ({1, 2}, 'must be JSON'), ({'a': [object()]}, 'must be JSON'),
])
def test_format_value_refuses_what_gemma_cannot_write(value, message):
    with pytest.raises(ValueError, match=message):
        format_value(value)


def test_format_call_writes_the_call_body():
    assert format_call('pick', {'object': 'red cup', 'count': 2, 'gentle': True}) == \
        'call:pick{object:<|"|>red cup<|"|>,count:2,gentle:true}'
    assert format_call('stop', {}) == 'call:stop{}'
    assert format_call('nav.go-to', {'pose': {'x': 1.5, 'y': -2}}) == 'call:nav.go-to{pose:{x:1.5,y:-2}}'
    with pytest.raises(ValueError, match='tool name'):
        format_call('2pick', {})
    with pytest.raises(ValueError, match='object'):
        format_call('pick', [1])


# --- reading calls ---------------------------------------------------------------------------------------------

def test_parse_call_reads_either_quote_form():
    body = 'call:pick{object:<|"|>red cup<|"|>,count:2,gentle:true}'
    expected = ToolCall('call_3', 'pick', '{"object":"red cup","count":2,"gentle":true}')
    assert parse_call(body, TOOLS, 3) == expected
    assert parse_call(body.replace(QUOTE, QUOTE_CHAR), TOOLS, 3) == expected
    assert expected.argument_values() == {'object': 'red cup', 'count': 2, 'gentle': True}


def test_parse_call_keeps_number_kinds_text_and_the_last_of_a_repeated_key():
    call = parse_call('call:free{a:1,b:1.0,c:-2e3,d:<|"|>é{x:1}, "q"<|"|>,e:[],f:{},a:null}', TOOLS, 0)
    arguments = json.loads(call.arguments)
    assert arguments == {'a': None, 'b': 1.0, 'c': -2000.0, 'd': 'é{x:1}, "q"', 'e': [], 'f': {}}
    assert isinstance(arguments['b'], float) and call.arguments.startswith('{"a":null,"b":1.0')
    assert 'é' in call.arguments   # compact, not ASCII-escaped


@pytest.mark.parametrize('body, message', [
    ('pick{object:<|"|>a<|"|>}', 'expected "call:"'),
    ('call:grab{}', 'unknown tool "grab" \\(tools: pick, move, plan, free, stop\\)'),
    ('call:pick', r'expected "\{" \(the arguments\)'),
    ('call:pick{object:<|"|>a}', 'a string to end with a quote'),
    ('call:pick{object:<|"|>a<|"|>}<tool_call|>', 'the end of the call'),
    ('call:pick{object:<|"|>a<|"|>,}', 'expected a key'),
    ('call:pick{"object":1}', 'expected a key'),
    ('call:pick{object 1}', 'expected ":"'),
    ('call:pick{object:yes}', 'expected a value'),
    ('call:pick{object:[1 2]}', 'expected ","'),
    ('call:pick{a:1e999}', 'out of range'),
    ('call:pick{ object:1}', 'expected a key'),
    ('', 'expected "call:"'),
])
def test_parse_call_refuses_malformed_bodies(body, message):
    with pytest.raises(ValueError, match='^tool call: .*' + message):
        parse_call(body, TOOLS, 0)


KEYS = st.from_regex(KEY_PATTERN, fullmatch=True).filter(lambda key: len(key) <= 12)
TEXT = st.text(max_size=12).filter(lambda text: QUOTE not in text)
NUMBERS = st.integers(-10 ** 20, 10 ** 20) | st.floats(allow_nan=False, allow_infinity=False)
JSON = st.recursive(st.none() | st.booleans() | NUMBERS | TEXT,
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(KEYS, inner, max_size=4), max_leaves=12)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(KEYS, JSON, max_size=5), st.integers(0, 9))
def test_parse_call_reads_back_what_format_call_writes(arguments, index):
    body = format_call('free', arguments)
    call = parse_call(body, TOOLS, index)
    assert call.id == 'call_{}'.format(index) and call.name == 'free'
    assert json.loads(call.arguments) == arguments
    assert call.arguments == json.dumps(arguments, separators=(',', ':'), ensure_ascii=False)
    if not any(QUOTE_CHAR in text for text in _strings(arguments)):
        assert parse_call(body.replace(QUOTE, QUOTE_CHAR), TOOLS, index) == call


def _strings(value):
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)


# --- the planner's tools ---------------------------------------------------------------------------------------

def test_parse_tools_reads_both_shapes_and_fills_missing_parameters():
    text = json.dumps([{'name': 'pick', 'description': 'Pick up.', 'parameters': PICK},
                       {'type': 'function', 'function': {'name': 'stop', 'strict': True}},
                       {'name': 'wait', 'parameters': {}}])
    pick, stop, wait = parse_tools(text)
    assert pick == ToolSpec('pick', 'Pick up.', PICK)
    assert stop == ToolSpec('stop', '', {'type': OBJECT, 'properties': {}})
    assert wait.parameters == {'type': OBJECT, 'properties': {}}
    assert parse_tools('') == () and parse_tools('[]') == () and parse_tools('  ') == ()
    assert len({pick, stop, wait}) == 3   # hashable by name and description


def _tools(*items) -> str:
    return json.dumps(list(items))


def _with(parameters) -> str:
    return _tools({'name': 'ok'}, {'name': 'tool', 'parameters': parameters})


@pytest.mark.parametrize('text, message', [
    ('[{"name": "a",', '^tools: not valid JSON: '),
    ('{"name": "a"}', '^tools must be a JSON list of tools, got an object$'),
    (_tools('pick'), r'^tools\[0\] must be an object'),
    (_tools({'name': 'a'}, {'description': 'no name'}), r'^tools\[1\]\.name: missing'),
    (_tools({'name': 'a'}, {'name': 'b'}, {'name': 7}), r'^tools\[2\]\.name must be a string'),
    (_tools({'name': 'pick up'}), r'^tools\[0\]\.name: "pick up" is not a tool name'),
    (_tools({'name': '9lives'}), r'^tools\[0\]\.name: "9lives" is not a tool name'),
    (_tools({'name': 'auto'}), r'^tools\[0\]\.name: "auto" is reserved'),
    (_tools({'name': 'pick'}, {'name': 'a'}, {'name': 'b'}, {'name': 'pick'}),
     r'^tools\[3\]\.name: duplicate name "pick" \(also tools\[0\]\)$'),
    (_tools({'name': 'a'}, {'name': 'b', 'description': 3}), r'^tools\[1\]\.description must be a string'),
    (_tools({'name': 'a', 'parameter': {}}), r'^tools\[0\]: unknown field "parameter"'),
    (_tools({'type': 'tool', 'function': {'name': 'a'}}), r'^tools\[0\]\.type must be "function"'),
    (_tools({'type': 'function', 'function': 'a'}), r'^tools\[0\]\.function must be an object'),
    (_tools({'type': 'function', 'function': {'description': 'x'}}), r'^tools\[0\]\.name: missing'),
    (_with([1]), r'^tools\[1\]\.parameters must be a JSON Schema of an object, got a list'),
    (_with({'type': 'string'}), r'^tools\[1\]\.parameters must be the schema of an object'),
    (_with({'type': OBJECT, 'properties': {'x': {'type': 'vector'}}}),
     r'^tools\[1\]\.parameters: .* at \$\.properties\.x\.type$'),
    (_with({'type': OBJECT, 'properties': {'x': {'not': {'type': 'string'}}}}),
     r"^tools\[1\]\.parameters: 'not' at \$\.properties\.x is not enforced by the tool-call grammar; remove it$"),
])
def test_parse_tools_errors_name_the_field(text, message):
    with pytest.raises(ValueError, match=message):
        parse_tools(text)


def _property(schema) -> dict:
    return {'type': OBJECT, 'properties': {'x': schema}}


@pytest.mark.parametrize('parameters, message', [
    (_property({'type': 'string', 'pattern': '^a'}), r"'pattern' at \$\.properties\.x is not enforced"),
    (_property({'type': 'string', 'format': 'date'}), r"'format' at \$\.properties\.x is not enforced"),
    (_property({'type': 'integer', 'minimum': 0}), r"'minimum' at \$\.properties\.x is not enforced"),
    (_property({'type': 'number', 'exclusiveMaximum': 1}), r"'exclusiveMaximum' at \$\.properties\.x "),
    (_property({'type': 'number', 'multipleOf': 2}), r"'multipleOf' at \$\.properties\.x "),
    (_property({'type': 'array', 'uniqueItems': True}), r"'uniqueItems' at \$\.properties\.x is not enforced"),
    (_property({'type': 'array', 'contains': {'type': 'integer'}}), r"'contains' at \$\.properties\.x "),
    (_property({'type': 'array', 'prefixItems': [{'type': 'integer'}]}), r"'prefixItems' at \$\.properties\.x "),
    (_property({'if': {'type': 'string'}, 'then': {'minLength': 1}}), r"'if' at \$\.properties\.x "),
    (_property({'type': OBJECT, 'patternProperties': {'^a': {}}}), r"'patternProperties' at \$\.properties\.x "),
    (_property({'type': OBJECT, 'dependencies': {'a': ['b']}}), r"'dependencies' at \$\.properties\.x "),
    (_property({'type': OBJECT, 'minProperties': 1}), r"'minProperties' at \$\.properties\.x "),
    (_property({'type': OBJECT, 'required': ['a']}), r"'required' without 'properties' at \$\.properties\.x"),
    (_property({'type': OBJECT, 'properties': {'a': {}}, 'required': ['b']}),
     r"required property 'b' at \$\.properties\.x is not in its properties"),
    (_property({'type': 'array', 'items': {'type': 'string', 'pattern': 'a'}}),
     r"'pattern' at \$\.properties\.x\.items is not enforced"),
    (_property({'anyOf': [{'type': 'integer'}, {'type': 'string', 'format': 'email'}]}),
     r"'format' at \$\.properties\.x\.anyOf\[1\] "),
    (_property({'type': 'integer', 'anyOf': [{'type': 'integer'}]}), r"'type' beside 'anyOf' at \$\.properties\.x"),
    (_property({'allOf': [{'type': 'integer'}, {'type': 'number'}]}), r"'allOf' with more than one schema at "),
    (_property({'$ref': 'https://example.com/point.json'}), r"'\$ref' \"https://example.com/point.json\" at "),
    (_property({'$ref': '#/$defs/missing'}), r"'\$ref' \"#/\$defs/missing\" at \$\.properties\.x is not enforced"),
    (_property({'$ref': '#/properties/y'}), r"'\$ref' \"#/properties/y\" at "),
    (_property({'$ref': '#', 'minItems': 1}), r"'minItems' beside '\$ref' at \$\.properties\.x"),
    (_property({'items': {}, 'properties': {}}),
     r'the schema at \$\.properties\.x has keywords of object and array but no .type.'),
    (_property({'type': 'string', 'minLength': 3, 'maxLength': 2}), r"'minLength' 3 is above 'maxLength' 2 at "),
    (_property({'enum': ['a<|"|>b']}),
     r'the value .* at \$\.properties\.x cannot be written in a tool call: its text holds the quote token'),
    (_property({'enum': ['a\ue022']}), r'the value "a\\ue022" at \$\.properties\.x cannot be written .*private-use'),
    (_property({'const': {'not a key': 1}}),
     r'the value \{"not a key": 1\} at \$\.properties\.x cannot .*: key "not a key" is not a bare key'),
    (_property({'type': 'string', 'enum': [1, 2]}), r'no value of the enum or const at \$\.properties\.x is valid'),
    (_property(False), r'the schema at \$\.properties\.x allows no value'),
    ({'type': OBJECT, 'properties': {'a b': {}}}, r"property name 'a b' at \$\.properties is not a bare key"),
    ({'type': OBJECT, 'properties': {'a-b': {}}}, r"property name 'a-b' at \$\.properties is not a bare key"),
    ({'type': OBJECT, 'anyOf': [{'required': ['a']}]}, r"'anyOf' at \$ is not enforced"),
    ({'type': OBJECT, '$defs': {'a': {'type': 'string', 'pattern': 'x'}}, 'properties': {'x': {'$ref': '#/$defs/a'}}},
     r"'pattern' at \$\.\$defs\.a is not enforced"),
])
def test_parse_tools_refuses_what_the_grammar_cannot_enforce(parameters, message):
    with pytest.raises(ValueError, match=r'^tools\[1\]\.parameters: ' + message):
        parse_tools(_with(parameters))


def test_parse_tools_accepts_the_grammars_schemas():
    tools = parse_tools(json.dumps([{'name': tool.name, 'description': tool.description,
                                     'parameters': tool.parameters} for tool in TOOLS]))
    assert tools == TOOLS
    # harmless or irrelevant keywords: annotations, uniqueItems false, another type's keywords, an unused def
    parse_tools(_with({'type': OBJECT, 'title': 'T', '$defs': {'unused': {'pattern': 'x'}}, 'properties': {
        'a': {'type': 'array', 'uniqueItems': False, 'description': 'd', 'default': [], 'examples': [[1]]},
        'b': {'type': 'string', 'items': {'type': 'integer'}},
        'c': {'type': 'integer', 'enum': [1, 2], 'minimum': 2}}}))


def test_check_tool_choice():
    assert check_tool_choice('', TOOLS) == 'auto' and check_tool_choice('', ()) == 'none'
    assert check_tool_choice('auto', ()) == 'none'
    assert [check_tool_choice(choice, TOOLS) for choice in TOOL_CHOICES] == list(TOOL_CHOICES)
    assert check_tool_choice('none', ()) == 'none' and check_tool_choice('plan', TOOLS) == 'plan'
    with pytest.raises(ValueError, match=r'^tool_choice: no tool is named "grab" \(tools: pick, move, plan, free, '):
        check_tool_choice('grab', TOOLS)
    with pytest.raises(ValueError, match=r'^tool_choice: "required" needs tools'):
        check_tool_choice('required', ())
    with pytest.raises(ValueError, match=r'^tool_choice: a tool \("pick"\) needs tools'):
        check_tool_choice('pick', ())
    with pytest.raises(ValueError, match='^tool_choice must be a string'):
        check_tool_choice(None, TOOLS)


def test_validate_arguments_names_the_tool_and_path():
    validate_arguments(TOOLS[0], {'object': 'cup', 'count': 1})
    with pytest.raises(ValueError, match=r"^call of pick: arguments: 'one' is not of type 'integer' at \$\.count$"):
        validate_arguments(TOOLS[0], {'object': 'cup', 'count': 'one'})
    with pytest.raises(ValueError, match=r'^call of plan: arguments: .* at \$\.steps\[0\]\.then\[0\]'):
        validate_arguments(TOOLS[2], {'steps': [{'action': 'go', 'then': [{'action': 'fly'}]}]})


# --- the grammar of a call -------------------------------------------------------------------------------------

def test_call_grammar_is_deterministic_ascii_and_compiles():
    text = grammar_text()
    assert text == grammar_text() and text.isascii() and text.startswith('root ::= "call:" (')
    assert '\\ue022' in text
    xgrammar.Grammar.from_ebnf(text)
    assert grammar_text(names=('pick',)).startswith('root ::= "call:" "pick" tool0_')
    assert grammar_text(names=('plan', 'pick', 'plan')).startswith('root ::= "call:" ("plan" tool2_1 | "pick" tool0_')


def test_call_grammar_refuses_unknown_or_no_names():
    with pytest.raises(ValueError, match=r'no tool is named "grab" \(tools: pick, move'):
        call_grammar(TOOLS, ('pick', 'grab'))
    with pytest.raises(ValueError, match='at least one tool'):
        call_grammar(TOOLS, ())
    with pytest.raises(ValueError, match='at least one tool'):
        call_grammar(())
    with pytest.raises(ValueError, match=r'^tools\[0\]\.parameters: .pattern. at \$\.properties\.x'):
        call_grammar((ToolSpec('bad', '', _property({'type': 'string', 'pattern': 'a'})),))


VALID = [
    ('pick', {'object': 'red cup', 'count': 2, 'gentle': True}),
    ('pick', {'object': ''}),
    ('pick', {'object': 'a "quoted" {x:1}, [y]\n\\', 'gentle': False}),
    ('pick', {'object': 'cup', 'count': -7}),
    ('move', {'speed': 0.5}),
    ('move', {'mode': 'run', 'speed': -1e-3, 'label': 'ab', 'waypoints': [1, 2, 3], 'note': None}),
    ('move', {'speed': 2, 'waypoints': [0], 'note': 'n'}),
    ('move', {'label': 'four', 'speed': 1}),  # in the schema's order below
    ('plan', {'steps': [{'action': 'go', 'target': {'x': 1, 'y': 2.5}}]}),
    ('plan', {'steps': [{'action': 'pick', 'target': 'cup', 'then': [{'action': 'place', 'then': []}]},
                        {'action': 'go'}], 'priority': None, 'extra': {'k': [1, {'j': 'v'}]}, 'any': [True, 'x']}),
    ('plan', {'steps': [{'action': 'go'}], 'priority': True}),
    ('plan', {'steps': [{'action': 'go'}], 'priority': 'high', 'any': {}}),
    ('free', {}),
    ('free', {'a': {'b': [1, -2.5e10, None, False, {}]}, '_c': 'd'}),
    ('stop', {}),
]
INVALID = [
    ('call:grab{}', 'an undeclared tool'),
    ('call:pick{}', 'a missing required key'),
    ('call:pick{count:2}', 'a missing required key'),
    ('call:pick{object:1}', 'a wrong type'),
    ('call:pick{object:<|"|>a<|"|>,count:2.5}', 'a number for an integer'),
    ('call:pick{object:<|"|>a<|"|>,gentle:<|"|>yes<|"|>}', 'a string for a boolean'),
    ('call:pick{object:<|"|>a<|"|>,size:2}', 'an unknown key'),
    ('call:pick{count:2,object:<|"|>a<|"|>}', 'keys out of the schema order'),
    ('call:pick{object:<|"|>a<|"|>,object:<|"|>b<|"|>}', 'a repeated key'),
    ('call:pick{object:<|"|>a\ue022b<|"|>}', 'a quote inside a string'),
    ('call:pick{object:<|"|>a\ue000<|"|>}', 'a private-use character inside a string'),
    ('call:pick{object: <|"|>a<|"|>}', 'whitespace'),
    ('call:pick{object:<|"|>a<|"|>}}', 'text after the arguments'),
    ('call:pick{object:<|"|>a<|"|>,}', 'a trailing comma'),
    ('call:move{speed:1,extra:1}', 'an unknown key (additionalProperties false)'),
    ('call:move{mode:<|"|>fly<|"|>,speed:1}', 'an enum value outside the enum'),
    ('call:move{speed:1,label:<|"|>fives<|"|>}', 'a string over maxLength'),
    ('call:move{speed:1,waypoints:[]}', 'an array under minItems'),
    ('call:move{speed:1,waypoints:[1,2,3,4]}', 'an array over maxItems'),
    ('call:move{speed:1,waypoints:[1.5]}', 'a wrong item type'),
    ('call:move{speed:01}', 'a leading zero'),
    ('call:move{speed:1.}', 'a number without fraction digits'),
    ('call:plan{steps:[]}', 'an array under minItems'),
    ('call:plan{steps:[{action:<|"|>go<|"|>,target:{x:1}}]}', 'an anyOf branch missing a required key'),
    ('call:plan{steps:[{action:<|"|>go<|"|>,target:<|"|><|"|>}]}', 'an anyOf string under minLength'),
    ('call:plan{steps:[{action:<|"|>go<|"|>,then:[{}]}]}', 'a recursive item missing its required key'),
    ('call:plan{steps:[{action:<|"|>go<|"|>}],priority:2}', 'a mixed enum value outside the enum'),
    ('call:plan{steps:[{action:<|"|>go<|"|>}],priority:<|"|>low<|"|>}', 'a mixed enum value outside the enum'),
    ('call:plan{steps:[{action:<|"|>go<|"|>}],extra:[]}', 'an array for an object'),
    ('call:free{a b:1}', 'a key that is not bare'),
    ('call:free{<|"|>a<|"|>:1}', 'a quoted key'),
    ('call:stop{a:1}', 'arguments to a tool without parameters'),
    ('call:stop', 'no arguments'),
    ('pick{object:<|"|>a<|"|>}', 'no call: prefix'),
]


def test_valid_examples_are_valid_and_parse_back():
    by_name = {tool.name: tool for tool in TOOLS}
    for name, arguments in VALID:
        validate_arguments(by_name[name], arguments)
        assert json.loads(parse_call(format_call(name, arguments), TOOLS, 0).arguments) == arguments


@pytest.mark.parametrize('name, arguments', VALID, ids=range(len(VALID)))
def test_grammar_accepts_calls_valid_under_the_schema(matcher, name, arguments):
    if name == 'move':   # keys in the schema's order, as the model writes them
        arguments = {key: arguments[key] for key in MOVE['properties'] if key in arguments}
    assert accepts(matcher, format_call(name, arguments)), format_call(name, arguments)


@pytest.mark.parametrize('body, why', INVALID, ids=[why for _, why in INVALID])
def test_grammar_rejects_invalid_calls(matcher, body, why):
    assert not accepts(matcher, body)


def test_grammar_of_named_tools_accepts_only_them():
    matcher = xgrammar.testing._get_matcher_from_grammar(grammar_text(names=('stop', 'free')))
    assert accepts(matcher, 'call:stop{}') and accepts(matcher, 'call:free{a:1}')
    assert not accepts(matcher, format_call('pick', {'object': 'cup'}))


def test_optional_properties_take_any_subset_in_order():
    schema = {'type': OBJECT, 'properties': {key: {'type': 'integer'} for key in 'abcd'}, 'required': ['c']}
    matcher = xgrammar.testing._get_matcher_from_grammar(call_grammar((ToolSpec('t', '', schema),)))
    for mask in range(16):
        arguments = {key: index for index, key in enumerate('abcd') if mask >> index & 1}
        assert accepts(matcher, format_call('t', arguments)) == ('c' in arguments), arguments
    all_optional = {'type': OBJECT, 'properties': {'a': {'type': 'integer'}}}
    matcher = xgrammar.testing._get_matcher_from_grammar(call_grammar((ToolSpec('t', '', all_optional),)))
    assert accepts(matcher, 'call:t{}') and accepts(matcher, 'call:t{a:1}') and not accepts(matcher, 'call:t{a:}')


def test_lengths_and_item_counts_are_exact():
    schema = {'type': OBJECT, 'properties': {
        's': {'type': 'string', 'minLength': 2, 'maxLength': 3}, 'l': {'type': 'array', 'maxItems': 2},
        'm': {'type': 'array', 'minItems': 2, 'items': {'type': 'null'}}, 'e': {'type': 'array', 'maxItems': 0},
        'u': {'type': 'string', 'maxLength': 1}}}
    tool = ToolSpec('t', '', schema)
    matcher = xgrammar.testing._get_matcher_from_grammar(call_grammar((tool,)))
    cases = [{'s': 'x' * size} for size in range(5)] + [{'l': [1] * size} for size in range(4)]
    cases += [{'m': [None] * size} for size in range(4)] + [{'e': []}, {'e': [1]}, {'u': '☕'}, {'u': '😀'}]
    for arguments in cases:
        valid = jsonschema.Draft202012Validator(schema).is_valid(arguments)
        assert accepts(matcher, format_call('t', arguments)) == valid, arguments


def test_type_lists_enums_and_consts():
    schema = {'type': OBJECT, 'properties': {
        'a': {'type': ['integer', 'string', 'null']}, 'b': {'const': {'k': [1, 'v']}},
        'c': {'type': 'string', 'enum': ['x', 1, 'y']}, 'd': {'enum': [1.0, 'é']}}}
    tool = ToolSpec('t', '', schema)
    matcher = xgrammar.testing._get_matcher_from_grammar(call_grammar((tool,)))
    for arguments in [{'a': 1}, {'a': 'one'}, {'a': None}, {'b': {'k': [1, 'v']}}, {'c': 'x'}, {'c': 'y'},
                      {'d': 1.0}, {'d': 'é'}]:
        assert accepts(matcher, format_call('t', arguments)), arguments
    for arguments in [{'a': 1.5}, {'a': True}, {'b': {'k': [1]}}, {'c': 1}, {'c': 'z'}, {'d': 'e'}]:
        assert not accepts(matcher, format_call('t', arguments)), arguments


def test_definitions_and_root_references():
    schema = {'type': OBJECT, 'definitions': {'Tree': {'type': OBJECT, 'properties': {
        'leaf': {'type': 'integer'}, 'kids': {'type': 'array', 'items': {'$ref': '#/definitions/Tree'}}}}},
        'properties': {'tree': {'$ref': '#/definitions/Tree'}, 'again': {'$ref': '#'}}}
    tool = parse_tools(_tools({'name': 't', 'parameters': schema}))[0]
    matcher = xgrammar.testing._get_matcher_from_grammar(call_grammar((tool,)))
    arguments = {'tree': {'leaf': 1, 'kids': [{'kids': [{'leaf': 2}]}, {}]}, 'again': {'again': {'tree': {}}}}
    validate_arguments(tool, arguments)
    assert accepts(matcher, format_call('t', arguments))
    assert not accepts(matcher, format_call('t', {'tree': {'kids': [{'leaf': 'x'}]}}))


# hand-made strategies of arguments valid under PICK and MOVE (keys in schema order)
GRAMMAR_TEXT = st.text(st.characters(exclude_categories=('Cs', 'Co')), max_size=10)
FINITE = st.floats(allow_nan=False, allow_infinity=False)
PICK_ARGUMENTS = st.fixed_dictionaries({'object': GRAMMAR_TEXT}, optional={
    'count': st.integers(-10 ** 12, 10 ** 12), 'gentle': st.booleans()})
MOVE_ARGUMENTS = st.fixed_dictionaries({'speed': st.integers(-100, 100) | FINITE}, optional={
    'mode': st.sampled_from(['walk', 'run']), 'label': st.text(max_size=4).filter(lambda text: not any(
        '\ue000' <= char <= '\ue0ff' for char in text)),
    'waypoints': st.lists(st.integers(), min_size=1, max_size=3), 'note': st.none() | GRAMMAR_TEXT})
GRAMMAR_JSON = st.recursive(st.none() | st.booleans() | st.integers() | FINITE | GRAMMAR_TEXT,
                            lambda inner: st.lists(inner, max_size=3) | st.dictionaries(KEYS, inner, max_size=3),
                            max_leaves=8)


def _in_order(arguments: dict, schema: dict) -> dict:
    return {key: arguments[key] for key in schema['properties'] if key in arguments}


@settings(max_examples=120, deadline=None)
@given(st.one_of(PICK_ARGUMENTS.map(lambda arguments: ('pick', _in_order(arguments, PICK))),
                 MOVE_ARGUMENTS.map(lambda arguments: ('move', _in_order(arguments, MOVE))),
                 st.dictionaries(KEYS, GRAMMAR_JSON, max_size=4).map(lambda arguments: ('free', arguments))))
def test_grammar_accepts_every_valid_call(matcher, call):
    name, arguments = call
    validate_arguments(next(tool for tool in TOOLS if tool.name == name), arguments)
    assert accepts(matcher, format_call(name, arguments))


LOOSE_VALUES = st.none() | st.booleans() | st.integers(-3, 3) | st.sampled_from([1.5, -0.0]) | \
    st.sampled_from(['', 'cup', 'walk', 'run', 'abcde']) | st.lists(st.integers(-3, 3) | st.just(0.5), max_size=4)


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(['pick', 'move']),
       st.dictionaries(st.sampled_from(['object', 'count', 'gentle', 'mode', 'speed', 'label', 'waypoints', 'note',
                                        'other']), LOOSE_VALUES, max_size=4))
def test_what_the_grammar_accepts_is_valid(matcher, name, arguments):
    tool = next(tool for tool in TOOLS if tool.name == name)
    if accepts(matcher, format_call(name, arguments)):
        validate_arguments(tool, arguments)


def test_patterns_match_names_and_keys():
    assert NAME_PATTERN.fullmatch('nav.go_to-2') and not NAME_PATTERN.fullmatch('2go')
    assert KEY_PATTERN.fullmatch('_a1') and not KEY_PATTERN.fullmatch('a.b') and not KEY_PATTERN.fullmatch('a-b')
    assert QUOTE_CHAR == '\ue022' and len(QUOTE_CHAR) == 1
