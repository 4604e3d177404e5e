"""
Random goals through what the node does with a goal before decoding: each one is planned, or refused naming its field.

Property-based (hypothesis), with the strategies of gemma_spec_ros/benchmarks/faults/fuzz.py (whose main runs
10,000 goals through the engine's half): every field of the Generate goal, mostly usable and now and then extreme.
A goal goes through a ROS serialization round trip (what reaches the node), ros/conversions.goal_to_request and
Engine.validate on the tiny random models (eager), as GoalServer._plan does, and with images in every goal on the
bundled vision target (its tower reads them); a ValueError is the node's refusal and must name the goal's field at
fault (or the engine parameter it breaks), anything else is an internal error. One in fuzz.GENERATE valid plans
also generates up to 4 tokens. The @example goals are defects the fuzz found, kept.
"""

from pathlib import Path

import pytest
from conftest import ON_TEST_DEVICE, TEST_COMPILE
from gemma_spec_msgs.action import Generate
from gemma_spec_msgs.msg import ChatMessage, ToolCall
from hypothesis import example, given, settings
from hypothesis import strategies as st
from rclpy.serialization import deserialize_message, serialize_message
from sensor_msgs.msg import CompressedImage, Image

from gemma_spec_ros.benchmarks.faults import fuzz
from gemma_spec_ros.engine import Engine, EngineConfig
from gemma_spec_ros.ros.conversions import ImageLimits, goal_to_request

BUNDLED_VISION = Path(__file__).resolve().parents[2] / 'models' / 'gemma4-spec-vision'

USABLE = {'prompt': 'The robot picked up the red cube and', 'messages': [], 'images': [], 'compressed_images': [],
          'max_new_tokens': 4, 'temperature': 0.0, 'top_p': 0.0, 'top_k': 0, 'stop': [], 'seed': -1, 'drafter': '',
          'num_draft_tokens': 0, 'client_id': '', 'json_schema': '', 'grammar': '', 'json_free_whitespace': False,
          'json_schema_unenforced': '', 'tools': '', 'tool_choice': '', 'parallel_tool_calls': True,
          'thinking': False, 'max_thinking_tokens': 0}


def goal(**fields) -> dict:
    """Return a usable goal's fields with some changed (the @example goals)."""
    return {**USABLE, **fields}


def user(content: str, **fields) -> dict:
    return {'role': 'user', 'content': content, 'image_indices': [], 'tool_calls': [], 'name': '', **fields}


def called(arguments: str, result: str = '') -> list[dict]:
    """Return a user turn, an assistant turn that called pick with arguments, and (given) the tool's result."""
    call = {'id': 'call_0', 'name': 'pick', 'arguments': arguments}
    turns = [user('Pick up the cup.'), user('', role='assistant', tool_calls=[call])]
    return turns + ([user(result, role='tool')] if result else [])


DEEP = 3000   # levels of JSON nesting past Python's recursion limit
DIGITS = '9' * 5000   # an integer of more digits than int() reads


def goal_message(fields: dict) -> Generate.Goal:
    """Return the Generate goal of fuzz.goals()'s fields."""
    scalars = {name: value for name, value in fields.items()
               if name in fuzz.GOAL_FIELDS and name not in ('messages', 'images', 'compressed_images')}
    return Generate.Goal(
        messages=[ChatMessage(role=message['role'], content=message['content'],
                              image_indices=message['image_indices'], name=message['name'],
                              tool_calls=[ToolCall(**call) for call in message['tool_calls']])
                  for message in fields['messages']],
        images=[Image(**image) for image in fields['images']],
        compressed_images=[CompressedImage(**image) for image in fields['compressed_images']], **scalars)


def plan_goal(engine, fields: dict):
    """GoalServer._plan: the goal as it reaches the node, converted to the engine's request, validated."""
    received = deserialize_message(serialize_message(goal_message(fields)), Generate.Goal)
    limits = ImageLimits(engine.config.max_images_per_goal, engine.config.max_image_pixels)
    return engine.validate(goal_to_request(received, limits))


def test_the_fuzz_draws_every_field_of_a_goal():
    assert set(fuzz.GOAL_FIELDS) == set(Generate.Goal.get_fields_and_field_types())
    assert set(fuzz.MESSAGE_FIELDS) == set(ChatMessage.get_fields_and_field_types())
    assert set(fuzz.TOOL_CALL_FIELDS) == set(ToolCall.get_fields_and_field_types())
    assert set(fuzz.IMAGE_FIELDS) == set(Image.get_fields_and_field_types()) - {'header'}
    assert set(fuzz.COMPRESSED_FIELDS) == set(CompressedImage.get_fields_and_field_types()) - {'header'}
    assert set(USABLE) == set(fuzz.GOAL_FIELDS)


@pytest.mark.parametrize(('message', 'field'), [
    ('temperature must be a finite number in [0, 2] (0 = greedy), got nan', 'temperature'),
    ('messages[2].tool_calls[0].arguments: not a JSON object', 'messages[].tool_calls[].arguments'),
    ('prompt (9 tokens) + max_new_tokens (2000) exceeds the context limit of 1024 tokens (engine.context_limit, at '
     'most the model context)', 'engine.context_limit'),
    ('request has 17 stop strings, more than generation.max_stop_strings = 16', 'generation.max_stop_strings'),
    ("image(s) [1] are shown by no message: list them in a message's image_indices", 'image_indices'),
    ('compressed_images[0].data: not a readable png image (no known image format)', 'compressed_images[].data'),
    ('stop strings must not be empty', 'stop'),
    ('something broke', None),
    ('the input has no name', None),
])
def test_a_refusal_names_its_field(message, field):
    assert fuzz.named_field(message) == field


