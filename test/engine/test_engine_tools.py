"""Tool calls and thinking through the engine on tiny random Gemma 4 models: validity, greedy parity, χ², errors."""

import json
from collections import Counter

import jsonschema
import pytest
from conftest import chi_squared_p_value, sampling_distribution

from gemma_spec_ros.engine import GenerationRequest
from gemma_spec_ros.engine.conversation.format import ConversationTokens
from gemma_spec_ros.engine.logits.grammar import mask_logits
from gemma_spec_ros.engine.logits.reply import ReplyConstraint

STRING = {'type': 'string', 'maxLength': 6}    # random weights write long strings: bounded, so calls close
TOOLS = [
    {'type': 'function', 'function': {'name': 'navigate_to', 'description': 'Drive to a place.', 'parameters': {
        'type': 'object', 'properties': {'place': STRING}, 'required': ['place']}}},
    {'type': 'function', 'function': {'name': 'pick', 'description': 'Pick up an object.', 'parameters': {
        'type': 'object', 'properties': {'object': STRING, 'gentle': {'type': 'boolean'},
                                         'count': {'enum': [1, 2, 3]}}, 'required': ['object']}}},
    {'name': 'say', 'description': 'Speak.', 'parameters': {
        'type': 'object', 'properties': {'mood': {'enum': ['calm', 'loud']}}, 'required': ['mood']}},
]
SCHEMAS = {tool.get('function', tool)['name']: tool.get('function', tool)['parameters'] for tool in TOOLS}
MESSAGES = [{'role': 'system', 'content': 'You plan for a robot.'}, {'role': 'user', 'content': 'Bring the cup.'}]
DRAFTERS = ('none', 'ngram', 'lookahead', 'draft', 'mtp')


def request(**fields) -> GenerationRequest:
    # one call per reply: random weights would call again and again
    fields = {'messages': MESSAGES, 'tools': json.dumps(TOOLS), 'max_new_tokens': 160, 'parallel_tool_calls': False,
              **fields}
    return GenerationRequest(**fields)


def assert_valid_calls(result):
    assert result.finish_reason == 'tool_calls' and result.structure_complete, (result.finish_reason, result.text)
    assert result.tool_calls and not result.warnings
    for index, call in enumerate(result.tool_calls):
        assert call.id == 'call_{}'.format(index)
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


@pytest.mark.parametrize('drafter', DRAFTERS)
def test_required_calls_are_valid_and_greedy_equals_plain(tiny_engine, drafter):
    plain = tiny_engine.generate(request(tool_choice='required', drafter='none'))
    assert_valid_calls(plain)
    for k in (0, 3):
        deltas = []
        result = tiny_engine.generate(request(tool_choice='required', drafter=drafter, num_draft_tokens=k),
                                      on_delta=deltas.append)
        assert result.token_ids == plain.token_ids, (drafter, k)
        assert result.tool_calls == plain.tool_calls and result.text == plain.text == ''
        assert [call for delta in deltas for call in delta.tool_calls] == result.tool_calls  # streamed as they form
    tokens = ConversationTokens.of(tiny_engine.tokenizer.get_vocab())
    assert plain.token_ids[0] == tokens.call_open and plain.token_ids[-1] == tokens.response_open


@pytest.mark.parametrize('drafter', ['ngram', 'lookahead', 'draft', 'mtp'])
def test_drafters_propose_only_what_the_reply_allows(tiny_engine, monkeypatch, drafter):
    drafts = []
    masks_along = ReplyConstraint.masks_along

    def recording(self, draft_tokens, device=None):
        masks, allowed = masks_along(self, draft_tokens, device)
        drafts.append((len(draft_tokens), allowed))
        return masks, allowed

    monkeypatch.setattr(ReplyConstraint, 'masks_along', recording)
    for seed, temperature in enumerate((0.0, 1.0, 1.0)):
        assert_valid_calls(tiny_engine.generate(request(tool_choice='required', thinking=True, max_thinking_tokens=4,
                                                        drafter=drafter, num_draft_tokens=3, temperature=temperature,
                                                        seed=seed)))
    assert sum(length for length, _ in drafts) > 10
    assert all(allowed == length for length, allowed in drafts)  # cut (n-gram) or masked (models) while drafting


@pytest.mark.parametrize('drafter', ['none', 'mtp'])
def test_a_named_tool_forces_that_tool(tiny_engine, drafter):
    for seed, temperature in enumerate((0.0, 1.0)):
        result = tiny_engine.generate(request(tool_choice='say', drafter=drafter, temperature=temperature, seed=seed))
        assert_valid_calls(result)
        assert {call.name for call in result.tool_calls} == {'say'}


