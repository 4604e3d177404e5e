"""
uniqueItems kept by the local engine's tracker (engine/logits/unique_tracker.py), on the bundled tokenizer.

What the tracker takes (strings, enum values, objects of those, found without ambiguity) and what stays a gap; its
masks against oracles (every allowed token leaves a completion with distinct items, every other token none, so
no dead end and no valid output left out); escapes, maxLength, objects; speculation (masks along a draft, lookahead
and rollback leave it where it was; greedy speculative output equals plain output); text it cannot read.
"""

import itertools
import json
import random
from pathlib import Path

import jsonschema
import pytest
import torch
from transformers import AutoTokenizer

from gemma_spec_ros.engine.logits import schema as schemas
from gemma_spec_ros.engine.logits.grammar import ConstraintCompiler, constraint_grammar, mask_logits
from gemma_spec_ros.engine.logits.schema_unique import SIGMA, Str, utf8_completions, whole_chars
from gemma_spec_ros.engine.logits.unique_tracker import TrackedGrammar

TOKENIZER = Path(__file__).resolve().parents[2] / 'models' / 'tokenizer'
EOS_IDS = (1, 5)
VOCAB = 4096
STRINGS = {'type': 'array', 'items': {'type': 'string'}, 'uniqueItems': True}
SHORT = {'type': 'array', 'items': {'type': 'string', 'maxLength': 1}, 'uniqueItems': True}
TAGS = {'type': 'array', 'uniqueItems': True, 'items': {
    'type': 'object', 'properties': {'Key': {'type': 'string', 'minLength': 1, 'maxLength': 128},
                                     'Value': {'type': 'string', 'maxLength': 1}},
    'required': ['Key', 'Value'], 'additionalProperties': False}}


@pytest.fixture(scope='module')
def tokenizer():
    return AutoTokenizer.from_pretrained(str(TOKENIZER))


@pytest.fixture(scope='module')
def compiler(tokenizer):
    return ConstraintCompiler(tokenizer, VOCAB, EOS_IDS)


def constraint_at(compiler, schema, text: str):
    """Return a constraint of schema moved past text, one byte token at a time."""
    constraint = compiler.constraint(json_schema=json.dumps(schema))
    by_bytes = compiler.vocabulary().by_bytes
    for byte in text.encode():
        assert constraint.advance(by_bytes[bytes([byte])][0]), text
    return constraint


def allowed(compiler, constraint, *texts: str | bytes) -> list[bool]:
    """Return whether the next mask allows the (one-token) texts."""
    mask = constraint.next_mask()[0]
    return [bool(mask[compiler.vocabulary().by_bytes[text.encode() if isinstance(text, str) else text][0]])
            for text in texts]


# ----------------------------------------------------------------------------------------------- what it takes
@pytest.mark.parametrize('schema', [
    STRINGS, SHORT, TAGS,
    {'type': 'array', 'items': {'enum': ['a', 'b', 'c', 'd', 1, None, True]}, 'uniqueItems': True, 'minItems': 2},
    {'type': ['boolean', 'array'], 'items': {'type': 'string', 'minLength': 20, 'maxLength': 2048},
     'uniqueItems': True},
    {'type': 'object', 'properties': {'x': {'$ref': '#/$defs/names'}, 'y': {'$ref': '#/$defs/names'}},
     '$defs': {'names': STRINGS}},
    {'anyOf': [STRINGS, {'type': 'string'}]},   # told apart by the value's type
])
def test_a_tracked_array_is_no_gap_locally_and_a_gap_without_a_tracker(compiler, schema):
    text = json.dumps(schema)
    prepared = schemas.prepare(text, 'refuse', True)
    assert prepared.gaps == () and prepared.unique is not None
    assert isinstance(compiler.compile_request(text), TrackedGrammar)
    with pytest.raises(ValueError, match=r"^json_schema: 'uniqueItems' at "):
        schemas.prepare(text)   # the vLLM backend: no tracker
    with pytest.raises(ValueError, match=r"^json_schema: 'uniqueItems' at "):
        constraint_grammar('json_schema', text)
    assert schemas.output_check(text, 'check').gaps and not compiler.output_check(text, 'check').gaps


