"""
A synthetic robot-task corpus in Gemma 4's chat format, and a held-out evaluation of a model as the task planner.

A scene puts a few coloured objects on the places of a home (kitchen table, counter, shelf, ...). The system turn
says what the robot is and lists the scene; the tools are config/robot_tools.json's. A request (bring, put in the
fridge or the drawer, throw away, fetch to the user, tell where, open or close the door) has one right sequence
of calls; every call is answered by the tool response {'ok': True}, and after the last one the model answers with
one short sentence. About 30 % of the conversations think first (one thought sentence naming the plan).

Held out, never trained on (by hash, stable across runs and machines): a fixed share of the (object, place)
combinations, anywhere in a conversation, and one phrasing of most request kinds. A held-out conversation asks for
a held-out combination or in a held-out phrasing.

    example = training_conversation(random.Random(0))   # .messages, .tools, .thinking, .calls, .text
    example = held_out_conversation(seed=3)
"""

import dataclasses
import hashlib
import json
import random
from dataclasses import dataclass
from pathlib import Path

TOOLS_PATH = Path(__file__).resolve().parents[3] / 'config' / 'robot_tools.json'
COLOURS = ('red', 'blue', 'green', 'yellow', 'white', 'black')
THINGS = ('cup', 'bottle', 'apple', 'book', 'bowl', 'mug', 'box', 'pen')
SURFACES = ('kitchen table', 'counter', 'sink', 'shelf', 'desk', 'sofa')   # where objects stand
# Training only (--novel-share): colours, things and surfaces the evaluation never names. A scene of them can only
# be answered by reading it (no object-place statistics to lean on), which teaches the look-up itself.
NOVEL_COLOURS = ('orange', 'purple', 'grey', 'pink', 'brown', 'silver', 'golden', 'striped')
NOVEL_THINGS = ('plate', 'spoon', 'phone', 'key', 'ball', 'towel', 'candle', 'glass', 'remote', 'sock')
NOVEL_SURFACES = ('window sill', 'bench', 'stool', 'bed', 'cabinet', 'armchair', 'dresser', 'side table')
HELD_OUT_PERCENT = 10
THINKING_SHARE = 0.3
MAX_REQUESTS = 3          # requests in one training conversation without thinking (the scene stays the same)
MAX_TOKENS = 1000         # a training conversation with follow-up requests stays within a 1,024-token window
OK = {'ok': True}
GREETINGS = ('Hello!', 'Good morning!', 'Dinner is ready.', 'I am on my way.', 'Please wait a moment.',
             'The kitchen is clean.', 'Welcome home!', 'Goodbye!')

# Request phrasings by kind; {x} the object, {a} where it is, {b} where it goes, {t} what to say.
# The phrasing at HELD_OUT_PHRASING[kind] is never trained on.
PHRASINGS = {
    'move': ('Bring the {x} to the {b}.', 'Move the {x} from the {a} to the {b}.', 'Put the {x} on the {b}.',
             'Take the {x} over to the {b}.', 'Could you carry the {x} to the {b}?'),
    'fridge': ('Put the {x} in the fridge.', 'Store the {x} in the fridge.', 'Please put the {x} into the fridge.',
               'The {x} goes in the fridge.'),
    'drawer': ('Put the {x} in the drawer.', 'Store the {x} in the drawer.', 'Please put the {x} into the drawer.',
               'The {x} goes in the drawer.'),
    'bin': ('Throw the {x} away.', 'Throw away the {x}.', 'Put the {x} in the bin.', 'Get rid of the {x}.'),
    'fetch': ('Bring me the {x}.', 'Fetch me the {x}.', 'Can you get me the {x}?', 'I need the {x}, please.'),
    'where': ('Tell me where the {x} is.', 'Where is the {x}?', 'Say where the {x} is.',
              'Do you know where the {x} is?'),
    'say': ('Say "{t}"', 'Tell everyone: "{t}"', 'Please say "{t}"', 'Announce "{t}"'),
    'door': ('Open the door.', 'Please open the door.', 'Close the door.', 'Please close the door.',
             'Shut the door.', 'Could you open the door?'),
}
HELD_OUT_PHRASING = {'move': 4, 'fridge': 3, 'drawer': 3, 'bin': 3, 'fetch': 3, 'where': 3, 'say': 3, 'door': 5}
KIND_WEIGHTS = {'move': 4, 'fridge': 2, 'drawer': 2, 'bin': 2, 'fetch': 2, 'where': 1, 'say': 1, 'door': 1}
# The system turn is the same on every call (a prefix cache keeps it); each user turn opens with the scene as the
# robot sees it now, then the request.
SYSTEM = ('You are the task planner of a mobile robot with an arm. Each request starts with the scene as the robot '
          'sees it. Call the tools one at a time to do what the user asks, then answer in one short sentence.')
