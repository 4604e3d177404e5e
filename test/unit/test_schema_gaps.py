"""
JSON Schema goals: keywords the grammar cannot enforce, what the rewrite enforces, the final check, numbers' digits.

Keywords the grammar cannot enforce are refused or checked; the rewrite makes xgrammar enforce the rest; the final
validator check; the bound on numbers' digits. On the bundled tokenizer, no model.
"""

import itertools
import json
import re
from pathlib import Path

import jsonschema
import pytest
from transformers import AutoTokenizer

from gemma_spec_ros.engine.logits import schema as schemas
from gemma_spec_ros.engine.logits.grammar import ConstraintCompiler
from gemma_spec_ros.engine.logits.schema_regex import Unsupported, read_pattern
from gemma_spec_ros.engine.types import GenerationWarning, WarningKind

TOKENIZER = Path(__file__).resolve().parents[2] / 'models' / 'tokenizer'
EOS_IDS = (1, 5)
NUMBER = {'type': 'object', 'properties': {'x': {'type': 'number'}}, 'required': ['x']}
PLANNER_DIGITS = (15, 6)
# an ISO-8601 date-time pattern with optional groups and lookaheads (SchemaStore writes such)
ISO_8601 = r'^(\d{4})(?!\d{2}\b)(-(\d{2})(-(\d{2})(T(\d{2}):(\d{2})(:(\d{2}))?)?)?)?$'


@pytest.fixture(scope='module')
def tokenizer():
    return AutoTokenizer.from_pretrained(str(TOKENIZER))


@pytest.fixture(scope='module')
def compiler(tokenizer):
    return ConstraintCompiler(tokenizer, 4096, EOS_IDS)


def accepts(compiler, tokenizer, schema, text: str, unenforced: str = '', digits=(0, 0)) -> bool:
    """Whether the grammar of schema takes text whole (tokenized by the bundled tokenizer)."""
    constraint = compiler.constraint(json_schema=json.dumps(schema), unenforced=unenforced, number_digits=digits)
    ids = tokenizer(text, add_special_tokens=False).input_ids
    taken = 0
    for token in ids:
        if not constraint.advance(token):
            break
        taken += 1
    return taken == len(ids) and constraint.completed


def valid(schema, text: str) -> bool:
    return jsonschema.validators.validator_for(schema)(schema).is_valid(json.loads(text))


# ----------------------------------------------------------------------------------------------- refuse or check
@pytest.mark.parametrize('schema, keyword, path', [
    ({'type': 'object', 'properties': {'ids': {'type': 'array', 'items': {'type': 'integer'}, 'uniqueItems': True}}},
     'uniqueItems', r'\$\.properties\.ids'),
    ({'type': 'number', 'multipleOf': 0.5}, 'multipleOf', r'\$'),
    ({'type': 'integer', 'multipleOf': 15, 'minimum': 1}, 'multipleOf', r'\$'),
    ({'type': 'integer', 'multipleOf': 7}, 'multipleOf', r'\$'),   # unbounded, xgrammar lets 8 through
    ({'$defs': {'when': {'type': 'string', 'pattern': ISO_8601}}, 'type': 'object',
      'properties': {'at': {'$ref': '#/$defs/when'}}}, 'pattern', r'\$\.\$defs\.when'),
    ({'type': 'object', 'properties': {'a': {'type': 'integer'}}, 'if': {'required': ['a']}, 'then': {}},
     'if', r'\$'),
    ({'type': 'object', 'dependentRequired': {'a': ['b']}}, 'dependentRequired', r'\$'),
    ({'type': 'array', 'contains': {'const': 1}}, 'contains', r'\$'),
    ({'type': 'string', 'not': {'pattern': '^a'}}, 'not', r'\$'),
    ({'oneOf': [{'type': 'integer'}, {'type': 'number'}]}, 'oneOf', r'\$'),
])
def test_an_unenforced_keyword_is_refused_by_default_naming_it_and_its_path(compiler, schema, keyword, path):
    for fields in ({}, {'unenforced': ''}, {'unenforced': 'refuse'}):
        with pytest.raises(ValueError, match=r"^json_schema: '{}' at {}( \(.*\))? is not enforced by the grammar "
                                             r"engine; remove it, or set json_schema_unenforced to 'check'".format(
                                                 keyword, path)):
            compiler.constraint(json_schema=json.dumps(schema), **fields)
    prepared = schemas.prepare(json.dumps(schema), 'check')   # with check: compiled without it, named
    assert [gap.keyword for gap in prepared.gaps][:1] == [keyword]
    assert compiler.constraint(json_schema=json.dumps(schema), unenforced='check') is not None


