"""Structured output through the engine on tiny random Gemma 4 models: validity, greedy parity, stops, cancel."""

import json
import re

import jsonschema
import pytest
from conftest import ON_TEST_DEVICE

from gemma_spec_ros.engine import CancelToken, Engine, EngineConfig, GenerationRequest
from gemma_spec_ros.engine.logits.grammar import GrammarConstraint
from gemma_spec_ros.engine.logits.schema import output_check
from gemma_spec_ros.engine.types import WarningKind

PROMPT = 'Plan for the robot: '
MAX_NEW = 400  # random weights write long numbers and strings but close in time
DRAFTERS = ('none', 'ngram', 'lookahead', 'draft', 'mtp')
OBJECT = 'object'
NAME = {'type': 'string', 'pattern': '^[a-z][a-z_ ]{0,11}$'}  # ASCII: random byte tokens cannot break UTF-8
STEP = {'type': OBJECT, 'properties': {'action': {'enum': ['navigate', 'pick', 'place']}, 'target': NAME},
        'required': ['action', 'target']}
SCHEMAS = {
    'plan': {'type': OBJECT, 'properties': {'steps': {'type': 'array', 'items': STEP, 'minItems': 1, 'maxItems': 3}},
             'required': ['steps']},
    'pose': {'type': OBJECT, 'properties': {'frame': {'enum': ['map', 'odom']},
                                            'x': {'type': 'number', 'minimum': -10, 'maximum': 10},
                                            'yaw': {'type': 'integer', 'minimum': -180, 'maximum': 180}},
             'required': ['frame', 'x', 'yaw']},
    'flags': {'type': OBJECT, 'properties': {'room': {'type': 'string', 'pattern': '^[A-Z][a-z]{1,8}$'},
                                             'open': {'type': 'boolean'}, 'note': {'type': 'null'}},
              'required': ['room', 'open']},
    'enum_array': {'type': 'array', 'items': {'enum': ['left', 'right', 'up']}, 'minItems': 1, 'maxItems': 4},
}
SKILLS = r"""
root ::= call (";" " "? call){0,2}
call ::= "move_to(" name ")" | "pick(" name ")" | "wait(" [1-9] [0-9]{0,2} ")"
name ::= [a-z] [a-z_]{0,9}
"""
CALL = r'(move_to\([a-z][a-z_]{0,9}\)|pick\([a-z][a-z_]{0,9}\)|wait\([1-9][0-9]{0,2}\))'
SKILL_PATTERN = re.compile(rf'{CALL}(; ?{CALL}){{0,2}}')


@pytest.fixture(scope='module')
def agreeing_engine(tiny_models):
    """Draft model = the target itself: greedy drafts are accepted, so the accept paths run under the grammar."""
    return Engine.from_config(EngineConfig(target_path=tiny_models.target, drafter='draft',
                                           draft_model_path=tiny_models.target, **ON_TEST_DEVICE))


def constrained(schema=None, grammar='', **fields) -> GenerationRequest:
    fields = {'prompt': PROMPT, 'max_new_tokens': MAX_NEW, **fields}
    return GenerationRequest(json_schema=json.dumps(schema) if schema is not None else '', grammar=grammar, **fields)


def assert_complete(result):
    assert result.finish_reason == 'stop' and result.structure_complete, (result.finish_reason, result.text)
    assert not result.warnings


@pytest.mark.parametrize('drafter', DRAFTERS)
def test_outputs_validate_greedy_and_sampled(tiny_engine, drafter):
    for name, schema in SCHEMAS.items():
        for seed, temperature in enumerate((0.0, 1.0)):
            result = tiny_engine.generate(constrained(schema, drafter=drafter, num_draft_tokens=3,
                                                      temperature=temperature, seed=seed))
            assert_complete(result)
            assert result.token_ids[-1] in tiny_engine.eos_token_ids  # EOS only once the grammar accepts
            jsonschema.validate(json.loads(result.text), schema)
            assert result.stats.drafter == drafter, (name, temperature)


def test_json_is_compact_unless_free_whitespace_is_asked(tiny_engine):
    schema = SCHEMAS['pose']  # no free-text strings: any whitespace would lie between elements
    compact = tiny_engine.generate(constrained(schema, drafter='mtp', temperature=1.0, seed=3))
    free = tiny_engine.generate(constrained(schema, drafter='mtp', temperature=1.0, seed=3, json_free_whitespace=True))
    for result in (compact, free):
        assert_complete(result)
        jsonschema.validate(json.loads(result.text), schema)
    assert not re.search(r'\s', compact.text), compact.text
    assert re.search(r'\s', free.text), free.text  # random weights take the whitespace they are offered