USER = 'Scene: {scene}.\n{request}'


@dataclass(frozen=True)
class Conversation:
    messages: list[dict]                 # system, user (scene + request), then the model's calls, results and answer
    tools: list[dict]                    # the OpenAI-style tool list (config/robot_tools.json)
    thinking: bool
    thought: str                         # the thought sentence ('' without thinking)
    calls: list[tuple[str, dict]]        # the expected calls of the first request, in order: (name, arguments)
    answer: str                          # the final sentence of the first request
    text: str                            # the rendered conversation (chat template, thoughts inserted)
    later: tuple = ()                    # training only: further requests on the scene, (request, calls, answer)
    unseen_phrasing: bool = False        # held out: the request's phrasing was never trained on (else only pairs)

    @property
    def prompt_messages(self) -> list[dict]:
        return self.messages[:2]

    @property
    def request(self) -> str:
        """Return the first request, without the scene."""
        return request_of(self.messages[1]['content'])


def robot_tools(path: Path = TOOLS_PATH) -> list[dict]:
    return json.loads(Path(path).read_text())


def objects(novel: bool = False) -> list[str]:
    """Return the objects of the evaluation's scenes, or with novel those with the training-only words too."""
    colours, things = (COLOURS + NOVEL_COLOURS, THINGS + NOVEL_THINGS) if novel else (COLOURS, THINGS)
    return [f'{colour} {thing}' for colour in colours for thing in things]


def is_held_out_pair(thing: str, place: str) -> bool:
    """Tell whether (object, place) is in the fixed held-out share: never anywhere in a training conversation."""
    digest = hashlib.sha256(f'{thing} @ {place}'.encode()).digest()
    return digest[0] * 100 // 256 < HELD_OUT_PERCENT


def _tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(TOOLS_PATH.parents[1] / 'models' / 'tokenizer'))


@dataclass(frozen=True)
class _Draw:
    kind: str
    phrasing: int
    scene: tuple[tuple[str, str], ...]   # (object, surface) pairs
    target: str                          # the object asked about ('' for say and door)
    destination: str                     # move: the surface it goes to; say: the text; else ''

    def pairs(self) -> set[tuple[str, str]]:
        """Every (object, place) combination the conversation shows."""
        shown = set(self.scene)
        if self.kind == 'move':
            shown.add((self.target, self.destination))
        elif self.kind in ('fridge', 'drawer', 'bin'):
            shown.add((self.target, self.kind))
        return shown

    def held_out(self) -> bool:
        return self.phrasing == HELD_OUT_PHRASING[self.kind] or any(is_held_out_pair(*p) for p in self.pairs())


def _random_draw(rng: random.Random, weights: dict[str, float] | None = None, novel: bool = False) -> _Draw:
    weights = weights or KIND_WEIGHTS
    kind = rng.choices(list(weights), weights=list(weights.values()))[0]
    surfaces = SURFACES + NOVEL_SURFACES if novel else SURFACES
    names = rng.sample(objects(novel), rng.randint(2, 5))
    scene = tuple((name, rng.choice(surfaces)) for name in names)
    target, source = scene[rng.randrange(len(scene))]
    destination = ''
    if kind == 'move':
        destination = rng.choice([s for s in surfaces if s != source])
    elif kind == 'say':
        destination, target = rng.choice(GREETINGS), ''
    elif kind == 'door':
        target = ''
    return _Draw(kind, rng.randrange(len(PHRASINGS[kind])), scene, target, destination)