def test_a_step_within_a_narrow_range_is_enforced_and_a_step_of_one_is_no_gap(compiler, tokenizer):
    stepped = {'type': 'integer', 'multipleOf': 7, 'minimum': -20, 'maximum': 100}
    assert [accepts(compiler, tokenizer, stepped, text) for text in ('14', '-14', '8', '105')] == \
        [True, True, False, False]
    assert schemas.prepare(json.dumps({'type': 'integer', 'multipleOf': 1})).gaps == ()


@pytest.mark.parametrize('schema, path', [
    ({'type': 'integer', 'maximum': 10 ** 400}, r'\$\.maximum'),
    ({'type': 'integer', 'multipleOf': 10 ** 30}, r'\$\.multipleOf'),
    ({'type': 'object', 'properties': {'n': {'enum': [1, -(2 ** 63) - 1]}}}, r'\$\.properties\.n\.enum\[1\]'),
    ({'type': 'string', 'maxLength': 2 ** 64}, r'\$\.maxLength'),
])
def test_an_integer_past_int64_is_refused_naming_where(compiler, schema, path):
    # xgrammar reads a schema's integers as int64 and fails past them without a message
    with pytest.raises(ValueError, match=r'^json_schema: the integer at {} has \d+ digits; the grammar engine reads '
                                         r'integers of at most 19'.format(path)):
        compiler.constraint(json_schema=json.dumps(schema))
    assert compiler.constraint(json_schema=json.dumps({'type': 'integer', 'minimum': -2 ** 63, 'maximum': 2 ** 63 - 1}))


def test_the_check_policy_warns_and_validates_at_the_end(compiler, tokenizer):
    schema = {'type': 'array', 'items': {'type': 'integer'}, 'uniqueItems': True}
    check = compiler.output_check(json.dumps(schema), 'check')
    assert accepts(compiler, tokenizer, schema, '[1,1]', 'check')   # the grammar lets duplicates through ...
    warnings: list[GenerationWarning] = []
    assert not schemas.check_output(check, '[1,1]', True, warnings)   # ... the check does not
    assert [w.kind for w in warnings] == [WarningKind.UNENFORCED_KEYWORD, WarningKind.SCHEMA_VIOLATION]
    assert "'uniqueItems' at $ is not enforced by the grammar engine; the output was validated" in warnings[0]
    assert "$ fails 'uniqueItems' at $.uniqueItems" in warnings[1] and 'structure_complete is false' in warnings[1]
    warnings = []
    assert schemas.check_output(check, '[1,2]', True, warnings)
    assert [w.kind for w in warnings] == [WarningKind.UNENFORCED_KEYWORD]
    warnings = []
    assert not schemas.check_output(check, '[1,', False, warnings)   # incomplete stays incomplete, not checked
    assert [w.kind for w in warnings] == [WarningKind.UNENFORCED_KEYWORD]


