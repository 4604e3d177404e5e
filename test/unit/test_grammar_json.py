"""
JSON Schema constraints on the bundled tokenizer: valid output for 26 schemas, constrained greedy parity, errors.

A toy target and draft model (seeded logits per context, drawn towards closing tokens as the output grows) run
the engine's constrained round: draft under the grammar, masks along the draft, masked target, `verify()`,
accept. The engine wires the same steps around its models.
"""

import json
import re
from pathlib import Path

import jsonschema
import pytest
import torch
from transformers import AutoTokenizer

from gemma_spec_ros.engine.logits.grammar import ConstraintCompiler, mask_logits
from gemma_spec_ros.engine.logits.sampling import SamplingParams, logits_to_probs
from gemma_spec_ros.engine.logits.verify import verify

TOKENIZER = Path(__file__).resolve().parents[2] / 'models' / 'tokenizer'
EOS_IDS = (1, 5)            # <eos>, <turn|>
PADDED_VOCAB = 4096 + 64    # a model head wider than the tokenizer, as many checkpoints have
MAX_NEW = 600
CLOSING_PULL = 0.08         # logit added per generated token to tokens that end values, objects and arrays
SAMPLING = SamplingParams(temperature=1.0)
OBJECT = 'object'

STEP = {'type': OBJECT, 'properties': {'action': {'enum': ['navigate', 'pick', 'place']},
                                       'target': {'type': 'string', 'minLength': 1, 'maxLength': 20}},
        'required': ['action', 'target']}
