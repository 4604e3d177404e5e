"""
One conformance suite for every Backend: the same goals, fields, errors, cancel and tau semantics.

A test module runs it by subclassing BackendConformance and giving the fixture ``conforming``: the backend under
test. test_backend_conformance.py runs it on the local engine (make test), test_vllm_backend.py on a real vLLM
server (make test-vllm). What a backend cannot honour it must refuse in validate() with a ValueError that names
the field; its Capabilities say which.
"""

import json
import math
import threading

import jsonschema
import pytest

from gemma_spec_ros.engine.backend import Backend
from gemma_spec_ros.engine.conversation.tools import check_tool_choice, parse_tools
from gemma_spec_ros.engine.stats import acceptance_rate, tau
from gemma_spec_ros.engine.types import CancelToken, GenerationRequest, WarningKind

PROMPT = 'The robot picked up the red cube and'
SCHEMA = {'type': 'object', 'properties': {'ok': {'type': 'boolean'}, 'step': {'enum': ['grasp', 'place']}},
          'required': ['ok', 'step'], 'additionalProperties': False}
GRAMMAR = 'root ::= "yes" | "no"'
# tools whose calls close in a few tokens even on random weights (bounded strings, an enum)
TOOLS = [{'type': 'function', 'function': {'name': 'pick', 'description': 'Pick up an object.', 'parameters': {
    'type': 'object', 'properties': {'object': {'type': 'string', 'maxLength': 6}, 'gentle': {'type': 'boolean'}},
    'required': ['object']}}},
    {'name': 'say', 'description': 'Speak.', 'parameters': {
        'type': 'object', 'properties': {'mood': {'enum': ['calm', 'loud']}}, 'required': ['mood']}}]
TOOL_SCHEMAS = {tool.get('function', tool)['name']: tool.get('function', tool)['parameters'] for tool in TOOLS}
CHAT = [{'role': 'system', 'content': 'You plan for a robot.'}, {'role': 'user', 'content': 'Bring me the red cup.'}]
# tools every backend refuses, with conversation.tools.parse_tools's message
MALFORMED_TOOLS = {
    'not JSON': '[{"name": "pick"',
    'not a list': '{"name": "pick"}',
    'no name': '[{"description": "Pick."}]',
    'misspelt field': '[{"name": "pick", "parameter": {"type": "object"}}]',
    'duplicate name': '[{"name": "pick"}, {"name": "pick"}]',
    'arguments not an object': '[{"name": "pick", "parameters": {"type": "string"}}]',
    'schema not enforceable': '[{"name": "pick", "parameters": {"type": "object", "properties": {"object": {'
                              '"type": "string", "pattern": "^[a-z]+$"}}}}]',
}

# (field, invalid value): validate() refuses each with a ValueError whose message names the field
INVALID_FIELDS = [
    ('max_new_tokens', -1),
    ('max_new_tokens', 10**6),
    ('temperature', -0.5),
    ('temperature', math.nan),
    ('top_p', 1.5),
    ('top_k', -1),
    ('stop', ['']),
    ('seed', -2),
    ('drafter', 'no-such-drafter'),
    ('num_draft_tokens', 10**4),
    ('prompt_ids', [-1]),
    ('messages', [{'content': 'no role'}]),
    ('json_schema', '{"type": '),
    ('json_schema', '{"type": "object", "not": {}}'),
    ('grammar', 'root ::= ('),
    ('json_free_whitespace', True),  # without a json_schema
    ('json_schema_unenforced', 'check'),  # without a json_schema
    ('json_schema_unenforced', 'ignore'),
]