def test_the_validator_gate_names_the_failing_path_and_keyword():
    schema = {'type': 'object', 'properties': {'steps': {'type': 'array', 'items': {
        'type': 'object', 'properties': {'target': {'type': 'string', 'maxLength': 3}}}}}}
    check = schemas.output_check(json.dumps(schema))
    warnings: list[GenerationWarning] = []
    assert not schemas.check_output(check, '{"steps":[{"target":"kitchen"}]}', True, warnings)
    assert len(warnings) == 1 and warnings[0].kind is WarningKind.SCHEMA_VIOLATION
    assert "$.steps[0].target fails 'maxLength' at $.properties.steps.items.properties.target.maxLength" in warnings[0]
    assert not schemas.check_output(check, '{"steps":', True, [])   # not JSON: not complete either
    assert schemas.check_output(check, '{"steps":[{"target":"bin"}]}', True, [])
    assert schemas.check_output(None, 'anything', True, [])   # no json_schema: nothing to check


def test_the_validator_is_the_draft_the_schema_declares():
    draft4 = {'$schema': 'http://json-schema.org/draft-04/schema#', 'type': 'number', 'minimum': 1,
              'exclusiveMinimum': True}
    check = schemas.output_check(json.dumps(draft4))
    assert isinstance(check.validator, jsonschema.Draft4Validator)
    assert not schemas.check_output(check, '1', True, []) and schemas.check_output(check, '1.5', True, [])
    assert '"exclusiveMinimum": 1' in schemas.prepare(json.dumps(draft4)).grammar_text   # xgrammar's form


@pytest.mark.parametrize('value, message', [
    ('ignore', r"^json_schema_unenforced must be one of refuse\|check \(\'\' = refuse\), got 'ignore'$"),
    (True, r'^json_schema_unenforced must be one of'),
])
def test_a_bad_policy_names_the_field(compiler, value, message):
    with pytest.raises(ValueError, match=message):
        compiler.constraint(json_schema='{"type": "integer"}', unenforced=value)


@pytest.mark.parametrize('schema, message', [
    ({'type': 'string', 'const': 1}, r"^json_schema: 'const' at \$: no value satisfies the keywords beside it$"),
    ({'properties': {'a': {'$ref': 'other.json#/a'}}},
     r"^json_schema: '\$ref' 'other\.json#/a' at \$\.properties\.a: only references inside the document"),
    ({'type': 'object', 'required': ['a'], 'additionalProperties': False},
     r"^json_schema: \$ requires 'a', which it does not allow$"),
])
def test_what_no_policy_can_serve_is_refused_whatever_the_policy(compiler, schema, message):
    for policy in ('refuse', 'check'):
        with pytest.raises(ValueError, match=message):
            compiler.constraint(json_schema=json.dumps(schema), unenforced=policy)