@pytest.mark.parametrize('drafter', DRAFTERS)
def test_ebnf_grammar_output_matches(tiny_engine, drafter):
    for seed, temperature in enumerate((0.0, 0.8)):
        result = tiny_engine.generate(constrained(grammar=SKILLS, drafter=drafter, num_draft_tokens=2,
                                                  temperature=temperature, seed=seed))
        assert_complete(result)
        assert SKILL_PATTERN.fullmatch(result.text), result.text


@pytest.mark.parametrize('drafter', ['ngram', 'lookahead', 'draft', 'mtp'])
def test_constrained_greedy_speculation_equals_constrained_plain(tiny_engine, drafter):
    for request in (constrained(SCHEMAS['plan']), constrained(grammar=SKILLS)):
        plain = tiny_engine.generate(GenerationRequest(**{**request.__dict__, 'drafter': 'none'}))
        assert_complete(plain)
        for k in (0, 1, 4):  # 0: adaptive K (the draft model also stops at unconfident tokens)
            speculative = tiny_engine.generate(GenerationRequest(**{**request.__dict__, 'drafter': drafter,
                                                                    'num_draft_tokens': k}))
            assert speculative.token_ids == plain.token_ids, (k, speculative.text, plain.text)
            assert speculative.text == plain.text and speculative.structure_complete


@pytest.mark.parametrize('drafter', ['ngram', 'lookahead', 'draft', 'mtp'])
def test_drafters_propose_only_what_the_grammar_allows(tiny_engine, monkeypatch, drafter):
    drafts = []
    masks_along = GrammarConstraint.masks_along

    def recording(self, draft_tokens, device=None):
        masks, allowed = masks_along(self, draft_tokens, device)
        drafts.append((len(draft_tokens), allowed))
        return masks, allowed

    monkeypatch.setattr(GrammarConstraint, 'masks_along', recording)
    for temperature in (0.0, 1.0):
        assert_complete(tiny_engine.generate(constrained(SCHEMAS['plan'], drafter=drafter, num_draft_tokens=3,
                                                         temperature=temperature, seed=2)))
    assert sum(length for length, _ in drafts) > 10
    assert all(allowed == length for length, allowed in drafts)  # cut (n-gram) or masked (models) while drafting


def test_agreeing_drafter_accepts_whole_constrained_drafts(tiny_engine, agreeing_engine):
    plain = tiny_engine.generate(constrained(SCHEMAS['plan'], drafter='none'))
    for k in (2, 6):
        result = agreeing_engine.generate(constrained(SCHEMAS['plan'], num_draft_tokens=k))
        assert result.token_ids == plain.token_ids and result.structure_complete
        assert result.stats.acceptance_rate == 1.0 and result.stats.tau > 2.0


def test_a_plan_runs_twice_from_the_start_of_its_grammar(tiny_engine):
    plan = tiny_engine.validate(constrained(SCHEMAS['pose'], drafter='mtp', num_draft_tokens=3))
    first, second = tiny_engine.generate(plan), tiny_engine.generate(plan)
    assert_complete(first)
    assert second.token_ids == first.token_ids and second.structure_complete


@pytest.mark.parametrize('drafter', ['none', 'mtp'])
def test_structure_is_complete_only_when_the_output_validates(tiny_engine, drafter):
    # a grammar that misses something: the plan's grammar is the pose schema's, its final check the plan schema's
    plan = tiny_engine.validate(constrained(SCHEMAS['pose'], drafter=drafter))
    assert plan.output_check is not None
    plan.output_check = output_check(json.dumps(SCHEMAS['plan']))
    result = tiny_engine.generate(plan)
    assert result.finish_reason == 'stop' and not result.structure_complete, result.text
    assert [w.kind for w in result.warnings] == [WarningKind.SCHEMA_VIOLATION]
    assert result.warnings[0].startswith("schema violation: the output completed the grammar but $ fails 'required' "
                                         'at $.required')
    assert not tiny_engine.validate(constrained(grammar=SKILLS)).output_check   # free grammars are not checked