POINT = {'type': OBJECT, 'properties': {axis: {'type': 'number'} for axis in 'xyz'}, 'required': ['x', 'y', 'z']}
SCHEMAS = {
    'plan': {'type': OBJECT, 'properties': {'steps': {'type': 'array', 'items': STEP, 'minItems': 1, 'maxItems': 4}},
             'required': ['steps']},
    'flat': {'type': OBJECT, 'properties': {'name': {'type': 'string'}, 'count': {'type': 'integer'}},
             'required': ['name', 'count']},
    'enum': {'type': OBJECT, 'properties': {'mode': {'enum': ['idle', 'explore', 'dock', 'charge']}},
             'required': ['mode']},
    'nested': {'type': OBJECT, 'properties': {'robot': {'type': OBJECT, 'properties': {
        'id': {'type': 'string', 'pattern': '^r[0-9]{2}$'},
        'base': {'type': OBJECT, 'properties': {'battery': {'type': 'integer', 'minimum': 0, 'maximum': 100}},
                 'required': ['battery']}}, 'required': ['id', 'base']}}, 'required': ['robot']},
    'int_array': {'type': 'array', 'items': {'type': 'integer'}, 'minItems': 2, 'maxItems': 4},
    'bounded_number': {'type': OBJECT, 'properties': {'speed': {'type': 'number', 'minimum': 0, 'maximum': 1.5}},
                       'required': ['speed']},
    'bounded_int': {'type': OBJECT, 'properties': {'floor': {'type': 'integer', 'minimum': -2, 'maximum': 12}},
                    'required': ['floor']},
    'exclusive': {'type': OBJECT, 'properties': {'timeout': {'type': 'number', 'exclusiveMinimum': 0,
                                                             'exclusiveMaximum': 60}}, 'required': ['timeout']},
    'optional': {'type': OBJECT, 'properties': {'goal': {'type': 'string'}, 'speed': {'type': 'number'},
                                                'retries': {'type': 'integer'}, 'note': {'type': 'string'}},
                 'required': ['goal']},
    'all_optional': {'type': OBJECT, 'properties': {'a': {'type': 'boolean'}, 'b': {'type': 'null'}}},
    'pattern': {'type': OBJECT, 'properties': {'room': {'type': 'string', 'pattern': '^[A-Z][a-z]+$'},
                                               'code': {'type': 'string', 'pattern': '^[A-F0-9]{4}-[0-9]+$'}},
                'required': ['room', 'code']},
    'string_length': {'type': OBJECT, 'properties': {'label': {'type': 'string', 'minLength': 2, 'maxLength': 6}},
                      'required': ['label']},
    'any_of': {'type': OBJECT, 'properties': {'value': {'anyOf': [{'type': 'integer'}, {'type': 'string',
                                                                                         'maxLength': 8}]}},
               'required': ['value']},
    'const': {'type': OBJECT, 'properties': {'version': {'const': 2}, 'kind': {'const': 'plan'}},
              'required': ['version', 'kind']},
    'enum_array': {'type': 'array', 'items': {'enum': ['left', 'right', 'up', 'down']}, 'minItems': 1,
                   'maxItems': 5},
    'matrix': {'type': 'array', 'items': {'type': 'array', 'items': {'type': 'number'}, 'minItems': 2,
                                          'maxItems': 2}, 'minItems': 2, 'maxItems': 2},
    'refs': {'$defs': {'point': POINT}, 'type': OBJECT, 'properties': {'start': {'$ref': '#/$defs/point'},
                                                                       'goal': {'$ref': '#/$defs/point'}},
             'required': ['start', 'goal']},
    'nullable': {'type': OBJECT, 'properties': {'target': {'type': ['string', 'null']},
                                                'distance': {'type': ['number', 'null']}},
                 'required': ['target', 'distance']},
    'pose': {'type': OBJECT, 'properties': {'frame': {'enum': ['map', 'odom', 'base_link']}, 'position': POINT,
                                            'yaw': {'type': 'number', 'minimum': -3.15, 'maximum': 3.15}},
             'required': ['frame', 'position', 'yaw']},
    'skill_call': {'type': OBJECT, 'properties': {
        'skill': {'const': 'move_arm'},
        'args': {'type': OBJECT, 'properties': {'joints': {'type': 'array', 'items': {
            'type': 'number', 'minimum': -3.2, 'maximum': 3.2}, 'minItems': 6, 'maxItems': 6}},
            'required': ['joints']}}, 'required': ['skill', 'args']},
    'int_enum': {'type': OBJECT, 'properties': {'gear': {'enum': [1, 2, 3, -1]}}, 'required': ['gear']},
    'one_of_skills': {'oneOf': [
        {'type': OBJECT, 'properties': {'skill': {'const': 'say'}, 'text': {'type': 'string'}},
         'required': ['skill', 'text']},
        {'type': OBJECT, 'properties': {'skill': {'const': 'wait'}, 'seconds': {'type': 'integer', 'minimum': 1}},
         'required': ['skill', 'seconds']}]},
    'additional_typed': {'type': OBJECT, 'additionalProperties': {'type': 'integer'}, 'maxProperties': 3},
    'multiple_of': {'type': OBJECT, 'properties': {'angle': {'type': 'integer', 'multipleOf': 15, 'minimum': 0,
                                                             'maximum': 345}},
                    'required': ['angle']},
    # uniqueItems kept by the local engine's tracker beside the grammar (test_schema_unique.py)
    'unique_names': {'type': 'array', 'items': {'type': 'string', 'maxLength': 3}, 'minItems': 2, 'maxItems': 4,
                     'uniqueItems': True},
    'unique_tags': {'type': 'array', 'uniqueItems': True, 'minItems': 2, 'maxItems': 3, 'items': {
        'type': OBJECT, 'properties': {'key': {'enum': ['a', 'b']}, 'value': {'type': 'string', 'maxLength': 2}},
        'required': ['key', 'value'], 'additionalProperties': False}},
}


@pytest.fixture(scope='module')
def tokenizer():
    return AutoTokenizer.from_pretrained(str(TOKENIZER))


@pytest.fixture(scope='module')
def compiler(tokenizer):
    return ConstraintCompiler(tokenizer, PADDED_VOCAB, EOS_IDS)


@pytest.fixture(scope='module')
def closing(tokenizer):
    """Tokens [vocab] bool whose text ends a value (a comma ends a number), object or array, and the EOS ids."""
    marks = torch.zeros(PADDED_VOCAB, dtype=torch.bool)
    for token, index in tokenizer.get_vocab().items():
        text = tokenizer.convert_tokens_to_string([token])
        marks[index] = any(mark in text for mark in '"}],')
    marks[list(EOS_IDS)] = True
    return marks


class ToyModel:
    """Logits [vocab] that depend only on the context (a seeded draw per context), drawn to close as it grows."""

    def __init__(self, closing: torch.Tensor, seed: int, base: 'ToyModel | None' = None, noise: float = 1.0):
        self._closing = closing
        self._seed = seed
        self._base = base      # a draft model: the target's logits plus noise, so that drafts are often accepted
        self._noise = noise

    def __call__(self, context: list[int], generated: int) -> torch.Tensor:
        draw = torch.randn(len(self._closing), generator=torch.Generator().manual_seed(hash((self._seed, *context))))
        if self._base is not None:
            return self._base(context, generated) + self._noise * draw
        return 3.0 * draw + CLOSING_PULL * generated * self._closing