# ----------------------------------------------------------------------------------------------- enforced now
@pytest.mark.parametrize('schema, invalid, valid_text', [
    # a property in required but not in properties (xgrammar dropped it)
    ({'type': 'object', 'properties': {'a': {'type': 'integer'}}, 'required': ['a', 'b']}, '{"a":1}', '{"a":1,"b":2}'),
    # a required property of an object reached through a $ref to a non-standard location
    ({'type': 'object', 'properties': {'pose': {'$ref': '#/components/schemas/Pose'}}, 'required': ['pose'],
      'components': {'schemas': {'Pose': {'type': 'object', 'properties': {'x': {'type': 'number'}},
                                          'required': ['x']}}}}, '{"pose":{}}', '{"pose":{"x":1}}'),
    # a top-level $ref into definitions/<a>/<b>
    ({'$ref': '#/definitions/robot/pose', 'definitions': {'robot': {'pose': {
        'type': 'object', 'properties': {'x': {'type': 'number'}}, 'required': ['x']}}}}, '1', '{"x":1}'),
    # siblings of $ref (draft 2020-12), of anyOf, and allOf
    ({'$defs': {'p': {'type': 'object', 'properties': {'z': {'type': 'integer'}}}}, '$ref': '#/$defs/p',
      'required': ['z']}, '{}', '{"z":1}'),
    ({'type': 'string', 'anyOf': [{'maxLength': 2}, {'pattern': '^x'}]}, '"abc"', '"x"'),
    ({'allOf': [{'type': 'object', 'properties': {'a': {'type': 'integer'}}, 'required': ['a']},
                {'properties': {'b': {'type': 'integer'}}, 'required': ['b']}]}, '{"a":1}', '{"a":1,"b":2}'),
    # enum beside other keywords, typeless keywords, lengths beside format, lengths beside a pattern
    ({'type': 'string', 'enum': ['a', 'abc', 1], 'maxLength': 2}, '"abc"', '"a"'),
    ({'minimum': 3}, '1', '5'),
    ({'type': 'string', 'format': 'uri', 'maxLength': 12}, '"http://a.b/cdefgh"', '"http://a.b/"'),
    ({'type': 'string', 'pattern': '^arn:[a-z]+:.+$', 'maxLength': 12}, '"arn:aws:abcdef"', '"arn:aws:abc"'),
    # oneOf alternatives kept apart by required properties; uniqueItems over a few values
    ({'type': 'object', 'properties': {'deny': {'type': 'string'}, 'grant': {'type': 'string'}},
      'oneOf': [{'required': ['deny']}, {'required': ['grant']}]}, '{"deny":"a","grant":"b"}', '{"deny":"a"}'),
    ({'type': 'array', 'items': {'enum': ['left', 'right', 'up']}, 'uniqueItems': True}, '["up","up"]',
     '["left","up"]'),
    # not of required / type, draft-04 exclusive bounds, an items list (draft 2019-09)
    ({'type': 'object', 'properties': {'a': {'type': 'integer'}, 'b': {'type': 'integer'}},
      'not': {'required': ['b']}}, '{"a":1,"b":2}', '{"a":1}'),
    ({'not': {'type': ['string', 'object', 'array', 'number']}}, '1', 'true'),
    ({'$schema': 'https://json-schema.org/draft/2019-09/schema', 'type': 'array', 'items': [{'type': 'integer'}],
      'additionalItems': False}, '[1,2]', '[1]'),
])
def test_what_xgrammar_dropped_is_enforced_now(compiler, tokenizer, schema, invalid, valid_text):
    assert not valid(schema, invalid) and valid(schema, valid_text)
    assert schemas.prepare(json.dumps(schema)).gaps == ()
    assert not accepts(compiler, tokenizer, schema, invalid)
    assert accepts(compiler, tokenizer, schema, valid_text)


DRAFT4 = 'http://json-schema.org/draft-04/schema#'
CLOSED = {'type': 'object', 'additionalProperties': False}


