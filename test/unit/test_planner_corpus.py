"""The synthetic robot-task corpus (train/corpora/planner.py): chat-template rendering, held-out split, tool schemas."""

import json
import random
import re

import jsonschema
import pytest
import torch

from gemma_spec_ros.train.cli import main
from gemma_spec_ros.train.corpora import corpus, planner
from gemma_spec_ros.train.corpora.data import TokenStream, random_windows

CONTROL = ('<|turn>', '<turn|>', '<|tool>', '<tool|>', '<|tool_call>', '<tool_call|>', '<|tool_response>',
           '<tool_response|>', '<|"|>', '<|channel>', '<channel|>', '<|think>')


def all_calls(conversation: planner.Conversation) -> list[tuple[str, dict]]:
    return conversation.calls + [call for _, calls, _ in conversation.later for call in calls]


@pytest.fixture(scope='module')
def tokenizer():
    return planner._cached_tokenizer()


@pytest.fixture(scope='module')
def conversations(tokenizer) -> list[planner.Conversation]:
    rng = random.Random(0)
    return [planner.training_conversation(rng, tokenizer) for _ in range(300)]


def test_renders_through_the_chat_template_with_single_control_tokens(tokenizer, conversations):
    vocab = tokenizer.get_vocab()
    for conversation in conversations[:40]:
        ids = tokenizer(conversation.text, add_special_tokens=False)['input_ids']
        assert tokenizer.decode(ids) == conversation.text
        for token in CONTROL:   # every control token in the text is one token
            assert ids.count(vocab[token]) == conversation.text.count(token), token
        assert ids.count(vocab['<|tool_call>']) == len(all_calls(conversation))
        for name, _ in all_calls(conversation):
            assert f'<|tool_response>response:{name}{{ok:true}}<tool_response|>' in conversation.text
        last_answer = conversation.later[-1][2] if conversation.later else conversation.answer
        assert conversation.text.endswith(f'<tool_response|>{last_answer}<turn|>\n')
        assert conversation.text.count('<|turn>user\n') == 1 + len(conversation.later)
        plain = tokenizer.apply_chat_template(conversation.messages, tools=conversation.tools, tokenize=False,
                                              enable_thinking=conversation.thinking)
        if conversation.thinking:   # thoughts open the reply, before the first call
            assert '<|turn>system\n<|think>' in conversation.text
            assert conversation.text == plain.replace(
                '<|turn>model\n', f'<|turn>model\n<|channel>thought\n{conversation.thought}<channel|>', 1)
        else:
            assert conversation.text == plain and '<|channel>' not in plain
    share = sum(c.thinking for c in conversations) / len(conversations)
    assert 0.2 < share < 0.4
    assert any(c.later for c in conversations) and not any(c.later for c in conversations if c.thinking)


def test_held_out_combinations_and_phrasings_never_train(conversations):
    held_pairs = [(thing, place) for thing in planner.objects()
                  for place in (*planner.SURFACES, 'fridge', 'drawer', 'bin')
                  if planner.is_held_out_pair(thing, place)]
    assert held_pairs
    held_phrasings = [re.compile(re.escape(planner.PHRASINGS[kind][index]).replace(r'\{x\}', '.+')
                                 .replace(r'\{a\}', '.+').replace(r'\{b\}', '.+').replace(r'\{t\}', '.+') + '$')
                      for kind, index in planner.HELD_OUT_PHRASING.items()]
    for conversation in conversations:
        users = [m['content'] for m in conversation.messages if m['role'] == 'user']
        for request in map(planner.request_of, users):
            assert not any(pattern.match(request) for pattern in held_phrasings), request
        placed = {(a['object'], a['place']) for name, a in all_calls(conversation) if name == 'place'}
        for thing, place in held_pairs:
            assert not any(f'a {thing} on the {place}' in user for user in users)
            assert (thing, place) not in placed
    held = [planner.held_out_conversation(seed) for seed in range(20)]
    assert [c.text for c in held] == [planner.held_out_conversation(seed).text for seed in range(20)]
    texts = {c.text for c in conversations}
    assert not texts.intersection(c.text for c in held)