class BackendConformance:
    """Tests every Backend passes; a subclass provides the fixture ``conforming``."""

    def test_implements_the_backend_interface(self, conforming):
        assert isinstance(conforming, Backend)
        capabilities = conforming.capabilities
        assert conforming.status().backend == capabilities.backend
        assert conforming.describe()
        assert conforming.device == 'cpu' or conforming.device.startswith('cuda')

    def test_a_goal_streams_its_text_and_token_ids(self, conforming):
        deltas = []
        result = conforming.generate(GenerationRequest(prompt=PROMPT, max_new_tokens=12), on_delta=deltas.append)
        assert result.finish_reason == 'length' and len(result.token_ids) == 12 and not result.structure_complete
        assert result.stats.new_tokens == 12 and result.stats.prompt_tokens > 0
        assert ''.join(d.text for d in deltas) == result.text
        assert [t for d in deltas for t in d.token_ids] == result.token_ids
        generated = [d.tokens_generated for d in deltas]
        assert generated == sorted(generated) and generated[-1] == 12

    def test_greedy_output_repeats(self, conforming):
        request = GenerationRequest(prompt=PROMPT, max_new_tokens=10)
        assert conforming.generate(request).token_ids == conforming.generate(request).token_ids

    def test_a_seed_repeats_sampled_output(self, conforming):
        request = GenerationRequest(prompt=PROMPT, max_new_tokens=10, temperature=1.0, top_k=20, top_p=0.9, seed=7)
        assert conforming.generate(request).token_ids == conforming.generate(request).token_ids

    def test_a_stop_string_ends_the_text_before_it(self, conforming):
        text = conforming.generate(GenerationRequest(prompt=PROMPT, max_new_tokens=16)).text
        start = next((i for i in range(2, len(text) - 1) if text[i:i + 2].strip() and text.find(text[i:i + 2]) == i),
                     None)
        if start is None:
            pytest.skip('no stop string found in {!r}'.format(text))
        stopped = conforming.generate(GenerationRequest(prompt=PROMPT, max_new_tokens=16, stop=[text[start:start + 2]]))
        assert stopped.finish_reason == 'stop' and stopped.text == text[:start]

    def test_chat_messages_and_prompt_ids_are_prompts_too(self, conforming):
        chat = conforming.generate(GenerationRequest(messages=[{'role': 'user', 'content': 'Say hi.'}],
                                                     max_new_tokens=4))
        assert chat.finish_reason in ('length', 'stop') and chat.stats.prompt_tokens > 0
        from_text = conforming.generate(GenerationRequest(prompt=PROMPT, max_new_tokens=6))
        prompt_ids = self.prompt_ids(conforming, PROMPT)
        from_ids = conforming.generate(GenerationRequest(prompt_ids=prompt_ids, max_new_tokens=6))
        assert from_ids.token_ids == from_text.token_ids

    def prompt_ids(self, conforming, text) -> list[int]:
        """Return the token ids of text as the backend tokenizes a text prompt; a subclass says how."""
        raise NotImplementedError

    @pytest.mark.parametrize('name, value', INVALID_FIELDS, ids=[name for name, _ in INVALID_FIELDS])
    def test_an_invalid_field_is_refused_by_name(self, conforming, name, value):
        fields = {'prompt': PROMPT, name: value}
        if name in ('prompt_ids', 'messages'):
            del fields['prompt']
        with pytest.raises(ValueError, match=name):
            conforming.validate(GenerationRequest(**fields))

    def test_an_empty_goal_is_refused(self, conforming):
        with pytest.raises(ValueError, match='prompt'):
            conforming.validate(GenerationRequest())

    def test_every_field_is_honoured_or_refused_by_name(self, conforming):
        """A field set to a valid value either works or is refused with a reason that names it."""
        capabilities = conforming.capabilities
        drafter = capabilities.drafters[-1] if capabilities.drafters else ''
        refused = {}
        for name, value in [('drafter', drafter), ('num_draft_tokens', 2)]:
            request = GenerationRequest(prompt=PROMPT, max_new_tokens=8, **{name: value})
            try:
                result = conforming.generate(request)
            except ValueError as error:
                assert name in str(error), error
                refused[name] = str(error)
                continue
            assert result.finish_reason == 'length', result.error
            if name == 'drafter':
                assert result.stats.drafter == drafter
            elif drafter:
                assert result.stats.drafted_tokens <= 2 * result.stats.target_passes
        assert ('num_draft_tokens' in refused) != capabilities.num_draft_tokens_per_goal, refused
        assert 'drafter' not in refused, refused

    def test_json_schema_output_is_valid(self, conforming):
        for free_whitespace in (False, True):
            result = conforming.generate(GenerationRequest(
                prompt='Answer in JSON. ' + PROMPT, max_new_tokens=120, json_schema=json.dumps(SCHEMA),
                json_free_whitespace=free_whitespace))
            assert result.finish_reason == 'stop' and result.structure_complete, (result.finish_reason, result.text)
            jsonschema.validate(json.loads(result.text), SCHEMA)
            if not free_whitespace:
                assert ' ' not in result.text and '\n' not in result.text, result.text

    def test_an_unenforced_keyword_is_refused_or_checked(self, conforming):
        schema = json.dumps(dict(SCHEMA, properties=dict(SCHEMA['properties'], tags={
            'type': 'array', 'items': {'type': 'string', 'pattern': '^[a-z]{1,4}$'}, 'maxItems': 2,
            'uniqueItems': True})))
        with pytest.raises(ValueError, match=r"^json_schema: 'uniqueItems' at \$\.properties\.tags is not enforced"):
            conforming.validate(GenerationRequest(prompt=PROMPT, json_schema=schema))
        result = conforming.generate(GenerationRequest(prompt='Answer in JSON. ' + PROMPT, max_new_tokens=120,
                                                       json_schema=schema, json_schema_unenforced='check'))
        assert result.warnings[0].kind is WarningKind.UNENFORCED_KEYWORD, result.warnings
        tags = json.loads(result.text).get('tags', []) if result.finish_reason == 'stop' else None
        assert result.structure_complete == (tags is not None and len(set(tags)) == len(tags)), result.text

    def test_grammar_output_is_in_the_language(self, conforming):
        result = conforming.generate(GenerationRequest(prompt='Yes or no? ' + PROMPT, max_new_tokens=8,
                                                       grammar=GRAMMAR))
        assert result.finish_reason == 'stop' and result.text in ('yes', 'no'), (result.finish_reason, result.text)
        assert result.structure_complete
        cut = conforming.generate(GenerationRequest(prompt=PROMPT, max_new_tokens=3, json_schema=json.dumps(SCHEMA)))
        assert cut.finish_reason == 'length' and not cut.structure_complete  # the length limit came first

    def test_cancel_ends_the_goal_with_its_partial_text(self, conforming):
        cancel, deltas = CancelToken(), []

        def on_delta(delta):
            deltas.append(delta)
            cancel.cancel()

        result = conforming.generate(GenerationRequest(prompt=PROMPT, max_new_tokens=400), on_delta=on_delta,
                                     cancel=cancel)
        assert result.finish_reason == 'cancelled'
        assert 0 < result.stats.new_tokens < 400 and result.text == ''.join(d.text for d in deltas)

    def test_a_goal_cancelled_before_it_starts_generates_nothing(self, conforming):
        cancel = CancelToken()
        cancel.cancel()
        result = conforming.generate(GenerationRequest(prompt=PROMPT, max_new_tokens=20), cancel=cancel)
        assert result.finish_reason == 'cancelled' and result.token_ids == []

    def test_tau_and_acceptance_follow_the_one_definition(self, conforming):
        for _ in range(3):   # a vLLM window that an earlier (cancelled) goal's late counters reach is server-wide
            result = conforming.generate(GenerationRequest(prompt='the cube, the cube, the cube, the cube, the',
                                                           max_new_tokens=24))
            if not getattr(result, 'server_wide', False):
                break
        stats = result.stats
        assert stats.target_passes >= 1
        assert stats.tau == pytest.approx(tau(stats.new_tokens, stats.target_passes))
        expected = acceptance_rate(stats.accepted_tokens, stats.drafted_tokens)
        assert stats.acceptance_rate == pytest.approx(expected, nan_ok=True)
        assert 1.0 <= stats.tau <= stats.new_tokens

    def test_defaults_follow_the_capabilities(self, conforming):
        capabilities, default = conforming.capabilities, conforming.status().drafter
        try:
            for drafter in capabilities.drafters:
                conforming.set_default_drafter(drafter)
        finally:
            conforming.set_default_drafter(default)
        with pytest.raises(ValueError, match='drafter'):
            conforming.set_default_drafter('no-such-drafter')
        conforming.set_default_num_draft_tokens(0)
        if capabilities.num_draft_tokens_per_goal:
            conforming.set_default_num_draft_tokens(2)
            conforming.set_default_num_draft_tokens(0)
        else:
            with pytest.raises(ValueError, match='num_draft_tokens'):
                conforming.set_default_num_draft_tokens(2)

    # ------------------------------------------------------------------------------------- tools and thinking
    @pytest.mark.parametrize('tools', MALFORMED_TOOLS.values(), ids=MALFORMED_TOOLS)
    def test_malformed_tools_are_refused_alike(self, conforming, tools):
        with pytest.raises(ValueError) as expected:
            parse_tools(tools)
        with pytest.raises(ValueError) as refused:
            conforming.validate(GenerationRequest(messages=CHAT, tools=tools))
        assert str(refused.value) == str(expected.value) and str(refused.value).startswith('tools')

    def test_a_tool_choice_naming_no_tool_is_refused(self, conforming):
        tools = json.dumps(TOOLS)
        for choice, offered in (('fly', tools), ('required', ''), ('pick', '')):
            with pytest.raises(ValueError) as expected:
                check_tool_choice(choice, parse_tools(offered))
            with pytest.raises(ValueError) as refused:
                conforming.validate(GenerationRequest(messages=CHAT, tools=offered, tool_choice=choice))
            assert str(refused.value) == str(expected.value) and str(refused.value).startswith('tool_choice')

    def test_tools_and_thinking_need_chat_messages(self, conforming):
        for fields in ({'tools': json.dumps(TOOLS)}, {'thinking': True}):
            with pytest.raises(ValueError, match='^{}: .*messages'.format(next(iter(fields)))):
                conforming.validate(GenerationRequest(prompt=PROMPT, **fields))

    def test_required_tool_calls_are_valid_or_refused_by_name(self, conforming):
        """tool_choice required: valid calls (finish tool_calls, arguments valid under the schema), or refused."""
        deltas = []
        request = GenerationRequest(messages=CHAT, tools=json.dumps(TOOLS), tool_choice='required',
                                    parallel_tool_calls=False, max_new_tokens=64)
        try:
            result = conforming.generate(request, on_delta=deltas.append)
        except ValueError as error:
            assert str(error).startswith(('tools', 'tool_choice')), error
            return
        assert result.finish_reason == 'tool_calls' and result.structure_complete, (result.finish_reason, result.text)
        assert len(result.tool_calls) == 1 and result.text == '' and not result.warnings
        call = result.tool_calls[0]
        assert call.id == 'call_0' and call.name in TOOL_SCHEMAS
        jsonschema.validate(json.loads(call.arguments), TOOL_SCHEMAS[call.name])
        assert [streamed for delta in deltas for streamed in delta.tool_calls] == result.tool_calls
        named = conforming.generate(GenerationRequest(messages=CHAT, tools=json.dumps(TOOLS), tool_choice='say',
                                                      parallel_tool_calls=False, max_new_tokens=64))
        assert named.finish_reason == 'tool_calls' and [c.name for c in named.tool_calls] == ['say']
        assert json.loads(named.tool_calls[0].arguments)['mood'] in ('calm', 'loud')

    def test_thinking_goes_to_reasoning_apart_from_the_text(self, conforming):
        """thinking: the thoughts (at most max_thinking_tokens) come as reasoning, never in the text; or refused."""
        deltas = []
        request = GenerationRequest(messages=CHAT, thinking=True, max_thinking_tokens=4, max_new_tokens=12)
        try:
            result = conforming.generate(request, on_delta=deltas.append)
        except ValueError as error:
            assert str(error).startswith('thinking'), error
            return
        assert result.finish_reason in ('stop', 'length') and not result.tool_calls
        for marker in ('<|channel>', '<channel|>', '<|think>'):
            assert marker not in result.text and marker not in result.reasoning
        assert ''.join(d.reasoning for d in deltas) == result.reasoning
        assert ''.join(d.text for d in deltas) == result.text
        if result.finish_reason == 'length':   # the channel closed after at most 4 thought tokens: an answer follows
            assert result.text

    def test_concurrent_goals_each_get_their_own_result(self, conforming):
        results = [None, None]
        requests = [GenerationRequest(prompt=PROMPT, max_new_tokens=6),
                    GenerationRequest(prompt='Count: one, two,', max_new_tokens=9)]

        def run(index):
            results[index] = conforming.generate(requests[index])

        threads = [threading.Thread(target=run, args=(index,)) for index in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(300)
        assert [len(r.token_ids) for r in results] == [6, 9]
        assert results[0].token_ids == conforming.generate(requests[0]).token_ids