@pytest.mark.parametrize('schema, path', [
    ({'type': 'array', 'items': {'type': 'integer'}, 'uniqueItems': True}, '$'),
    ({'type': 'array', 'items': {'type': 'string', 'pattern': '^[a-z]+$'}, 'uniqueItems': True}, '$'),
    ({'type': 'array', 'items': {'anyOf': [{'type': 'string'}, {'type': 'null'}]}, 'uniqueItems': True}, '$'),
    ({'type': 'array', 'prefixItems': [{'type': 'string'}], 'items': {'type': 'string'}, 'uniqueItems': True}, '$'),
    ({'type': 'array', 'items': {'type': 'object', 'properties': {'a': {'type': 'integer'}}}, 'uniqueItems': True},
     '$'),
    # two objects with the same name: a unique array in one, a plain one in the other
    ({'anyOf': [{'type': 'object', 'properties': {'x': STRINGS}},
                {'type': 'object', 'properties': {'x': {'type': 'array', 'items': {'type': 'string'}}}}]},
     r'$.anyOf[0].properties.x'),
])
def test_what_the_tracker_cannot_keep_stays_a_gap(compiler, schema, path):
    prepared = schemas.prepare(json.dumps(schema), 'check', True)
    assert [(gap.keyword, gap.path) for gap in prepared.gaps] == [('uniqueItems', path)]
    with pytest.raises(ValueError, match=r"^json_schema: 'uniqueItems' at "):
        compiler.constraint(json_schema=json.dumps(schema))


def test_a_few_enum_values_the_tracker_cannot_find_are_their_subsets():
    values = {'type': 'array', 'items': {'enum': ['a', 'b']}, 'uniqueItems': True}
    schema = {'anyOf': [{'type': 'object', 'properties': {'x': values}},
                        {'type': 'object', 'properties': {'x': {'type': 'array'}}}]}
    prepared = schemas.prepare(json.dumps(schema), 'refuse', True)
    assert prepared.gaps == () and prepared.unique is None and '"const": "b"' in prepared.grammar_text


# ----------------------------------------------------------------------------------------------- exact masks
def item_texts(values) -> list[str]:
    return [json.dumps(value, ensure_ascii=False, separators=(',', ':')) for value in values]


@pytest.mark.parametrize('schema, items, low, high', [
    ({'type': 'array', 'items': {'enum': ['a', 'b', 'ab']}, 'uniqueItems': True}, item_texts(['a', 'b', 'ab']), 0, 3),
    ({'type': 'array', 'items': {'enum': ['x', 'y', 1, None, True]}, 'uniqueItems': True, 'minItems': 2,
      'maxItems': 4}, item_texts(['x', 'y', 1, None, True]), 2, 4),
    ({'type': 'array', 'items': {'type': 'boolean'}, 'uniqueItems': True, 'minItems': 1}, ['true', 'false'], 1, 2),
    ({'type': 'array', 'uniqueItems': True, 'maxItems': 3, 'items': {
        'type': 'object', 'properties': {'a': {'enum': ['p', 'q']}, 'b': {'type': 'boolean'}},
        'additionalProperties': False}},
     item_texts([{**a, **b} for a in ({}, {'a': 'p'}, {'a': 'q'}) for b in ({}, {'b': True}, {'b': False})]), 0, 3),
    ({'type': 'array', 'uniqueItems': True, 'minItems': 3, 'items': {
        'type': 'object', 'properties': {'k': {'enum': ['1', '2']}, 'v': {'enum': [1, 2]}}, 'required': ['k', 'v'],
        'additionalProperties': False}}, item_texts([{'k': k, 'v': v} for k in '12' for v in (1, 2)]), 3, 4),
])
def test_masks_allow_exactly_the_prefixes_of_arrays_of_distinct_items(compiler, schema, items, low, high):
    """Finite languages: every allowed token is a prefix of a valid output (no dead end), and every such token."""
    outputs = {'[' + ','.join(order) + ']' for size in range(low, high + 1)
               for order in itertools.permutations(items, size)}
    validator = jsonschema.validators.validator_for(schema)(schema)
    assert all(validator.is_valid(json.loads(output)) for output in outputs)
    encoded = {output.encode() for output in outputs}
    prefixes = {output[:end] for output in encoded for end in range(len(output) + 1)}
    tokens = compiler.vocabulary().tokens
    for seed in range(8):
        rng, constraint, text = random.Random(seed), compiler.constraint(json_schema=json.dumps(schema)), b''
        while not constraint.terminated:
            mask = set(constraint.next_mask()[0].nonzero().flatten().tolist())
            expected = {token for token in range(VOCAB) if tokens[token] and text + tokens[token] in prefixes}
            assert mask == expected | (set(EOS_IDS) if text in encoded else set()), text
            token = rng.choice(sorted(mask))
            assert constraint.advance(token)
            text += tokens[token]