@pytest.mark.parametrize('drafter', ['none', 'draft'])
def test_sampled_auto_replies_are_text_or_valid_calls(tiny_engine, drafter):
    finishes = Counter()
    for seed in range(6):
        result = tiny_engine.generate(request(tool_choice='auto', drafter=drafter, temperature=1.0, seed=seed,
                                              num_draft_tokens=2))
        finishes[result.finish_reason] += 1
        if result.finish_reason == 'tool_calls':
            assert_valid_calls(result)
        else:
            assert not result.tool_calls and '<|tool_call>' not in result.text
    assert set(finishes) <= {'stop', 'length', 'tool_calls'}


def test_none_never_calls(tiny_engine):
    vocab = tiny_engine.tokenizer.get_vocab()
    for seed in range(3):
        result = tiny_engine.generate(request(tool_choice='none', temperature=1.0, seed=seed, max_new_tokens=40))
        assert result.finish_reason in ('stop', 'length') and not result.tool_calls
        assert vocab['<|tool_call>'] not in result.token_ids and vocab['<|tool_response>'] not in result.token_ids


def test_text_cut_off_by_max_new_tokens_is_no_incomplete_structure(tiny_engine):
    result = tiny_engine.generate(request(tool_choice='none', max_new_tokens=3))
    assert result.finish_reason == 'length' and not result.warnings and not result.structure_complete


def test_a_call_cut_off_by_max_new_tokens_ends_length_without_calls(tiny_engine):
    result = tiny_engine.generate(request(tool_choice='required', max_new_tokens=4, drafter='mtp'))
    assert result.finish_reason == 'length' and result.tool_calls == [] and not result.structure_complete
    assert 'tool calls' in result.warnings[0]


@pytest.mark.parametrize('drafter', DRAFTERS)
def test_thinking_keeps_its_budget_and_stays_out_of_the_text(tiny_engine, drafter):
    tokens = ConversationTokens.of(tiny_engine.tokenizer.get_vocab())
    plain = tiny_engine.generate(request(tools='', thinking=True, max_thinking_tokens=3, drafter='none',
                                         max_new_tokens=24))
    result = tiny_engine.generate(request(tools='', thinking=True, max_thinking_tokens=3, drafter=drafter,
                                          num_draft_tokens=3, max_new_tokens=24))
    assert result.token_ids == plain.token_ids and result.reasoning == plain.reasoning
    ids = result.token_ids
    assert ids[0] == tokens.channel_open and ids[4] == tokens.channel_close   # 3 thought tokens, then closed
    thought = tiny_engine.tokenizer.decode(ids[1:4])
    assert result.reasoning == thought.removeprefix('thought\n')
    assert result.text == tiny_engine.tokenizer.decode(
        [t for t in ids[5:] if t not in tiny_engine.eos_token_ids], skip_special_tokens=True)


def test_thinking_then_calls(tiny_engine):
    result = tiny_engine.generate(request(tool_choice='required', thinking=True, max_thinking_tokens=5,
                                          drafter='mtp', num_draft_tokens=2))
    assert_valid_calls(result)
    assert result.token_ids.index(ConversationTokens.of(tiny_engine.tokenizer.get_vocab()).channel_close) <= 6


def test_stop_strings_apply_to_the_answer_not_the_thoughts(tiny_engine):
    full = tiny_engine.generate(request(tools='', thinking=True, max_thinking_tokens=6, max_new_tokens=30))
    assert full.reasoning and full.text
    stop = full.reasoning[:2]
    result = tiny_engine.generate(request(tools='', thinking=True, max_thinking_tokens=6, max_new_tokens=30,
                                          stop=[stop]))
    if stop not in full.text:   # a stop string seen only in the thoughts does not end the reply
        assert result.token_ids == full.token_ids and result.reasoning == full.reasoning


def test_a_continued_turn_with_results_renders_and_runs(tiny_engine):
    first = tiny_engine.generate(request(tool_choice='required', drafter='mtp'))
    assert_valid_calls(first)
    history = MESSAGES + [
        {'role': 'assistant', 'content': '', 'tool_calls': [
            {'id': call.id, 'name': call.name, 'arguments': call.arguments} for call in first.tool_calls]},
        *({'role': 'tool', 'name': call.name, 'content': '{"ok": true}'} for call in first.tool_calls)]
    plan = tiny_engine.validate(request(messages=history, tool_choice='auto'))
    prompt = tiny_engine.tokenizer.decode(plan.prompt_ids)
    assert prompt.endswith('<|tool_response>response:{}{{ok:true}}<tool_response|>'.format(first.tool_calls[-1].name))
    assert tiny_engine.generate(plan).finish_reason in ('stop', 'length', 'tool_calls')