def draft_none(constraint, draft_model, tokens, k, greedy, generator):
    return [], None


def draft_masked_model(constraint, draft_model, tokens, k, greedy, generator):
    """Draft as a model drafter does: mask its own logits under the grammar at every step, then roll back."""
    drafted, rows = [], []
    with constraint.lookahead() as look:
        for _ in range(k):
            logits = mask_logits(draft_model(tokens + drafted, len(tokens) + len(drafted))[None], look.mask())
            if greedy:
                drafted.append(int(logits.argmax()))
            else:
                rows.append(logits_to_probs(logits, SAMPLING))                      # [1, vocab]
                drafted.append(torch.multinomial(rows[-1], 1, generator=generator).item())
            if not look.push(drafted[-1]):
                break
    return drafted, torch.cat(rows)[None] if rows else None


def draft_unconstrained_model(constraint, draft_model, tokens, k, greedy, generator):
    """Draft ignoring the grammar: forbidden drafts must cost their rejection, never a wrong token."""
    drafted, rows = [], []
    for _ in range(k):
        logits = draft_model(tokens + drafted, len(tokens) + len(drafted))[None]
        if greedy:
            drafted.append(int(logits.argmax()))
        else:
            rows.append(logits_to_probs(logits, SAMPLING))
            drafted.append(torch.multinomial(rows[-1], 1, generator=generator).item())
    return drafted, torch.cat(rows)[None] if rows else None


def draft_lookup(constraint, draft_model, tokens, k, greedy, generator):
    """Propose what followed the last token's previous occurrence (as n-gram), cut where the grammar refuses."""
    last = tokens[-1]
    for start in range(len(tokens) - 2, -1, -1):
        if tokens[start] == last:
            proposal = tokens[start + 1:start + 1 + k]
            return proposal[:constraint.allowed_prefix_len(proposal)], None
    return [], None


DRAFTERS = {'masked': draft_masked_model, 'unconstrained': draft_unconstrained_model, 'lookup': draft_lookup}


def generate(constraint, target, draft_model, drafter, k, greedy, seed=0) -> list[int]:
    """Constrained speculative decoding as the engine does it; returns the emitted tokens (EOS included)."""
    generator = torch.Generator().manual_seed(seed)
    prompt = [2]  # <bos>
    tokens: list[int] = []
    while not constraint.terminated and len(tokens) < MAX_NEW:
        context = prompt + tokens
        draft, draft_probs = drafter(constraint, draft_model, context, k, greedy, generator) if tokens else (
            [], None)  # the first token comes from the prefill logits alone
        masks, _ = constraint.masks_along(draft)                                    # [k + 1, vocab]
        logits = torch.stack([target(context + draft[:i], len(tokens) + i) for i in range(len(draft) + 1)])
        masked = mask_logits(logits, masks)
        target_probs = masked if greedy else logits_to_probs(masked, SAMPLING)
        num_accepted, next_token = verify(torch.tensor([draft], dtype=torch.long), target_probs[None], draft_probs,
                                          greedy, generator)
        new = draft[:num_accepted.item()] + [next_token.item()]
        stops = [index for index, token in enumerate(new) if token in EOS_IDS]
        new = new[:stops[0] + 1] if stops else new
        constraint.accept(new)
        tokens += new
    return tokens


@pytest.fixture(scope='module')
def models(closing):
    target = ToyModel(closing, seed=0)
    return target, ToyModel(closing, seed=1, base=target)


def decode(tokenizer, tokens):
    return tokenizer.decode([t for t in tokens if t not in EOS_IDS], skip_special_tokens=True,
                            clean_up_tokenization_spaces=False)


@pytest.mark.parametrize('greedy', [True, False], ids=['greedy', 'sampled'])
@pytest.mark.parametrize('name', sorted(SCHEMAS))
def test_every_output_parses_and_validates(compiler, tokenizer, models, name, greedy):
    schema = SCHEMAS[name]
    for seed, (drafter, k) in enumerate([('masked', 3), ('unconstrained', 4), ('lookup', 2)]):
        constraint = compiler.constraint(json_schema=json.dumps(schema))
        tokens = generate(constraint, *models, DRAFTERS[drafter], k, greedy, seed)
        assert constraint.completed and tokens[-1] in EOS_IDS, (drafter, decode(tokenizer, tokens))
        jsonschema.validate(json.loads(decode(tokenizer, tokens)), schema)