def test_string_items_close_only_as_new_values(compiler):
    assert allowed(compiler, constraint_at(compiler, STRINGS, '["a","a'), '"', 'b', '\\') == [False, True, True]
    assert allowed(compiler, constraint_at(compiler, STRINGS, '["a","\\u0061'), '"', 'b') == [False, True]  # 'a'
    assert allowed(compiler, constraint_at(compiler, STRINGS, '["a\\"","a\\'), '"', 'n') == [True, True]
    assert allowed(compiler, constraint_at(compiler, STRINGS, '["a","b"'), ',', ']') == [True, True]
    # at its maxLength a string can only close: an earlier value is refused before it is complete
    assert allowed(compiler, constraint_at(compiler, SHORT, '["a","'), 'a', 'b', '"') == [False, True, True]
    assert allowed(compiler, constraint_at(compiler, SHORT, '["","'), '"', 'a') == [False, True]
    assert allowed(compiler, constraint_at(compiler, SHORT, '["é","'), b'\xc3') == [True]  # a started character


def test_free_whitespace_between_items(compiler):
    constraint = compiler.constraint(json_schema=json.dumps(STRINGS), json_free_whitespace=True)
    by_bytes = compiler.vocabulary().by_bytes
    for byte in b'[ "a" ,\n  "a':
        assert constraint.advance(by_bytes[bytes([byte])][0])
    assert allowed(compiler, constraint, '"', 'b') == [False, True]


def test_object_items_differ_by_some_field(compiler):
    tags = '[{"Key":"a","Value":"b"},{"Key":"a","Value":"'
    assert allowed(compiler, constraint_at(compiler, TAGS, tags), 'b', 'c', '"') == [False, True, True]
    fixed = json.loads(json.dumps(TAGS))
    fixed['items']['properties']['Value'] = {'enum': ['v']}
    # a Key equal to an earlier one leaves only the earlier object: closing it is refused, a longer Key is not
    assert allowed(compiler, constraint_at(compiler, fixed, '[{"Key":"a","Value":"v"},{"Key":"a'), '"', 'b') == [
        False, True]
    optional = json.loads(json.dumps(fixed))
    optional['items']['properties']['Note'] = {'type': 'boolean'}
    state = constraint_at(compiler, optional, '[{"Key":"a","Value":"v"},{"Key":"a","Value":"v"')
    assert allowed(compiler, state, '}', ',') == [False, True]   # only with a Note does it differ


@pytest.mark.parametrize('schema', [STRINGS, SHORT, TAGS, {
    'type': 'object', 'properties': {'names': {'type': 'array', 'items': {'type': 'string', 'maxLength': 2},
                                               'uniqueItems': True, 'minItems': 2, 'maxItems': 6},
                                     'modes': {'type': 'array', 'items': {'enum': ['a', 'b', 'c']},
                                               'uniqueItems': True, 'minItems': 1}},
    'required': ['names', 'modes']}])
def test_random_outputs_validate_and_never_meet_a_dead_end(compiler, schema):
    tokens, validator = compiler.vocabulary().tokens, jsonschema.validators.validator_for(schema)(schema)
    short = [token for token in range(VOCAB) if 0 < len(tokens[token]) <= 2 and _decodes(tokens[token])]
    completed = 0
    for seed in range(12):
        rng, constraint, text = random.Random(seed), compiler.constraint(json_schema=json.dumps(schema)), b''
        earlier: list[int] = []
        for _ in range(250):
            if constraint.terminated:
                break
            mask = constraint.next_mask()[0]
            ids = mask.nonzero().flatten().tolist()
            assert ids, text   # never a dead end
            stops = [token for token in EOS_IDS if mask[token]]
            repeat = [token for token in earlier if mask[token]]   # drawn towards what was written before
            whole = [token for token in ids if _decodes(tokens[token])] or ids   # (bytes of no character aside)
            pool = stops if stops and rng.random() < 0.9 else repeat if repeat and rng.random() < 0.6 else (
                [token for token in short if mask[token]] or whole)
            token = rng.choice(pool)
            assert constraint.advance(token)
            text += tokens[token]
            earlier.append(token)
        if constraint.completed:
            completed += 1
            assert validator.is_valid(json.loads(text.decode())), text
    assert completed >= 6


# ----------------------------------------------------------------------------------------------- speculation
def test_masks_along_a_draft_equal_the_masks_token_by_token_and_leave_no_trace(compiler):
    schema = {'type': 'array', 'items': {'type': 'string', 'maxLength': 1}, 'uniqueItems': True, 'maxItems': 8}
    constraint = constraint_at(compiler, schema, '["a","b","')
    by_bytes = compiler.vocabulary().by_bytes
    draft = [by_bytes[text][0] for text in (b'a', b'c', b'"', b',', b'"', b'b')]   # 'a' and then 'b' repeat
    before = constraint.next_mask()
    masks, allowed_count = constraint.masks_along(draft)
    assert allowed_count == 0 and torch.equal(constraint.next_mask(), before)   # 'a' is refused first
    draft = [by_bytes[text][0] for text in (b'c', b'"', b',', b'"', b'b')]
    masks, allowed_count = constraint.masks_along(draft)
    assert allowed_count == 4   # c"," then 'b' (a repeat at its maxLength) is refused
    for row, token in enumerate(draft[:allowed_count]):
        assert torch.equal(masks[row], constraint.next_mask()[0]) and constraint.advance(token)
    assert torch.equal(masks[allowed_count], constraint.next_mask()[0])
    constraint.rollback(allowed_count)
    assert torch.equal(constraint.next_mask(), before)
    with constraint.lookahead() as look:
        assert look.push(draft[0]) and look.push(draft[1])
    assert torch.equal(constraint.next_mask(), before)