def _follow_up(rng: random.Random, first: _Draw, used: set[str], weights: dict[str, float] | None = None
               ) -> _Draw | None:
    """Another request on first's scene about an object no earlier request touched (None if none is found)."""
    surfaces = SURFACES + NOVEL_SURFACES if any(place in NOVEL_SURFACES or name not in objects()
                                                for name, place in first.scene) else SURFACES
    for _ in range(20):
        draw = _random_draw(rng, weights)
        target, source = first.scene[rng.randrange(len(first.scene))]
        destination = draw.destination
        if draw.kind == 'move':
            destination = rng.choice([s for s in surfaces if s != source])
        draw = _Draw(draw.kind, draw.phrasing, first.scene, target if draw.target else '', destination)
        if (draw.target or draw.kind) not in used and not draw.held_out():
            return draw
    return None


def _door_action(draw: _Draw) -> str:
    return 'open' if 'open' in PHRASINGS['door'][draw.phrasing].lower() else 'close'


def _plan(draw: _Draw) -> tuple[list[tuple[str, dict]], str, str]:
    """Return the calls, final answer and thought of a draw."""
    source = dict(draw.scene).get(draw.target, '')
    x = draw.target
    go_get = [('navigate_to', {'place': source}), ('pick', {'object': x})]
    if draw.kind == 'move':
        b = draw.destination
        return (go_get + [('navigate_to', {'place': b}), ('place', {'object': x, 'place': b})],
                f'Done: the {x} is on the {b}.', f'The {x} is on the {source}; I go there first.')
    if draw.kind in ('fridge', 'drawer'):
        c = draw.kind
        return (go_get + [('navigate_to', {'place': c}), ('open', {'object': c}), ('place', {'object': x, 'place': c}),
                          ('close', {'object': c})],
                f'Done: the {x} is in the {c}.', f'The {x} is on the {source}; I take it to the {c} and open it.')
    if draw.kind == 'bin':
        return (go_get + [('navigate_to', {'place': 'bin'}), ('place', {'object': x, 'place': 'bin'})],
                f'Done: the {x} is in the bin.', f'The {x} is on the {source}; I take it to the bin.')
    if draw.kind == 'fetch':
        return (go_get + [('navigate_to', {'place': 'user'}), ('place', {'object': x, 'place': 'user'})],
                f'Done: here is the {x}.', f'The {x} is on the {source}; I bring it to the user.')
    if draw.kind == 'where':
        return ([('say', {'text': f'The {x} is on the {source}.'})], f'Done: the {x} is on the {source}.',
                f'The {x} is on the {source}; I say so.')
    if draw.kind == 'say':
        return [('say', {'text': draw.destination})], 'Done: I said it.', 'I only need to say it.'
    action = _door_action(draw)
    return ([('navigate_to', {'place': 'door'}), (action, {'object': 'door'})],
            f"Done: the door is {'open' if action == 'open' else 'closed'}.", f'I go to the door and {action} it.')


def scene_listing(scene: tuple[tuple[str, str], ...]) -> str:
    return ', '.join(f'a {name} on the {place}' for name, place in scene) or 'no objects'


def after(draw: _Draw, scene: tuple[tuple[str, str], ...]) -> tuple[tuple[str, str], ...]:
    """Return the scene once draw is done: a moved object stands on its new surface; one put away is gone."""
    if draw.kind == 'move':
        return tuple((name, draw.destination if name == draw.target else place) for name, place in scene)
    if draw.kind in ('fridge', 'drawer', 'bin', 'fetch'):
        return tuple((name, place) for name, place in scene if name != draw.target)
    return scene


def user_text(draw: _Draw, scene: tuple[tuple[str, str], ...]) -> str:
    return USER.format(scene=scene_listing(scene), request=request_text(draw))


def request_of(user_content: str) -> str:
    """Return the request in a user turn (its last line)."""
    return user_content.rsplit('\n', 1)[-1]


def request_text(draw: _Draw) -> str:
    source = dict(draw.scene).get(draw.target, '')
    return PHRASINGS[draw.kind][draw.phrasing].format(x=draw.target, a=source, b=draw.destination,
                                                      t=draw.destination)