def test_the_system_turn_is_fixed_and_each_user_turn_shows_the_scene_as_it_is_now(conversations):
    assert {c.messages[0]['content'] for c in conversations} == {planner.SYSTEM}
    checked = 0
    for conversation in conversations:
        users = [m['content'] for m in conversation.messages if m['role'] == 'user']
        assert all(u.startswith(('Scene: a ', 'Scene: no objects.')) and u.count('\n') == 1 for u in users)
        requests = [conversation.calls] + [calls for _, calls, _ in conversation.later]
        for before, now, calls in zip(users, users[1:], requests, strict=False):
            scene_before, scene_now = before.split('\n')[0], now.split('\n')[0]
            for name, arguments in calls:
                if name != 'place':
                    continue
                thing, place = arguments['object'], arguments['place']
                gone = place in ('fridge', 'drawer', 'bin', 'user')
                assert f'a {thing} on the ' in scene_before
                assert (f'a {thing} on the ' in scene_now) != gone
                assert gone or f'a {thing} on the {place}' in scene_now
                checked += 1
    assert checked > 20
    held = planner.held_out_conversation(0)
    assert held.request == planner.request_of(held.messages[1]['content']) and 'Scene' not in held.request


def test_chat_turns_without_tools_continue_the_given_text(tokenizer, tmp_path):
    text = ''.join(f'def function_{i}(x):\n    return x + {i}\n\n' for i in range(100))
    out = tmp_path / 'chat.jsonl'
    planner.write_corpus(out, 60, 2, tokenizer, chat_share=0.5, chat_texts=[text])
    rows = [json.loads(line)['text'] for line in out.read_text().splitlines()]
    chats = [row for row in rows if '<|tool>' not in row]
    assert 15 < len(chats) < 45
    for chat in chats:
        assert chat.startswith('<|turn>') and '<|tool_call>' not in chat and chat.endswith('<turn|>\n')
        user = chat.split('<|turn>user\n', 1)[1].split('<turn|>', 1)[0]
        reply = chat.split('<|turn>model\n', 1)[1].removesuffix('<turn|>\n')
        head = user.split('\n', 1)[1] if user.startswith(('Continue', 'Go on')) else user
        assert re.sub(r'\s', '', head + reply) in re.sub(r'\s', '', text)   # the template trims each turn
    with pytest.raises(ValueError, match='chat_texts'):
        planner.write_corpus(out, 4, 2, tokenizer, chat_share=0.5)


def test_expected_calls_fit_the_tool_schemas(conversations):
    tools = json.loads(planner.TOOLS_PATH.read_text())
    schemas = {tool['function']['name']: tool['function']['parameters'] for tool in tools}
    assert set(schemas) == {'navigate_to', 'pick', 'place', 'open', 'close', 'say'}
    for schema in schemas.values():
        assert schema['required'] == list(schema['properties'])
    for conversation in conversations + [planner.held_out_conversation(seed) for seed in range(20)]:
        assert conversation.calls
        for name, arguments in all_calls(conversation):
            jsonschema.validate(arguments, schemas[name])
            assert planner.valid_arguments(name, arguments, tools)
    assert not planner.valid_arguments('pick', {'thing': 'red cup'}, tools)
    assert not planner.valid_arguments('fly', {}, tools)


def test_corpus_command_and_whole_conversation_windows(tokenizer, tmp_path):
    out = tmp_path / 'planner.jsonl'
    assert main(['planner-corpus', '--out', str(out), '--conversations', '12', '--seed', '1']) == 0
    documents = corpus.load_documents([str(out)], 'all')
    assert len(documents) == 12 and all(d.text.startswith('<|turn>system\n') for d in documents)
    code = corpus.Document('x.py', 'code', 'x = 1\n' * 400)
    stream = TokenStream.from_documents(tokenizer, [code, *documents, code])
    assert len(stream.chat_spans) == 12
    turn = tokenizer.convert_tokens_to_ids('<|turn>')
    windows = random_windows(stream, 64, 1025, torch.Generator().manual_seed(0))
    inside = [w for w in windows if turn in w[:8].tolist()]
    assert inside and all(w[0] == tokenizer.bos_token_id and w[1] == turn for w in inside)


