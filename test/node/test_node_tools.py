"""
Tool calls and thinking through the node with a real rclpy client, on the tiny random models.

The tools are the bundled robot tools (config/robot_tools.json), each string bounded (maxLength) so that a random
model's strings end too; what is checked is the shape the grammar guarantees (a declared tool, arguments valid under
its schema), never the text.
"""

import json
import os

import jsonschema
import pytest
from conftest import NO_DIAGNOSTIC_UPDATER, REPO_ROOT

pytest.importorskip('diagnostic_updater', reason=NO_DIAGNOSTIC_UPDATER)

from gemma_spec_msgs.action import Generate
from gemma_spec_msgs.msg import ChatMessage
from gemma_spec_msgs.msg import ToolCall as ToolCallMsg
from test_node import serving, tiny_params
from transformers import AutoTokenizer

from gemma_spec_ros.engine.types import GenerationResult, GenerationStats, StreamDelta, ToolCall
from gemma_spec_ros.ros.conversions import ImageLimits, delta_to_feedback, goal_to_request, result_to_msg
from gemma_spec_ros.tools.client import make_goal

DOMAIN_ID = 11 + (os.getpid() + 37) % 80
ROBOT_TOOLS_FILE = REPO_ROOT / 'config' / 'robot_tools.json'
ROBOT_TOOLS = [  # the shape of config/robot_tools.json, for a tree without it
    {'type': 'function', 'function': {'name': name, 'description': 'Robot skill {}.'.format(name), 'parameters': {
        'type': 'object', 'properties': {key: {'type': 'string'} for key in keys}, 'required': list(keys)}}}
    for name, keys in (('navigate_to', ('place',)), ('pick', ('object',)), ('place', ('object', 'place')),
                       ('open', ('object',)), ('close', ('object',)), ('say', ('text',)))]
MAX_LENGTH = 12   # characters of each string argument: a random model's strings end too
CALLS_BUDGET = 512  # max_new_tokens of parallel calls: a random model may make many before it asks for results
CHAT = [{'role': 'system', 'content': 'You control a home robot. Use the tools.'},
        {'role': 'user', 'content': 'Bring me the red cup from the kitchen.'}]


def robot_tools() -> list[dict]:
    """Return the bundled robot tools (inline when config/robot_tools.json is missing), their strings bounded."""
    tools = json.loads(ROBOT_TOOLS_FILE.read_text()) if ROBOT_TOOLS_FILE.exists() else json.loads(
        json.dumps(ROBOT_TOOLS))
    for tool in tools:
        for schema in tool.get('function', tool)['parameters']['properties'].values():
            if schema.get('type') == 'string':
                schema['maxLength'] = MAX_LENGTH
    return tools


def schemas(tools) -> dict:
    return {tool.get('function', tool)['name']: tool.get('function', tool)['parameters'] for tool in tools}


@pytest.fixture(scope='module')
def served(context, tiny_models):
    with serving(context, 'gemma_spec_tools', tiny_params(tiny_models)) as pair:
        yield pair


def test_conversions_carry_tools_thinking_and_calls():
    messages = [ChatMessage(role='user', content='go'),
                ChatMessage(role='assistant', tool_calls=[ToolCallMsg(id='call_0', name='pick',
                                                                      arguments='{"object":"cup"}')]),
                ChatMessage(role='tool', name='pick', content='{"ok": true}')]
    goal = Generate.Goal(messages=messages, tools='[{"name": "pick"}]', tool_choice='required', thinking=True,
                         max_thinking_tokens=3, parallel_tool_calls=False)
    request = goal_to_request(goal, ImageLimits(0, 1))
    assert (request.tools, request.tool_choice, request.parallel_tool_calls, request.thinking,
            request.max_thinking_tokens) == ('[{"name": "pick"}]', 'required', False, True, 3)
    assert goal_to_request(Generate.Goal(), ImageLimits(0, 1)).parallel_tool_calls   # the goal's default: true
    assert request.messages == [
        {'role': 'user', 'content': 'go'},
        {'role': 'assistant', 'content': '', 'tool_calls': [{'id': 'call_0', 'name': 'pick',
                                                             'arguments': '{"object":"cup"}'}]},
        {'role': 'tool', 'content': '{"ok": true}', 'name': 'pick'}]
    call = ToolCall('call_0', 'say', '{"text":"hi"}')
    result = result_to_msg(GenerationResult('', [1], 'tool_calls', GenerationStats(), reasoning='hm',
                                            tool_calls=[call]))
    assert result.finish_reason == 'tool_calls' and result.reasoning == 'hm'
    assert [(c.id, c.name, c.arguments) for c in result.tool_calls] == [('call_0', 'say', '{"text":"hi"}')]
    feedback = delta_to_feedback(StreamDelta('', [1], 1, 1.0, reasoning='h', tool_calls=[call]))
    assert feedback.reasoning_delta == 'h' and feedback.tool_calls_delta[0].name == 'say'
    # make_goal: tools as a list, calls and results as dicts (arguments and content as dicts too)
    goal = make_goal(messages=CHAT + [
        {'role': 'assistant', 'content': '', 'tool_calls': [{'id': 'call_0', 'name': 'say',
                                                             'arguments': {'text': 'hi'}}]},
        {'role': 'tool', 'name': 'say', 'content': {'ok': True}}], tools=ROBOT_TOOLS)
    assert json.loads(goal.tools) == ROBOT_TOOLS
    assert json.loads(goal.messages[2].tool_calls[0].arguments) == {'text': 'hi'}
    assert goal.messages[3].name == 'say' and json.loads(goal.messages[3].content) == {'ok': True}