def _conversation(draw: _Draw, thinking: bool, tokenizer=None, later: tuple[_Draw, ...] = ()) -> Conversation:
    tools = robot_tools()
    calls, answer, thought = _plan(draw)
    messages, scene = [{'role': 'system', 'content': SYSTEM}], draw.scene
    for request in (draw, *later):
        if request.scene != draw.scene:   # a follow-up with its own scene (fresh_scenes): the robot is elsewhere
            scene = request.scene
        messages.append({'role': 'user', 'content': user_text(request, scene)})
        scene = after(request, scene)
        for name, arguments in _plan(request)[0]:
            messages.append({'role': 'assistant', 'content': '', 'tool_calls': [
                {'type': 'function', 'function': {'name': name, 'arguments': arguments}}]})
            messages.append({'role': 'tool', 'name': name, 'content': dict(OK)})
        messages.append({'role': 'assistant', 'content': _plan(request)[1]})
    tokenizer = tokenizer or _cached_tokenizer()
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, enable_thinking=thinking)
    if thinking:
        opening = '<|turn>model\n'
        at = text.index(opening) + len(opening)
        text = f'{text[:at]}<|channel>thought\n{thought}<channel|>{text[at:]}'
    return Conversation(messages, tools, thinking, thought if thinking else '', calls, answer, text,
                        tuple((request_text(d), *_plan(d)[:2]) for d in later))


_TOKENIZER = []


def _cached_tokenizer():
    if not _TOKENIZER:
        _TOKENIZER.append(_tokenizer())
    return _TOKENIZER[0]


def training_conversation(rng: random.Random, tokenizer=None, weights: dict[str, float] | None = None,
                          novel_share: float = 0.0, requests: int = MAX_REQUESTS,
                          fresh_scenes: bool = False) -> Conversation:
    """
    Draw a conversation with no held-out combination or phrasing; thinking on for ~THINKING_SHARE of them.

    Without thinking, up to `requests` requests follow one another, so the long system turn is shared by more of
    what the model must learn to answer. By default they share the first scene (each about an object no earlier
    one touched) and their number is drawn; with fresh_scenes each has a scene of its own and as many as fit
    MAX_TOKENS come, so every request is another look-up of where its object stands.
    weights: the request kinds' weights (default KIND_WEIGHTS, those of the held-out evaluation); novel_share: the
    share of scenes drawn with the training-only words too (NOVEL_*).
    """
    if requests < 1:
        raise ValueError(f'requests must be at least 1, got {requests}')
    novel = rng.random() < novel_share
    draw = _training_draw(rng, weights, novel)
    thinking = rng.random() < THINKING_SHARE
    later, used = [], {draw.target or draw.kind}
    for _ in range(0 if thinking else requests - 1 if fresh_scenes else rng.randrange(requests)):
        if fresh_scenes:
            later.append(_training_draw(rng, weights, rng.random() < novel_share))
        elif (follow := _follow_up(rng, draw, used, weights)) is not None:
            later.append(follow)
            used.add(follow.target or follow.kind)
        else:
            break
    tokenizer = tokenizer or _cached_tokenizer()
    while True:
        conversation = _conversation(draw, thinking, tokenizer, tuple(later))
        if not later or len(tokenizer(conversation.text, add_special_tokens=False)['input_ids']) <= MAX_TOKENS:
            return conversation
        later.pop()


def _training_draw(rng: random.Random, weights: dict[str, float] | None, novel: bool) -> _Draw:
    while (draw := _random_draw(rng, weights, novel)).held_out():
        pass
    return draw


def held_out_conversation(seed: int, tokenizer=None) -> Conversation:
    """Return the held-out conversation of seed (the same on every run and machine)."""
    rng = random.Random(f'held-out planner {seed}')
    while not (draw := _random_draw(rng)).held_out():
        pass
    conversation = _conversation(draw, rng.random() < THINKING_SHARE, tokenizer)
    return dataclasses.replace(conversation, unseen_phrasing=draw.phrasing == HELD_OUT_PHRASING[draw.kind])


def training_document(conversation: Conversation) -> str:
    """Return the rendered text without its leading <bos> (the token stream adds <bos> and <eos> around documents)."""
    return conversation.text.removeprefix('<bos>')


CHAT_SYSTEMS = ('', 'You are a helpful assistant.', 'Answer briefly.')
CHAT_ASKS = ('Continue this text:\n{head}', 'Go on:\n{head}', '{head}')