@pytest.mark.parametrize('name', ['plan', 'pose', 'matrix', 'refs'])
def test_outputs_with_free_whitespace_validate(compiler, tokenizer, models, name):
    schema = SCHEMAS[name]
    constraint = compiler.constraint(json_schema=json.dumps(schema), json_free_whitespace=True)
    tokens = generate(constraint, *models, DRAFTERS['masked'], 3, greedy=False)
    assert constraint.completed and tokens[-1] in EOS_IDS, decode(tokenizer, tokens)
    jsonschema.validate(json.loads(decode(tokenizer, tokens)), schema)


@pytest.mark.parametrize('name', ['plan', 'nested', 'pose', 'optional', 'matrix', 'unique_names', 'unique_tags'])
def test_constrained_greedy_speculation_equals_constrained_plain_decoding(compiler, models, name):
    text = json.dumps(SCHEMAS[name])
    plain = generate(compiler.constraint(json_schema=text), *models, draft_none, 0, greedy=True)
    for drafter in DRAFTERS:
        for k in (1, 3, 6):
            speculative = generate(compiler.constraint(json_schema=text), *models, DRAFTERS[drafter], k, greedy=True)
            assert speculative == plain, (drafter, k)


SKILL_GRAMMAR = r"""
root ::= call (";" ws call){0,2}
call ::= "move_to(" name ")" | "pick(" name ")" | "place(" name "," ws number ")" | "wait(" number ")"
name ::= [a-z] [a-z_]{0,11}
number ::= "0" | [1-9] [0-9]{0,3}
ws ::= " "?
"""
NAME, NUMBER = r'[a-z][a-z_]{0,11}', r'(0|[1-9][0-9]{0,3})'
CALL = rf'(move_to\({NAME}\)|pick\({NAME}\)|place\({NAME}, ?{NUMBER}\)|wait\({NUMBER}\))'
SKILL_PATTERN = re.compile(rf'{CALL}(; ?{CALL}){{0,2}}')


@pytest.mark.parametrize('greedy', [True, False], ids=['greedy', 'sampled'])
def test_ebnf_grammar_output_matches(compiler, tokenizer, models, greedy):
    for seed, drafter in enumerate(DRAFTERS):
        constraint = compiler.constraint(grammar=SKILL_GRAMMAR)
        tokens = generate(constraint, *models, DRAFTERS[drafter], 3, greedy, seed)
        assert constraint.completed and tokens[-1] in EOS_IDS
        assert SKILL_PATTERN.fullmatch(decode(tokenizer, tokens)), decode(tokenizer, tokens)


@pytest.mark.parametrize('text, message', [
    ('{"type": "object",', r'^json_schema: not valid JSON: Expecting'),
    ('null', r'^json_schema: a JSON Schema must be a JSON object, got null'),
    ('1', r'^json_schema: a JSON Schema must be a JSON object, got 1'),
    ('["type", "object"]', r'^json_schema: a JSON Schema must be a JSON object, got \["type"'),
    ('{"type": "object", "properties": {"x": {"type": "vector"}}}', r'^json_schema: .* at \$\.properties\.x\.type$'),
    ('{"type": "integer", "minimum": 5, "maximum": 2}', r'^json_schema: Invalid range: minimum greater than maximum$'),
    ('{"type": "string", "pattern": "[a-z"}', r"^json_schema: '\[a-z' is not a 'regex' at \$\.pattern$"),
    ('{"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": true}}}',
     r"^json_schema: 'uniqueItems' at \$\.properties\.tags is not enforced by the grammar engine; remove it, "
     r"or set json_schema_unenforced to 'check'"),
    ('{"anyOf": [{"type": "integer"}, {"not": {"type": "string", "pattern": "^a"}}]}',
     r"^json_schema: 'not' at \$\.anyOf\[1\] "),
    ('{"type": "object", "properties": {"id": {"type": "string", "pattern": "^(ab|c)+$", "minLength": 2}}}',
     r"^json_schema: 'minLength' at \$\.properties\.id \(beside a pattern it cannot be folded into\) is not "
     r"enforced by the grammar engine"),
])
def test_bad_json_schema_error_names_the_field_and_quotes_the_library(compiler, text, message):
    with pytest.raises(ValueError, match=message):
        compiler.constraint(json_schema=text)