@pytest.mark.parametrize('schema, texts', [
    # a common const property told apart; a type list told apart type by type (null belongs to the second only)
    ({'type': ['object', 'null'], 'properties': {'on': {'type': 'boolean'}, 'to': {'type': 'string'}},
      'additionalProperties': False, 'oneOf': [
          {'type': 'object', 'properties': {'on': {'const': True}, 'to': {'minLength': 1}}, 'required': ['on', 'to']},
          {'properties': {'on': {'const': False}}, 'required': ['on']}]},
     ['null', '{"on":true,"to":"a"}', '{"on":false}', '{"on":false,"to":""}', '{"on":true}', '{}', '{"to":"a"}']),
    # two closed objects that only share {}: each becomes the objects with one of its names
    ({'oneOf': [dict(CLOSED, properties={'order': {'const': 'legacy'}, 'legacy': {'type': 'object'}}),
                dict(CLOSED, properties={'order': {'const': 'fifo'}})]},
     ['{}', '{"order":"legacy"}', '{"order":"fifo"}', '{"legacy":{}}', '{"order":"legacy","legacy":{}}',
      '{"order":"fifo","legacy":{}}']),
    # a name one requires and the other may leave out: the other without it
    ({'oneOf': [dict(CLOSED, properties={'a': {'type': 'integer'}, 'b': {'type': 'integer'}}, required=['a']),
                dict(CLOSED, properties={'a': {'type': 'integer'}, 'c': {'type': 'integer'}})]},
     ['{}', '{"a":1}', '{"a":1,"b":2}', '{"c":3}', '{"a":1,"c":3}']),
    # arrays: the empty one is both alternatives' (left out); items tell the others apart
    ({'oneOf': [{'type': 'array', 'items': {'type': 'string'}}, {'type': 'array', 'items': {'type': 'integer'}}]},
     ['[]', '["a"]', '[1]', '[1,2]']),
    # an alternative that is itself a oneOf, read through
    ({'oneOf': [dict(CLOSED, properties={'path': {'type': 'string'}}, required=['path']),
                {'oneOf': [dict(CLOSED, properties={'source': {'type': 'string'}}, required=['source']),
                           dict(CLOSED, properties={'value': {'type': 'string'}}, required=['value'])]}]},
     ['{"path":"a"}', '{"source":"a"}', '{"value":"a"}']),
    # draft-04 has no const: both alternatives accept everything, so the optional name is never valid
    ({'$schema': DRAFT4, 'type': 'object', 'properties': {'mode': {'oneOf': [{'const': 'a'}, {'const': 'b'}]},
                                                            'x': {'type': 'integer'}}},
     ['{}', '{"mode":"a"}', '{"x":1}']),
])
def test_one_of_is_written_as_the_values_of_exactly_one_alternative(compiler, tokenizer, schema, texts):
    assert schemas.prepare(json.dumps(schema), 'refuse', True).gaps == ()
    for text in texts:
        assert accepts(compiler, tokenizer, schema, text) == valid(schema, text), text


@pytest.mark.parametrize('schema', [
    {'oneOf': [{'type': 'integer'}, {'type': 'number'}]},   # integers are numbers: not written apart
    {'$schema': DRAFT4, 'oneOf': [{'const': 'a'}, {'type': 'integer'}]},   # the first accepts everything in draft-04
    {'oneOf': [dict(CLOSED, properties={'a': {'type': 'string', 'maxLength': 3}}),
               dict(CLOSED, properties={'a': {'type': 'string', 'minLength': 2}})]},   # values that overlap in part
])
def test_one_of_alternatives_not_written_apart_stay_a_gap(schema):
    assert [gap.keyword for gap in schemas.prepare(json.dumps(schema), 'check', True).gaps] == ['oneOf']


def test_draft4_not_of_const_is_not_of_everything():
    with pytest.raises(ValueError, match="'not' at \\$: not of a schema that accepts everything"):
        schemas.prepare(json.dumps({'$schema': DRAFT4, 'type': 'string', 'not': {'const': 'a'}}))


def test_the_schema_corpus_is_refused_at_most_one_time_in_ten_naming_the_keyword():
    """Issue 52: the local engine (with its uniqueItems tracker) refuses at most 10 % of test/data/schemas."""
    corpus = Path(__file__).resolve().parents[1] / 'data' / 'schemas'
    refused = []
    entries = json.loads((corpus / 'manifest.json').read_text())['schemas']
    for entry in entries:
        gaps = schemas.prepare((corpus / entry['file']).read_text(), 'check', True).gaps
        refused += [gaps[0].keyword] if gaps else []
    assert len(refused) <= len(entries) // 10 and all(refused), refused


def test_a_recursive_schema_merged_with_siblings_refers_to_itself():
    schema = {'type': 'object', 'additionalProperties': {'minProperties': 1, 'anyOf': [
        {'type': 'string'}, {'$ref': '#/definitions/node'}]}, 'definitions': {'node': {
            'type': 'object', 'additionalProperties': {'minProperties': 1, 'anyOf': [
                {'type': 'string'}, {'$ref': '#/definitions/node'}]}}}}
    rewritten = json.loads(schemas.prepare(json.dumps(schema)).grammar_text)
    assert any(name.startswith('merged') for name in rewritten['$defs'])