def chat_turn(rng: random.Random, texts: list[str], tokenizer=None) -> str:
    """
    Return a chat turn without tools: the user gives the start of a code or prose text and the model goes on with it.

    The planner conversations are the only chat turns the fine-tune sees otherwise; these keep a reply without
    tools a text reply in the style of the base corpus (they are drawn from its training split).
    """
    for _ in range(20):
        text = texts[rng.randrange(len(texts))]
        if len(text) > 400:
            break
    start = rng.randrange(max(len(text) - 1200, 1))
    cut = start + rng.randint(120, 400)
    head, tail = text[start:cut], text[cut:cut + rng.randint(200, 800)]
    system = rng.choice(CHAT_SYSTEMS)
    messages = ([{'role': 'system', 'content': system}] if system else []) + [
        {'role': 'user', 'content': rng.choice(CHAT_ASKS).format(head=head)},
        {'role': 'assistant', 'content': tail}]
    tokenizer = tokenizer or _cached_tokenizer()
    return tokenizer.apply_chat_template(messages, tokenize=False).removeprefix('<bos>')


def parse_kind_weights(text: str) -> dict[str, float]:
    """Read 'where=3,move=4' over KIND_WEIGHTS (the kinds not named keep their weight); ValueError naming the kind."""
    weights = dict(KIND_WEIGHTS)
    for item in filter(None, (part.strip() for part in text.split(','))):
        kind, _, value = item.partition('=')
        if kind not in KIND_WEIGHTS:
            raise ValueError(f'--kind-weights: unknown request kind {kind!r} (kinds: {", ".join(KIND_WEIGHTS)})')
        try:
            weights[kind] = float(value)
        except ValueError:
            raise ValueError(f'--kind-weights: {kind}={value!r} is not a number') from None
        if weights[kind] < 0:
            raise ValueError(f'--kind-weights: {kind} must not be negative')
    if not any(weights.values()):
        raise ValueError('--kind-weights: at least one kind needs a positive weight')
    return weights


def write_corpus(out: Path, conversations: int, seed: int, tokenizer=None, chat_share: float = 0.0,
                 chat_texts: list[str] | None = None, weights: dict[str, float] | None = None,
                 novel_share: float = 0.0, requests: int = MAX_REQUESTS, fresh_scenes: bool = False) -> int:
    """
    Write conversations training conversations as JSONL {"text": ...}; returns the characters written.

    With chat_share, that share of them are chat turns without tools (chat_turn) drawn from chat_texts; weights,
    novel_share, requests and fresh_scenes are training_conversation's.
    """
    if chat_share and not chat_texts:
        raise ValueError('chat_share needs chat_texts to draw the chat turns from')
    rng = random.Random(seed)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    chars = 0
    with out.open('w', encoding='utf-8') as file:
        for _ in range(conversations):
            text = chat_turn(rng, chat_texts, tokenizer) if rng.random() < chat_share else \
                training_document(training_conversation(rng, tokenizer, weights, novel_share, requests, fresh_scenes))
            chars += len(text)
            file.write(json.dumps({'text': text}, ensure_ascii=False) + '\n')
    return chars


# ------------------------------------------------------------------------------------------------- evaluation
def valid_arguments(name: str, arguments, tools: list[dict]) -> bool:
    """Tell whether the call names a tool and its arguments satisfy the tool's JSON schema."""
    import jsonschema

    schema = next((t['function']['parameters'] for t in tools if t['function']['name'] == name), None)
    if schema is None or not isinstance(arguments, dict):
        return False
    try:
        jsonschema.validate(arguments, schema)
    except jsonschema.ValidationError:
        return False
    return True