def test_thinking_opens_a_turn_and_a_reply_after_tool_results_may_go_on_without_it(tiny_engine):
    tokens = ConversationTokens.of(tiny_engine.tokenizer.get_vocab())
    history = MESSAGES + [
        {'role': 'assistant', 'content': '', 'tool_calls': [{'name': 'say', 'arguments': '{"text": "hi"}'}]},
        {'role': 'tool', 'name': 'say', 'content': '{"ok": true}'}]
    opening = tiny_engine.validate(request(thinking=True, tool_choice='auto'))
    resuming = tiny_engine.validate(request(messages=history, thinking=True, tool_choice='auto'))
    assert not opening.reply.resumes and resuming.reply.resumes
    word = tiny_engine.tokenizer.encode('Done', add_special_tokens=False)[0]
    first = ReplyConstraint(tiny_engine.constraints, opening.reply, None, opening.compiled_calls)
    assert first.next_mask()[0].nonzero().flatten().tolist() == [tokens.channel_open]   # a turn thinks first
    later = ReplyConstraint(tiny_engine.constraints, resuming.reply, None, resuming.compiled_calls)
    mask = later.next_mask()[0]
    assert mask[tokens.channel_open] and mask[tokens.call_open] and mask[word]   # think again, call, or answer
    assert later.advance(word) and not later.in_thought and not later.advance(tokens.channel_open)
    later.rollback(1)
    assert later.advance(tokens.channel_open) and later.in_thought
    for drafter in DRAFTERS:   # lossless as every mask: the same greedy tokens for each drafter
        result = tiny_engine.generate(request(messages=history, thinking=True, max_thinking_tokens=3,
                                              max_new_tokens=16, drafter=drafter, num_draft_tokens=3))
        plain = tiny_engine.generate(request(messages=history, thinking=True, max_thinking_tokens=3,
                                             max_new_tokens=16, drafter='none'))
        assert result.token_ids == plain.token_ids


def test_sampled_calls_follow_the_constrained_target_distribution(tiny_engine):
    """χ² of the first tokens of sampled replies against the target's exact distribution under the reply's masks."""
    temperature, top_k, length, samples = 2.0, 3, 4, 300
    fields = dict(tool_choice='auto', thinking=True, max_thinking_tokens=1, temperature=temperature, top_k=top_k)
    plan = tiny_engine.validate(request(**fields, drafter='mtp', num_draft_tokens=2, max_new_tokens=length))
    model, compiler = tiny_engine.target_lm.model, tiny_engine.constraints

    def next_logits(prefix):
        import torch

        constraint = ReplyConstraint(compiler, plan.reply, None, plan.compiled_calls)
        if not all(constraint.advance(token) for token in prefix):   # top-k's zero-probability branches
            return torch.zeros(compiler.vocab_size)
        logits = model(torch.tensor([plan.prompt_ids + list(prefix)])).logits[0, -1:]
        return mask_logits(logits, constraint.next_mask())[0]

    expected = sampling_distribution(next_logits, temperature, top_k, length)
    observed = Counter()
    for seed in range(samples):
        result = tiny_engine.generate(request(**fields, drafter='mtp', num_draft_tokens=2, max_new_tokens=length,
                                              seed=seed))
        observed[tuple(result.token_ids)] += 1
    assert chi_squared_p_value(observed, expected) > 1e-3


@pytest.mark.parametrize('fields, message', [
    (dict(tools='[{"name": "pick"'), r'^tools: not valid JSON'),
    (dict(tools='{"name": "pick"}'), r'^tools must be a JSON list'),
    (dict(tools='[{"description": "x"}]'), r'^tools\[0\]\.name'),
    (dict(tools='[{"name": "pick"}, {"name": "pick"}]'), r'^tools\[1\]\.name: duplicate name'),
    (dict(tools=json.dumps([{'name': 'go', 'parameters': {'type': 'object', 'properties': {
        'x': {'type': 'number', 'minimum': 0}}}}])), r'^tools\[0\]\.parameters: .*minimum'),
    (dict(tool_choice='fly'), r'^tool_choice: '),
    (dict(tools='', tool_choice='required'), r'^tool_choice: '),
    (dict(tool_choice='required', json_schema='{"type": "object"}'), r'^json_schema .*tool_choice'),
    (dict(max_thinking_tokens=4), r'^max_thinking_tokens applies with thinking on'),
    (dict(messages=None, prompt='Bring the cup.'), r'^tools: .*need messages'),
    (dict(messages=MESSAGES + [{'role': 'tool', 'content': '{}'}]), r'^messages\[2\]: a tool message answers'),
    (dict(messages=MESSAGES + [{'role': 'assistant', 'content': '', 'tool_calls': [
        {'name': 'pick', 'arguments': '[1]'}]}]), r'^messages\[2\]\.tool_calls\[0\]\.arguments must be a JSON object'),
])
def test_bad_tool_fields_are_refused_naming_the_field(tiny_engine, fields, message):
    with pytest.raises(ValueError, match=message):
        tiny_engine.validate(request(**fields))