def test_kind_weights_shift_the_training_mix(tokenizer):
    weights = planner.parse_kind_weights('where=30, say=0')
    assert weights['where'] == 30 and weights['say'] == 0 and weights['move'] == planner.KIND_WEIGHTS['move']
    rng = random.Random(1)
    drawn = [planner.training_conversation(rng, tokenizer, weights) for _ in range(60)]
    first_calls = [c.calls[0][0] for c in drawn]
    assert first_calls.count('say') > 30   # 'where' answers with a say call; plain 'say' requests are gone
    assert not any(c.request.startswith(('Say "', 'Tell everyone', 'Please say', 'Announce')) for c in drawn)
    for text, message in (('fly=2', "unknown request kind 'fly'"), ('where=x', "where='x' is not a number"),
                          ('where=-1', 'where must not be negative'),
                          (','.join(f'{kind}=0' for kind in planner.KIND_WEIGHTS), 'at least one kind')):
        with pytest.raises(ValueError, match='^--kind-weights: ' + re.escape(message)):
            planner.parse_kind_weights(text)


def test_novel_words_train_only(tokenizer):
    rng = random.Random(3)
    drawn = [planner.training_conversation(rng, tokenizer, novel_share=1.0) for _ in range(40)]
    novel = planner.NOVEL_COLOURS + planner.NOVEL_THINGS + planner.NOVEL_SURFACES
    scenes = [c.messages[1]['content'].split('\n', 1)[0] for c in drawn]
    assert sum(any(word in scene for word in novel) for scene in scenes) > 30
    for c in drawn:   # the calls read the scene: the first call goes where the scene puts the object
        if c.calls[0][0] == 'navigate_to' and c.request.split()[-1] not in ('door.', 'door?'):
            target = c.calls[1][1]['object']
            assert f'a {target} on the {c.calls[0][1]["place"]}' in c.messages[1]['content']
    held = [planner.held_out_conversation(seed, tokenizer) for seed in range(40)]
    assert not any(word in c.text for c in held for word in novel)


def test_fresh_scenes_give_each_request_its_own_scene_and_fit_the_window(tokenizer):
    rng = random.Random(4)
    drawn = [planner.training_conversation(rng, tokenizer, requests=8, fresh_scenes=True) for _ in range(30)]
    several = [c for c in drawn if c.later]
    assert len(several) > 10 and not any(c.later for c in drawn if c.thinking)
    for c in drawn:
        users = [m['content'] for m in c.messages if m['role'] == 'user']
        assert len(users) == 1 + len(c.later)
        assert len(tokenizer(c.text, add_special_tokens=False)['input_ids']) <= planner.MAX_TOKENS or not c.later
        for user, (_, calls, _) in zip(users[1:], c.later, strict=True):
            if calls[0][0] == 'navigate_to' and calls[1][0] == 'pick':   # each goes where its own scene says
                assert f'a {calls[1][1]["object"]} on the {calls[0][1]["place"]}' in user
    assert len({m['content'].split('\n', 1)[0] for c in several for m in c.messages if m['role'] == 'user'}) > \
        len(several) + 5   # scenes differ within conversations
    with pytest.raises(ValueError, match='requests must be at least 1'):
        planner.training_conversation(rng, tokenizer, requests=0)


def test_argument_weight_marks_only_the_value_of_that_argument(tokenizer):
    from gemma_spec_ros.train.lm import ArgumentWeight

    weight = ArgumentWeight.parse('navigate_to.place=8', tokenizer)
    conversation = planner.training_conversation(random.Random(3), tokenizer)
    ids = torch.tensor([tokenizer(conversation.text, add_special_tokens=False)['input_ids']])
    marked = weight.weights(ids)[0]
    values = ''.join(tokenizer.decode(ids[0, i]) for i in (marked == 8).nonzero().flatten().tolist())
    assert values == ''.join(args['place'] for name, args in all_calls(conversation) if name == 'navigate_to')
    assert set(marked.unique().tolist()) == {1.0, 8.0}
    for text in ('navigate_to=8', 'navigate_to.place', 'navigate_to.place=0', 'navigate_to.place=x'):
        with pytest.raises(ValueError, match='^--argument-weight: expected NAME.KEY=W'):
            ArgumentWeight.parse(text, tokenizer)