@pytest.mark.parametrize('text, message', [
    ('root ::= "a" | b', r'^grammar: EBNF parser error at line 1, column 16: Rule "b" is not defined$'),
    ('start ::= "a"', r'^grammar: EBNF parser error at line 1, column 1: The root rule with name "root" is not found'),
])
def test_bad_grammar_error_names_the_field_and_quotes_the_library(compiler, text, message):
    with pytest.raises(ValueError, match=message):
        compiler.constraint(grammar=text)


def test_at_most_one_constraint_and_none_when_empty(compiler):
    assert compiler.constraint() is None
    with pytest.raises(ValueError, match='at most one of json_schema and grammar'):
        compiler.constraint(json_schema='{"type": "integer"}', grammar='root ::= "a"')


def test_compiled_grammars_are_cached_by_kind_and_text(tokenizer):
    compiler = ConstraintCompiler(tokenizer, PADDED_VOCAB, EOS_IDS, cache_size=2)
    first = compiler.compile('json_schema', '{"type": "integer"}')
    assert compiler.compile('json_schema', '{"type": "integer"}') is first
    assert compiler.compile('grammar', 'root ::= "1"') is not first
    compiler.compile('grammar', 'root ::= "2"')  # the least recently used entry (the schema) is dropped
    assert compiler.compile('json_schema', '{"type": "integer"}') is not first


def test_free_whitespace_is_a_separate_cache_entry(tokenizer):
    compiler = ConstraintCompiler(tokenizer, PADDED_VOCAB, EOS_IDS)
    compact = compiler.compile('json_schema', '{"type": "integer"}')
    free = compiler.compile('json_schema', '{"type": "integer"}', json_free_whitespace=True)
    assert free is not compact
    assert compiler.compile('json_schema', '{"type": "integer"}', json_free_whitespace=True) is free
    assert compiler.compile('json_schema', '{"type": "integer"}') is compact
    with pytest.raises(ValueError, match='^json_free_whitespace applies to json_schema only$'):
        compiler.compile('grammar', 'root ::= "1"', json_free_whitespace=True)


WHITESPACE_SCHEMA = json.dumps({'type': OBJECT, 'properties': {'a': {'type': 'integer'}, 'any': {}},
                                'required': ['a', 'any']})


def _whitespace_tokens(tokenizer) -> list[int]:
    return [index for token, index in tokenizer.get_vocab().items()
            if not tokenizer.convert_tokens_to_string([token]).strip(' \t\r\n')]


@pytest.mark.parametrize('prefix', ['{', '{"a"', '{"a":', '{"a":1', '{"a":1,', '{"a":1,"any":[1,',
                                    '{"a":1,"any":{"k":1,'])
def test_json_output_is_compact_by_default(compiler, tokenizer, prefix):
    whitespace = _whitespace_tokens(tokenizer)
    assert len(whitespace) > 10
    compact = compiler.constraint(json_schema=WHITESPACE_SCHEMA)
    free = compiler.constraint(json_schema=WHITESPACE_SCHEMA, json_free_whitespace=True)
    for constraint in (compact, free):
        constraint.accept(tokenizer(prefix, add_special_tokens=False).input_ids)
    assert not compact.next_mask()[0, whitespace].any()
    assert free.next_mask()[0, tokenizer(' ', add_special_tokens=False).input_ids].all()


def test_free_whitespace_is_bounded(compiler, tokenizer):
    constraint = compiler.constraint(json_schema=WHITESPACE_SCHEMA, json_free_whitespace=True)
    space = tokenizer(' ', add_special_tokens=False).input_ids
    constraint.accept(tokenizer('{', add_special_tokens=False).input_ids + space * 16)
    assert not constraint.next_mask()[0, space].any()


@pytest.mark.parametrize('fields, message', [
    (dict(grammar='root ::= "a"', json_free_whitespace=True), r'^json_free_whitespace applies to json_schema only'),
    (dict(json_free_whitespace=True), r'^json_free_whitespace applies to json_schema only'),
    (dict(json_schema='{"type": "integer"}', json_free_whitespace=1),
     r'^json_free_whitespace must be a bool, got int$'),
])
def test_bad_json_free_whitespace_names_the_field(compiler, fields, message):
    with pytest.raises(ValueError, match=message):
        compiler.constraint(**fields)