@pytest.mark.parametrize('drafter', ['none', 'mtp'])
def test_an_unenforced_keyword_is_checked_with_a_warning(tiny_engine, drafter):
    schema = {'type': 'object', 'properties': {'rooms': {'type': 'array', 'items': NAME, 'minItems': 1,
                                                         'maxItems': 3, 'uniqueItems': True}}, 'required': ['rooms']}
    with pytest.raises(ValueError, match=r"^json_schema: 'uniqueItems' at \$\.properties\.rooms is not enforced"):
        tiny_engine.validate(constrained(schema))
    result = tiny_engine.generate(constrained(schema, drafter=drafter, json_schema_unenforced='check'))
    assert result.warnings[0].kind is WarningKind.UNENFORCED_KEYWORD
    assert "'uniqueItems' at $.properties.rooms is not enforced by the grammar engine; the output was validated " \
           'at the end' in result.warnings[0]
    rooms = json.loads(result.text)['rooms'] if result.finish_reason == 'stop' else None
    assert result.structure_complete == (rooms is not None and len(set(rooms)) == len(rooms)), result.text
    assert result.structure_complete or result.warnings[-1].kind in (WarningKind.SCHEMA_VIOLATION,
                                                                     WarningKind.STRUCTURE_INCOMPLETE)


def test_length_before_the_structure_completes_warns(tiny_engine):
    result = tiny_engine.generate(constrained(SCHEMAS['plan'], max_new_tokens=6, drafter='ngram'))
    assert result.finish_reason == 'length' and not result.structure_complete
    assert len(result.token_ids) == 6
    assert result.warnings == ['structure incomplete: max_new_tokens (6) ended the output before it completed '
                               'its json_schema / grammar / tool calls']


def test_stop_string_mid_structure(tiny_engine):
    full = tiny_engine.generate(constrained(SCHEMAS['plan'], drafter='draft', num_draft_tokens=3))
    assert '"action"' in full.text
    result = tiny_engine.generate(constrained(SCHEMAS['plan'], drafter='draft', num_draft_tokens=3,
                                              stop=['"action"']))
    assert result.finish_reason == 'stop' and not result.structure_complete and not result.warnings
    assert result.text == full.text[:full.text.index('"action"')]
    assert result.token_ids == full.token_ids[:len(result.token_ids)]


@pytest.mark.parametrize('drafter', ['none', 'mtp'])
def test_cancel_mid_structure(tiny_engine, drafter):
    cancel = CancelToken()
    deltas = []

    def on_delta(delta):
        deltas.append(delta)
        if len(deltas) == 3:
            cancel.cancel()

    result = tiny_engine.generate(constrained(SCHEMAS['plan'], drafter=drafter, num_draft_tokens=2),
                                  on_delta=on_delta, cancel=cancel)
    assert result.finish_reason == 'cancelled' and not result.structure_complete and not result.warnings
    assert result.token_ids == [t for d in deltas for t in d.token_ids]
    after = tiny_engine.generate(constrained(SCHEMAS['enum_array'], drafter=drafter))  # the engine is free again
    assert_complete(after)


def test_unconstrained_requests_report_no_structure(tiny_engine):
    result = tiny_engine.generate(GenerationRequest(prompt=PROMPT, max_new_tokens=8, drafter='ngram'))
    assert not result.structure_complete and not result.warnings


@pytest.mark.parametrize('fields, message', [
    (dict(json_schema='{"type": "object",'), r'^json_schema: not valid JSON: '),
    (dict(json_schema='{"type": "object", "properties": {"x": {"type": "vector"}}}'),
     r'^json_schema: .* at \$\.properties\.x\.type$'),
    (dict(json_schema='{"type": "string", "pattern": "^(ab)+$", "minLength": 3}'),
     r"^json_schema: 'minLength' at \$ \(beside a pattern it cannot be folded into\) is not enforced by the grammar "
     r"engine; remove it, or set json_schema_unenforced to 'check'"),
    (dict(json_schema='{"type": "integer"}', json_schema_unenforced='ignore'),
     r"^json_schema_unenforced must be one of refuse\|check \(\'\' = refuse\), got 'ignore'$"),
    (dict(grammar='root ::= "1"', json_schema_unenforced='check'), r'^json_schema_unenforced applies to json_schema'),
    (dict(grammar='root ::= "a" | b'), r'^grammar: EBNF parser error at line 1, column 16: Rule "b" is not defined$'),
    (dict(json_schema='{"type": "integer"}', grammar='root ::= "1"'), r'^set at most one of json_schema and grammar$'),
    (dict(json_schema={'type': 'integer'}), r'^json_schema must be a string \(the document as text\), got dict$'),
    (dict(grammar='root ::= "1"', json_free_whitespace=True), r'^json_free_whitespace applies to json_schema only'),
])
def test_bad_constraint_is_refused_before_any_model_work(tiny_engine, fields, message):
    request = GenerationRequest(prompt=PROMPT, max_new_tokens=8, **fields)
    with pytest.raises(ValueError, match=message):
        tiny_engine.validate(request)
    with pytest.raises(ValueError, match=message):
        tiny_engine.generate(request)