# ----------------------------------------------------------------------------------------------- patterns
@pytest.mark.parametrize('pattern, feature', [
    (r'^P(?!$)(\d+D)?$', 'a negative lookahead'),
    (r'^a(?=b)', 'a lookahead'),
    (r'^a\bb$', r"the escape '\b'"),
    (r'^(a)\1$', r"the escape '\1'"),
    (r'^(a$|b)c', r"'$' before the end of the match"),
    (r'a^', r"'^' where a match cannot start"),
    (r'^[[:alpha:]]$', "a '[' inside a class"),
    (r'^a{,3}$', "a '{' that is not a repetition"),
    (r'(?i)^a$', 'a group flag or name'),
])
def test_pattern_features_outside_the_enforced_subset(pattern, feature):
    with pytest.raises(Unsupported, match=re.escape(feature)):
        read_pattern(pattern)


def test_patterns_in_the_subset_and_their_lengths():
    parsed = read_pattern(r'^[.\-_/#A-Za-z0-9]{1,512}\Z')
    assert parsed.grammar_text == r'^[.\-_/#A-Za-z0-9]{1,512}$' and (parsed.min_length, parsed.max_length) == (1, 512)
    assert parsed.with_lengths(0, 512) == parsed.grammar_text       # implied: nothing to add
    assert parsed.with_lengths(2, 64) == r'^[.\-_/#A-Za-z0-9]{2,64}$'
    assert read_pattern(r'^(ab)+$').with_lengths(0, 3) is None       # a group: not foldable
    capped = read_pattern(r'^(ab)+$').capped(5)
    assert capped.grammar_text == r'^(ab){1,2}$' and capped.max_length == 4
    assert read_pattern('^[^\n]*$').grammar_text == r'^[^\x0a]*$'  # a raw newline, escaped for xgrammar


@pytest.mark.parametrize('pattern, written', [
    (r'^(?!\.)(?!\./).+', r'^(?:[^\u002e\n].*)'),   # not starting with '.' (nor './', which does)
    (r'^((?![:*$])[\x00-\x7F]){1,100}', r'^[\u0000-\u0023\u0025-\u0029\u002b-9\u003b-\u007f]{1,100}'),
    (r'^(?!ab$)(?!b).*$', r'^(?:[^ab\n].*|a(?:[^b\n].*|b(?:[^\n].*)){0,1}){0,1}$'),
])
def test_negative_lookaheads_written_out_mean_the_same(pattern, written):
    assert read_pattern(pattern).grammar_text == written
    samples = [''.join(chars) for size in range(4) for chars in itertools.product('ab.:/*$x\n', repeat=size)]
    assert all(bool(re.fullmatch(pattern, text)) == bool(re.fullmatch(written, text)) for text in samples)


def test_a_lookahead_of_names_in_pattern_properties(compiler, tokenizer):
    schema = {'type': 'object', 'properties': {'vars': {'type': 'object', 'additionalProperties': {'type': 'integer'}}},
              'patternProperties': {'^(?!vars$).+$': {'type': 'string'}}, 'additionalProperties': False}
    assert schemas.prepare(json.dumps(schema)).gaps == ()
    for text in ('{"vars":{"a":1}}', '{"vars":"x"}', '{"var":"x"}', '{"varsx":"x"}'):
        assert accepts(compiler, tokenizer, schema, text) == valid(schema, text), text


def test_optional_groups_are_written_as_xgrammar_reads_them(compiler, tokenizer):
    """Xgrammar 0.2.8 reads `(?:ab*)?` as `a?b*`: the grammar gets `{0,1}`."""
    assert read_pattern(r'^x(?:ab*)?$').grammar_text == r'^x(?:ab*){0,1}$'
    schema = {'type': 'string', 'pattern': r'^x(?:ab*)?$'}
    for text in ('"x"', '"xa"', '"xabb"', '"xb"', '"xbb"'):
        assert accepts(compiler, tokenizer, schema, text) == valid(schema, text), text