def check_goal(engine, fields: dict, pick: int) -> fuzz.Outcome:
    """Check the property: planned (with pick 0 also generated), or refused naming a field; else it raises."""
    outcome = fuzz.plan_or_refusal(lambda: plan_goal(engine, fields))
    if outcome.plan is None:
        assert outcome.field is not None, 'a refusal that names no field: {!r}'.format(outcome.message)
    elif pick == 0:
        fuzz.generate_briefly(engine, outcome.plan)
    return outcome


@settings(max_examples=200, deadline=None, derandomize=True)
@given(fields=fuzz.goals(), pick=st.integers(0, fuzz.GENERATE - 1))
@example(fields=goal(), pick=0)
# defects the fuzz found (the refusal each gets now in the comment):
# OverflowError in the schema rewrite (1e400 reads as inf): 'json_schema: inf is not a JSON number'
@example(fields=goal(json_schema='{"type": "integer", "minimum": 1e400}'), pick=0)
# RecursionError in jsonschema / json: 'json_schema: nested deeper than 64 levels'
@example(fields=goal(json_schema='{"items": ' * 200 + '{}' + '}' * 200), pick=0)
@example(fields=goal(json_schema='[' * DEEP + ']' * DEEP), pick=0)
@example(fields=goal(messages=[user('hi')], tools='[' * DEEP + ']' * DEEP), pick=0)
@example(fields=goal(messages=called('{"object": ' + '[' * DEEP + ']' * DEEP + '}')), pick=0)
@example(fields=goal(messages=called('{}', '{"ok": ' + '[' * DEEP + ']' * DEEP + '}')), pick=0)   # shown as text
# TypeError in the tokenizer, on a JSON-escaped unpaired surrogate: 'tools: a string holds an unpaired surrogate'
@example(fields=goal(messages=[user('hi')], tools='[{"name": "pick", "description": "\\ud800"}]'), pick=0)
@example(fields=goal(messages=called('{"object": "\\udc00"}')), pick=0)
@example(fields=goal(messages=called('{}', '{"ok": "\\ud800"}')), pick=0)   # shown as text
# refusals that named no field: 'a tool-call value must be a finite number, got inf', and int()'s
# 'Exceeds the limit (4300 digits) for integer string conversion'
@example(fields=goal(messages=[user('hi')], tools='[{"name": "pick", "parameters": {"type": "object", '
                                                   '"properties": {"a": {"enum": [Infinity]}}}}]'), pick=0)
@example(fields=goal(json_schema='{"enum": [' + DIGITS + ']}'), pick=0)
@example(fields=goal(messages=[user('hi')], tools='[{"name": "pick", "parameters": {"type": "object", '
                                                   '"properties": {"a": {"enum": [' + DIGITS + ']}}}}]'), pick=0)
@example(fields=goal(messages=called('{"count": ' + DIGITS + '}')), pick=0)
@example(fields=goal(messages=called('{}', '{"count": ' + DIGITS + '}')), pick=0)   # shown as text
# a grammar no text matches planned, then its first token had no choice: AssertionError (greedy), RuntimeError
# (sampled) in generate; now 'grammar: no text matches it'
@example(fields=goal(grammar='root ::= root'), pick=0)
@example(fields=goal(grammar='root ::= root', temperature=1.0, top_p=0.9, top_k=40, seed=477), pick=0)
@example(fields=goal(grammar='root ::= [^\\x00-\\U0010ffff]', temperature=1.0), pick=0)
def test_a_random_goal_is_planned_or_refused_naming_its_field(tiny_engine, fields, pick):
    check_goal(tiny_engine, fields, pick)


@pytest.fixture(scope='module')
def vision_engine():
    """Load the bundled vision target (a vision tower: images reach the engine's rules and the tower)."""
    return Engine.from_config(EngineConfig(target_path=str(BUNDLED_VISION), drafter='ngram', compile=TEST_COMPILE,
                                           **ON_TEST_DEVICE))


@settings(max_examples=60, deadline=None, derandomize=True)
@given(fields=fuzz.goals(images_one_in=1), pick=st.integers(0, fuzz.GENERATE - 1))
def test_a_random_image_goal_on_a_vision_target_is_planned_or_refused_naming_its_field(vision_engine, fields, pick):
    check_goal(vision_engine, fields, pick)


# a grammar whose first token had a choice and then dead-ended (no token allowed, not even the end): planned, then
# GrammarConstraint.accept asserted (greedy) or torch.multinomial raised (sampled); now refused at planning
@pytest.mark.parametrize('temperature', [0.0, 1.0])
def test_a_grammar_that_dead_ends_after_its_first_token_is_refused(tiny_engine, temperature):
    outcome = check_goal(tiny_engine, goal(grammar='root ::= "a" b\nb ::= b', temperature=temperature, seed=1), 0)
    assert outcome.plan is None and outcome.field == 'grammar', outcome
    assert "'root', 'b' derive no finite text" in outcome.message, outcome.message


def test_the_fuzz_tallies_a_run(tiny_engine):
    # fuzz.run, as the bench's main drives it: every case counted once, no internal error
    tally = fuzz.run(lambda fields: plan_goal(tiny_engine, fields), tiny_engine, 12, 3)
    assert tally.cases == 12 == tally.plans + sum(tally.refusals.values()) + len(tally.unnamed) + len(tally.errors)
    assert not tally.errors and not tally.unnamed, (tally.errors, tally.unnamed)
    table = tally.table()
    assert '| cases' in table and 'internal errors (must be 0)' in table
    assert fuzz.engine_request(goal()).prompt == USABLE['prompt']   # the bench's engine half of a goal