def test_required_tool_call_then_its_result(served):
    node, client = served
    tools = robot_tools()
    outcome = client.send(make_goal(messages=CHAT, tools=tools, tool_choice='required', parallel_tool_calls=False,
                                    max_new_tokens=64))
    assert outcome.status == 'succeeded', outcome.result.error
    result = outcome.result
    assert result.finish_reason == 'tool_calls' and result.error == '' and len(result.tool_calls) == 1, result
    declared = schemas(tools)
    for number, call in enumerate(result.tool_calls):
        assert call.name in declared and call.id == 'call_{}'.format(number)
        jsonschema.validate(json.loads(call.arguments), declared[call.name])
        jsonschema.validate(json.loads(call.arguments), schemas(ROBOT_TOOLS)[call.name])  # the unbounded tool
    assert result.structure_complete and '<|tool_call>' not in result.text
    assert [(c.id, c.name, c.arguments) for c in outcome.streamed_tool_calls] == [
        (c.id, c.name, c.arguments) for c in result.tool_calls]  # each call streamed as it completed
    assert outcome.streamed_text == result.text

    # the second turn: the calls back, one tool message per call with its result
    answered = client.send(make_goal(
        messages=CHAT + [{'role': 'assistant', 'content': result.text, 'tool_calls': list(result.tool_calls)}] +
        [{'role': 'tool', 'name': call.name, 'content': '{"ok": true}'} for call in result.tool_calls],
        tools=tools, max_new_tokens=12))
    assert answered.status == 'succeeded', answered.result.error
    assert answered.result.finish_reason in ('stop', 'length', 'tool_calls') and answered.result.stats.new_tokens


def test_a_named_tool_choice_calls_that_tool_in_parallel(served):
    node, client = served
    outcome = client.send(make_goal(messages=CHAT, tools=json.dumps(robot_tools()), tool_choice='say',
                                    max_new_tokens=CALLS_BUDGET, drafter='none'))
    assert outcome.status == 'succeeded', outcome.result.error
    assert outcome.result.finish_reason == 'tool_calls'
    calls = outcome.result.tool_calls
    assert {call.name for call in calls} == {'say'} and [c.id for c in calls] == [
        'call_{}'.format(n) for n in range(len(calls))]
    assert [c.arguments for c in outcome.streamed_tool_calls] == [c.arguments for c in calls]


def test_thinking_within_its_budget(served, tiny_models):
    node, client = served
    outcome = client.send(make_goal(messages=CHAT, thinking=True, max_thinking_tokens=3, max_new_tokens=12))
    assert outcome.status == 'succeeded', outcome.result.error
    result = outcome.result
    tokenizer = AutoTokenizer.from_pretrained(tiny_models.target)
    opened, closed = (tokenizer.convert_tokens_to_ids(token) for token in ('<|channel>', '<channel|>'))
    ids = list(result.token_ids)
    assert ids[0] == opened and closed in ids
    assert ids.index(closed) - 1 <= 3    # thought tokens (its 'thought' label too) within max_thinking_tokens
    thought = tokenizer.decode(ids[1:ids.index(closed)])
    assert result.reasoning and thought.endswith(result.reasoning)   # the reasoning is those tokens' text
    for marker in ('<|channel>', '<channel|>'):
        assert marker not in result.text and marker not in result.reasoning
    assert not result.text.startswith('thought')
    assert outcome.streamed_reasoning == result.reasoning and outcome.streamed_text == result.text


CALL = {'id': 'call_0', 'name': 'say', 'arguments': '{"text": "hi"}'}
BAD_TOOL_GOALS = [
    (dict(tools='[{"name": "say",'), 'tools: not valid JSON'),
    (dict(tools=[{'description': 'no name'}]), 'tools[0].name: missing'),
    (dict(tools=[{'name': 'say'}, {'name': 'say'}]), 'tools[1].name: duplicate name "say" (also tools[0])'),
    (dict(tools=ROBOT_TOOLS, tool_choice='fly'), 'tool_choice: no tool is named "fly"'),
    (dict(tool_choice='required'), 'tool_choice: "required" needs tools'),
    (dict(max_thinking_tokens=3), 'max_thinking_tokens applies with thinking on'),
    (dict(prompt='Go.', messages=(), tools=ROBOT_TOOLS), 'tools: declared in the chat template'),
    (dict(tools=ROBOT_TOOLS, json_schema='{"type": "object"}'), 'json_schema constrains the answer'),
    (dict(tools=ROBOT_TOOLS, messages=CHAT + [{'role': 'tool', 'name': 'say', 'content': '{"ok": true}'}]),
     'messages[2]: a tool message answers a tool call'),
    (dict(tools=ROBOT_TOOLS, messages=CHAT + [{'role': 'assistant', 'content': '', 'tool_calls': [CALL]},
                                              {'role': 'tool', 'name': 'pick', 'content': 'done'}]),
     'messages[3].name'),
]


@pytest.mark.parametrize('fields, expected', BAD_TOOL_GOALS, ids=[e[:28] for _, e in BAD_TOOL_GOALS])
def test_bad_tool_goal_is_aborted_naming_the_field(served, fields, expected):
    node, client = served
    outcome = client.send(make_goal(**dict(dict(messages=CHAT, max_new_tokens=8), **fields)))
    assert outcome.accepted and outcome.status == 'aborted', outcome.result
    assert expected in outcome.result.error
    assert outcome.result.finish_reason == 'error' and not outcome.feedback