def test_padding_rows_and_special_tokens_are_never_allowed(compiler, tokenizer):
    constraint = compiler.constraint(json_schema='{"type": "string"}')
    constraint.accept(tokenizer('"', add_special_tokens=False).input_ids)
    inside = constraint.next_mask()
    assert inside.shape == (1, PADDED_VOCAB)
    assert inside[0, :4096].sum() > 3000 and not inside[0, 4096:].any()   # almost any text, no padding rows
    assert not inside[0, tokenizer.all_special_ids].any()                  # no <bos>, <pad>, EOS inside a string
    constraint.accept(tokenizer('"', add_special_tokens=False).input_ids)
    assert constraint.next_mask()[0].nonzero().flatten().tolist() == sorted(EOS_IDS)


@pytest.mark.parametrize('schema', [{'type': 'string'}, {'type': 'string', 'maxLength': 8},
                                    {'type': 'string', 'minLength': 2}, {'type': 'string', 'pattern': '^.+$'}])
def test_strings_never_allow_raw_control_characters(compiler, tokenizer, schema):
    # JSON forbids U+0000-U+001F inside strings; xgrammar 0.2.8 lets them into minLength / maxLength strings
    controls = [index for token, index in tokenizer.get_vocab().items()
                if any(ord(char) < 32 for char in tokenizer.convert_tokens_to_string([token]))]
    assert len(controls) > 20
    constraint = compiler.constraint(json_schema=json.dumps(schema))
    constraint.accept(tokenizer('"ab', add_special_tokens=False).input_ids)
    inside = constraint.next_mask()[0]
    assert inside.sum() > 1000 and not inside[controls].any()


def test_model_vocab_smaller_than_the_tokenizer(tokenizer):
    compiler = ConstraintCompiler(tokenizer, 4000, EOS_IDS)
    masks, allowed = compiler.constraint(json_schema='{"type": "string"}').masks_along([7])
    assert masks.shape == (2, 4000) and allowed == 1


def test_rollback_leaves_the_same_masks_as_a_fresh_matcher(compiler, models):
    schema = json.dumps(SCHEMAS['plan'])
    tokens = generate(compiler.constraint(json_schema=schema), *models, draft_none, 0, greedy=False, seed=5)
    generator = torch.Generator().manual_seed(0)
    for prefix_len in range(0, len(tokens) - 1, 7):
        prefix = tokens[:prefix_len]
        constraint = compiler.constraint(json_schema=schema)
        constraint.accept(prefix)
        # drafts: the true continuation with a random token spliced in, so that some are refused part-way
        draft = tokens[prefix_len:prefix_len + 5]
        draft[int(torch.randint(0, len(draft), (1,), generator=generator))] = int(
            torch.randint(0, 4096, (1,), generator=generator))
        masks, allowed = constraint.masks_along(draft)
        with constraint.lookahead() as look:
            for token in draft[:allowed]:
                look.push(token)
        constraint.allowed_prefix_len(draft)
        for row in range(allowed + 1):
            fresh = compiler.constraint(json_schema=schema)
            fresh.accept(prefix + draft[:row])
            if not fresh.terminated:
                assert torch.equal(masks[row], fresh.next_mask()[0]), (prefix_len, row)
        fresh = compiler.constraint(json_schema=schema)
        fresh.accept(prefix)
        assert torch.equal(constraint.next_mask(), fresh.next_mask()), prefix_len


@pytest.mark.skipif(not torch.cuda.is_available(), reason='needs CUDA')
def test_masks_on_cuda_equal_masks_on_cpu(compiler, tokenizer):
    constraint = compiler.constraint(json_schema=json.dumps(SCHEMAS['plan']))
    draft = tokenizer('{"steps": [{"action": "pick"', add_special_tokens=False).input_ids
    cpu_masks, allowed = constraint.masks_along(draft)
    cuda_masks, cuda_allowed = constraint.masks_along(draft, device='cuda')
    assert cuda_masks.is_cuda and allowed == cuda_allowed == len(draft)
    assert torch.equal(cuda_masks.cpu(), cpu_masks)
    logits = torch.randn(cpu_masks.shape, generator=torch.Generator().manual_seed(0))
    assert torch.equal(mask_logits(logits.cuda(), cuda_masks).cpu(), mask_logits(logits, cpu_masks))