def test_greedy_speculation_equals_plain_decoding_when_the_model_repeats(compiler):
    """A target that would write "a" again and again, and drafters that propose it: the tracker decides alike."""
    tokens = compiler.vocabulary().tokens
    favourite = {token: 5.0 - len(tokens[token]) for token in range(VOCAB) if tokens[token] in (b'a', b'"', b',',
                                                                                              b'[', b']')}

    def target(context: list[int]) -> torch.Tensor:
        logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(hash(tuple(context[-3:])))) * 0.5
        for token, bonus in favourite.items():
            logits[token] += bonus
        logits[list(EOS_IDS)] += 0.3 * len(context)
        return logits

    def run(schema: dict, k: int, masked: bool) -> list[int]:
        constraint, out = compiler.constraint(json_schema=json.dumps(schema)), []
        while not constraint.terminated and len(out) < 80:
            draft: list[int] = []
            if masked:   # a drafter that masks its own logits under the grammar (as mtp and draft do)
                with constraint.lookahead() as look:
                    while len(draft) < k:
                        draft.append(int(mask_logits(target(out + draft)[None], look.mask()).argmax()))
                        if not look.push(draft[-1]):
                            break
            else:        # one that ignores it: its refused drafts cost their rejection
                while len(draft) < k:
                    draft.append(int(target(out + draft).argmax()))
            masks, _ = constraint.masks_along(draft)
            picks = [int(mask_logits(target(out + draft[:index])[None], masks[index:index + 1]).argmax())
                     for index in range(len(draft) + 1)]
            accepted = next((index for index, token in enumerate(draft) if picks[index] != token), len(draft))
            new = draft[:accepted] + [picks[accepted]]
            new = new[:next((index + 1 for index, token in enumerate(new) if token in EOS_IDS), len(new))]
            constraint.accept(new)
            out += new
        return out

    for schema in (dict(SHORT, minItems=3), {'type': 'array', 'items': {'enum': ['a', 'b', 'c']}, 'uniqueItems': True,
                                             'minItems': 2}):
        plain = run(schema, 0, True)
        text = b''.join(tokens[token] for token in plain if token not in EOS_IDS)
        assert plain[-1] in EOS_IDS and len(json.loads(text)) > 1 and jsonschema.validate(json.loads(text), schema) \
            is None
        for k, masked in itertools.product((1, 3, 5), (True, False)):
            assert run(schema, k, masked) == plain, (k, masked)


# ----------------------------------------------------------------------------------------------- pieces
def test_text_it_cannot_read_stops_the_tracker_without_an_error(compiler):
    constraint = compiler.constraint(json_schema=json.dumps(STRINGS))
    tracker = constraint._tracker
    lost = tracker.after(tracker.history[-1], b'["a"]]]')   # not JSON (an xgrammar slip would be): no exception
    assert lost is not None and lost.uniq is None and tracker.after(lost, b'"a"') is lost


def test_character_counts():
    assert whole_chars('aé'.encode()) == (2, b'') and whole_chars('aé'.encode()[:-1]) == (1, b'\xc3')
    assert utf8_completions(b'\xc3') == 64 and utf8_completions(b'\xe0') == 32 * 64
    assert utf8_completions(b'\xed\xa0') == 0 and utf8_completions(b'\xf4') == 16 * 64 * 64
    for partial in (b'\xe2', b'\xf0\x9f', b'\xf4\x8f\xbf'):   # against Python's decoder
        assert utf8_completions(partial) == sum(
            1 for rest in itertools.product(range(0x80, 0xC0), repeat=(4 if partial[0] >= 0xF0 else 3) - len(partial))
            if _decodes(partial + bytes(rest)))
    assert Str(1, 2).size(10 ** 20) == SIGMA + SIGMA ** 2 and Str(0, 0).size(5) == 1 and SIGMA == 1112030
    assert whole_chars(b'a\xed\xb4\xb4') == (2, b'') and whole_chars(b'\xed\xb4') == (0, b'\xed\xb4')  # as xgrammar


def _decodes(data: bytes) -> bool:
    try:
        data.decode('utf-8')
    except UnicodeDecodeError:
        return False
    return True