@dataclass
class PlannerReport:
    conversations: int
    exact_sequences: float        # share of conversations whose whole call sequence is right (names + arguments)
    valid_calls: float            # share of generated calls whose arguments fit the tool's schema
    exact_answers: float          # share of conversations whose final sentence is the expected one
    right_calls: float            # share of expected calls generated at their place in the sequence
    first_calls_right: float      # share of conversations whose first call is right (where to go first)
    calls: int                    # generated calls
    examples: list[dict]          # a few conversations: request, expected and generated calls, answer
    # exact call sequences apart: requests in trained phrasings (unseen object-place combinations only), and
    # requests in a phrasing never trained on; conversations with thinking on and off: (conversations, exact share)
    by_group: dict = dataclasses.field(default_factory=dict)

    def as_dict(self) -> dict:
        return {'conversations': self.conversations, 'exact_sequences': round(self.exact_sequences, 3),
                'exact_by_group': {name: {'conversations': n, 'exact_sequences': round(share, 3)}
                                      for name, (n, share) in self.by_group.items()},
                'valid_calls': round(self.valid_calls, 3), 'exact_answers': round(self.exact_answers, 3),
                'right_calls': round(self.right_calls, 3), 'first_calls_right': round(self.first_calls_right, 3),
                'calls': self.calls, 'examples': self.examples}


def run_planner(model, tokenizer, conversation: Conversation, max_calls: int = 8,
                max_new_tokens: int = 96) -> tuple[list[tuple[str, dict]], str, list[str]]:
    """Greedy planner loop: generate, run each call as {'ok': True}, until a final answer; (calls, answer, segments)."""
    from gemma_spec_ros.train.lm import greedy_continuation  # torch and transformers: only to evaluate

    prompt = tokenizer.apply_chat_template(conversation.prompt_messages, tools=conversation.tools, tokenize=False,
                                           add_generation_prompt=True, enable_thinking=conversation.thinking)
    ids = tokenizer(prompt, add_special_tokens=False)['input_ids']
    stop_ids = tokenizer.convert_tokens_to_ids(['<|tool_response>', '<turn|>', '<eos>'])
    calls, segments, answer = [], [], ''
    for _ in range(max_calls + 1):
        new = greedy_continuation(model, ids, stop_ids, max_new_tokens)
        segment = tokenizer.decode(new, skip_special_tokens=False)
        segments.append(segment)
        parsed = tokenizer.parse_response(segment, prefix='')
        made = [(c['function']['name'], c['function'].get('arguments')) for c in parsed.get('tool_calls') or []]
        calls += made
        if not made or not new or new[-1] != stop_ids[0]:
            answer = (parsed.get('content') or '').strip()
            break
        results = ''.join(f'response:{name}{{ok:true}}<tool_response|>' for name, _ in made)
        ids = ids + new + tokenizer(results, add_special_tokens=False)['input_ids']
    return calls, answer, segments


def evaluate_planner(model, tokenizer, num_conversations: int, max_calls: int = 8, examples: int = 4,
                     progress=None) -> PlannerReport:
    exact = answers = valid = total_calls = right_calls = expected_calls = first_right = 0
    shown, groups = [], {'trained phrasings': [], 'unseen phrasings': [], 'thinking': [], 'no thinking': []}
    for seed in range(num_conversations):
        conversation = held_out_conversation(seed, tokenizer)
        calls, answer, segments = run_planner(model, tokenizer, conversation, max_calls)
        right = [(n, a) for n, a in calls] == conversation.calls
        exact += right
        groups['unseen phrasings' if conversation.unseen_phrasing else 'trained phrasings'].append(right)
        groups['thinking' if conversation.thinking else 'no thinking'].append(right)
        right_calls += sum(got == want for got, want in zip(calls, conversation.calls, strict=False))
        expected_calls += len(conversation.calls)
        first_right += bool(calls) and calls[0] == conversation.calls[0]
        answers += answer == conversation.answer
        total_calls += len(calls)
        valid += sum(valid_arguments(n, a, conversation.tools) for n, a in calls)
        if len(shown) < examples or (not right and len(shown) < 2 * examples):
            shown.append({'request': conversation.request, 'thinking': conversation.thinking,
                          'expected': [[n, a] for n, a in conversation.calls], 'generated': [[n, a] for n, a in calls],
                          'answer': answer, 'right': right})
        if progress:
            request = conversation.request
            progress(f'{seed + 1}/{num_conversations}: {"ok " if right else "bad"} {request} -> {calls} | {answer!r}')
    return PlannerReport(num_conversations, exact / max(num_conversations, 1), valid / max(total_calls, 1),
                         answers / max(num_conversations, 1), right_calls / max(expected_calls, 1),
                         first_right / max(num_conversations, 1), total_calls, shown,
                         {name: (len(rights), sum(rights) / max(len(rights), 1)) for name, rights in groups.items()})