def test_long_repetitions_keep_to_json_string_characters(compiler, tokenizer):
    """Xgrammar 0.2.8 lets raw quotes into {n,m} with m > 128 of a character that could match one."""
    assert read_pattern(r'^[^:*]{1,512}$').grammar_text == r'^[^\u0000-\u001f\u0022\u002a\u003a\u005c]{1,512}$'
    assert read_pattern(r'^\S{2,200}$').grammar_text == r'^[^\s\u0000-\u001f\u0022\u005c]{2,200}$'
    assert read_pattern(r'^[a-z]{1,512}$').grammar_text == r'^[a-z]{1,512}$'   # no quote to let in
    schema = {'type': 'object', 'properties': {'name': {'type': 'string', 'pattern': '^[^:*]{1,512}$'},
                                               'chain': {'type': 'string', 'pattern': '^[\t\n -\u00ff]+$',
                                                         'maxLength': 2097152}}}   # compiled in well under a second
    assert not accepts(compiler, tokenizer, schema, '{"name":"a"b"}')
    assert accepts(compiler, tokenizer, schema, '{"name":"' + 'a' * 512 + '","chain":"x y"}')
    assert not accepts(compiler, tokenizer, schema, '{"name":"' + 'a' * 513 + '"}')
    assert not accepts(compiler, tokenizer, schema, '{"chain":"a"b"}')


# ----------------------------------------------------------------------------------------------- numbers
def test_a_digit_bound_rejects_a_long_fraction_and_accepts_normal_numbers(compiler, tokenizer):
    long_fraction = '{"x":-1.' + '0' * 40 + '}'
    assert accepts(compiler, tokenizer, NUMBER, long_fraction)   # unbounded, as xgrammar writes numbers
    assert not accepts(compiler, tokenizer, NUMBER, long_fraction, digits=PLANNER_DIGITS)
    for text in ('{"x":0}', '{"x":-1.5}', '{"x":3.141593}', '{"x":123456789012345}', '{"x":1e-5}',
                 '{"x":-2.5E+10}'):
        assert accepts(compiler, tokenizer, NUMBER, text, digits=PLANNER_DIGITS), text
    for text in ('{"x":3.1415926}', '{"x":1234567890123456}', '{"x":1e1000}'):
        assert not accepts(compiler, tokenizer, NUMBER, text, digits=PLANNER_DIGITS), text


def test_the_digit_bound_covers_integers_and_ranged_numbers(compiler, tokenizer):
    schema = {'type': 'array', 'items': {'anyOf': [{'type': 'integer'}, {'type': 'number', 'minimum': 0}]}}
    assert accepts(compiler, tokenizer, schema, '[' + '9' * 20 + ']')
    assert not accepts(compiler, tokenizer, schema, '[' + '9' * 20 + ']', digits=PLANNER_DIGITS)
    assert accepts(compiler, tokenizer, schema, '[12,0.5,-3]', digits=PLANNER_DIGITS)
    bounded = {'type': 'number', 'minimum': 0, 'maximum': 1}   # a schema's own range keeps its own fractions
    ebnf = schemas.bound_numbers('root ::= (("0" "." root_8{1, 6}))\nroot_8 ::= (([0-9]))', 15, 3)
    assert 'root_8{1, 6}' in ebnf
    assert accepts(compiler, tokenizer, bounded, '0.25', digits=PLANNER_DIGITS)


def test_digit_bounds_are_separate_cache_entries(compiler):
    text = json.dumps(NUMBER)
    bounded = compiler.compile_request(text, number_digits=PLANNER_DIGITS)
    assert compiler.compile_request(text, number_digits=PLANNER_DIGITS) is bounded
    assert compiler.compile_request(text) is not bounded
