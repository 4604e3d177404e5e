"""
Every rule about a config and a request, in one place; request planning turns a request into a RequestPlan.

The node, the CLI and the benchmark go through these functions (via Engine.validate and Engine.from_config, or
VllmBackend.validate); no other copy of a rule exists. Imports no torch: the tokenizer is passed in.
"""

import dataclasses
import math
import os
import re
from dataclasses import dataclass

from .conversation import tools as tool_rules
from .conversation.format import ConversationTokens
from .conversation.reply import ReplyRules, reply_rules
from .types import DRAFTERS, REGISTRY, EngineConfig, GenerationRequest, ImageInput, parameter_name

MAX_TEMPERATURE = 2.0
INT64_MAX = 2 ** 63 - 1
CHAT_ROLES = ('system', 'user', 'assistant', 'tool')   # the roles of gemma_spec_msgs/ChatMessage
_TEMPLATE_ROLE = re.compile(r"""message\[['"]role['"]\]\s*==\s*['"](\w+)['"]""")
_CONTENT_MARK = '\ue000{}\ue001'                # private-use characters around a marked string's index
_MARKS = re.compile('\ue000(\\d+)\ue001')
TEXT_ONLY_TARGET = 'the target reads text only (it has no vision tower)'


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings; temperature 0 means greedy."""

    temperature: float = 0.0
    top_k: int = 0      # 0 = off
    top_p: float = 0.0  # 0 = off

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class RequestPlan:
    """A validated request with its prompt tokenized, ready to run."""

    prompt_ids: list[int]
    max_new_tokens: int
    sampling: SamplingParams
    stops: list[str]
    seed: int
    drafter: str
    pinned_k: int        # > 0: fixed K, no adaptation or gating
    compiled_grammar: object | None = None  # the compiled json_schema / grammar (grammar.ConstraintCompiler); None
    images: tuple[ImageInput, ...] = ()     # the images in the order of their placeholder runs in prompt_ids
    reply: ReplyRules = ReplyRules()        # thinking and tool calls
    tools: tuple[tool_rules.ToolSpec, ...] = ()
    compiled_calls: object | None = None    # the compiled grammar of one call's body (tools on)
    output_check: object | None = None      # a json_schema's final check (logits.schema.OutputCheck); None without


def check_config(config: EngineConfig) -> None:
    """Raise ValueError naming the parameter when the config breaks a limit, a choice or a cross-field rule."""
    for field in dataclasses.fields(EngineConfig):
        value, meta, name = getattr(config, field.name), field.metadata, parameter_name(field.name)
        check_parameter(name, value, meta['choices'], meta['limits'])
    spec = REGISTRY[config.drafter]
    if spec.path_field and not getattr(config, spec.path_field):
        raise ValueError('drafter {!r} needs {} (the {} directory)'.format(
            config.drafter, parameter_name(spec.path_field), spec.role))
    check_num_draft_tokens(config.num_draft_tokens, config)
    if config.ngram_min > config.ngram_max:
        raise ValueError('ngram sizes need 1 <= ngram_min <= ngram_max, got {} and {}'.format(
            config.ngram_min, config.ngram_max))
    check_max_new_tokens(config.max_new_tokens, config)
    check_batching(config)
    if config.quantization != 'none' and config.compile == 'transformers':
        raise ValueError("{}={} needs the lean forward; {}=transformers runs transformers' own forward, which "
                         'reads float weights'.format(parameter_name('quantization'), config.quantization,
                                                      parameter_name('compile')))


def check_batching(config: EngineConfig) -> None:
    """engine.max_batch 0 (auto) needs engine.batch_kv_budget_mb and the local engine; the budget needs auto."""
    max_batch, budget = parameter_name('max_batch'), parameter_name('batch_kv_budget_mb')
    if config.max_batch == 0 and config.backend != 'local':
        raise ValueError('{}=0 (as many KV-cache slots as {} holds) is for the local backend; with {}={} it is the '
                         'goals this node sends at once, >= 1'.format(max_batch, budget, parameter_name('backend'),
                                                                       config.backend))
    if config.max_batch == 0 and config.batch_kv_budget_mb <= 0:
        raise ValueError("{}=0 sizes the batch by {}, the MiB of the target's KV cache its slots may take: set it "
                         '(> 0), or set {} >= 1'.format(max_batch, budget, max_batch))
    if config.max_batch != 0 and config.batch_kv_budget_mb > 0:
        raise ValueError('{}={} MiB applies only with {}=0 (slots from the budget); got {}={}'.format(
            budget, config.batch_kv_budget_mb, max_batch, max_batch, config.max_batch))


def slots_within_budget(config: EngineConfig, slot_bytes: int, context_limit: int) -> int:
    """
    Return the batch's KV-cache slots with engine.max_batch 0: as many as engine.batch_kv_budget_mb holds (<= 64).

    slot_bytes: the target's KV cache per slot at context_limit. ValueError when the budget holds fewer than 2.
    """
    most = EngineConfig.__dataclass_fields__['max_batch'].metadata['limits'][1]
    slots = min(most, int(config.batch_kv_budget_mb * 2 ** 20 // slot_bytes))
    if slots < 2:
        raise ValueError('{}={} MiB holds {} KV-cache slot(s) of {:.1f} MiB ({} tokens of context each); a batch '
                         'needs 2: raise it, lower {}, or set {}=1'.format(
                             parameter_name('batch_kv_budget_mb'), config.batch_kv_budget_mb, slots,
                             slot_bytes / 2 ** 20, context_limit, parameter_name('context_limit'),
                             parameter_name('max_batch')))
    return slots


def check_parameter(name: str, value, choices: tuple | None, limits: tuple | None) -> None:
    """Check one parameter: a string among its choices, a number within its limits (min, max)."""
    if choices is not None and value not in choices:
        unknown = 'unknown drafter {!r}: '.format(value) if name == parameter_name('drafter') else ''
        raise ValueError('{}{} must be one of {}, got {!r}'.format(unknown, name, '|'.join(choices), value))
    if limits is not None and not limits[0] <= value <= limits[1]:
        raise ValueError('{} must be between {} and {}, got {}'.format(name, limits[0], limits[1], value))


def check_num_draft_tokens(k: int, config: EngineConfig) -> None:
    if not 0 <= k <= config.max_draft_tokens:
        raise ValueError('num_draft_tokens must be between 0 (adaptive) and max_draft_tokens={}, got {}'.format(
            config.max_draft_tokens, k))


def check_max_new_tokens(max_new_tokens: int, config: EngineConfig) -> None:
    if not 1 <= max_new_tokens <= config.max_new_tokens_limit:
        raise ValueError('max_new_tokens must be between 1 and {} ({}), got {}'.format(
            config.max_new_tokens_limit, parameter_name('max_new_tokens_limit'), max_new_tokens))


def check_drafter(name: str, loaded) -> None:
    """Raise ValueError when drafter name is unknown or its model was not loaded."""
    if name not in DRAFTERS:
        raise ValueError('unknown drafter {!r}; choose one of {}'.format(name, ', '.join(DRAFTERS)))
    if name not in loaded:
        raise ValueError('drafter {!r} is not loaded: set {} to its model directory'.format(
            name, parameter_name(REGISTRY[name].path_field)))


def check_sampling(request: GenerationRequest) -> SamplingParams:
    """Return the request's sampling settings, or raise ValueError naming the field and its range."""
    temperature = float(request.temperature)
    if not math.isfinite(temperature) or not 0.0 <= temperature <= MAX_TEMPERATURE:
        raise ValueError('temperature must be a finite number in [0, {:g}] (0 = greedy), got {}'.format(
            MAX_TEMPERATURE, request.temperature))
    top_p = float(request.top_p)
    if top_p != 0.0 and not (math.isfinite(top_p) and 0.0 < top_p <= 1.0):
        raise ValueError('top_p must be in (0, 1] when set (0 = off), got {}'.format(request.top_p))
    if request.top_k < 0:
        raise ValueError('top_k must be >= 0 (0 = off), got {}'.format(request.top_k))
    return SamplingParams(temperature, int(request.top_k), top_p)


def chat_roles(tokenizer) -> tuple[str, ...]:
    """Return the roles a chat message may have: the interface's roles plus any role the chat template names."""
    named = _TEMPLATE_ROLE.findall(getattr(tokenizer, 'chat_template', None) or '')
    return CHAT_ROLES + tuple(sorted(set(named) - set(CHAT_ROLES)))


def encode_messages(tokenizer, messages: list[dict], images: tuple[ImageInput, ...] = (), vision=None,
                    tools: tuple = (), thinking: bool = False) -> list[int]:
    """
    Render chat messages with the chat template (tools declared, thinking on or off); strings are plain text.

    Special tokens typed in a message, a tool's declaration, a call's arguments or a tool's result (e.g.
    '<turn|>') stay text and cannot open or close turns: the template is rendered around placeholders, its own
    pieces are tokenized with special tokens and each string with split_special_tokens.

    A message's images (indices into images) are rendered as {"type": "image"} content parts before its text part,
    as Gemma4Processor renders them; each image token the template writes becomes that image's placeholder run
    (vision: the target's runtime.VisionTower). tools: conversation.tools.ToolSpec, as parse_tools returns them.
    """
    check_messages(messages)
    if not getattr(tokenizer, 'chat_template', None):
        raise ValueError('the target tokenizer has no chat template; send a prompt instead of messages')
    roles = chat_roles(tokenizer)
    for index, message in enumerate(messages):
        if message['role'] not in roles:
            raise ValueError('messages[{}].role must be one of {}, got {!r}'.format(
                index, ', '.join(roles), message['role']))

    def render(chat, declared=None):
        return tokenizer.apply_chat_template(chat, tools=declared or None, tokenize=False, add_generation_prompt=True,
                                             enable_thinking=thinking)

    trims = ' x ' not in render([{'role': 'user', 'content': ' x '}])
    marks: list[str] = []

    def mark(text: str, trim: bool = False) -> str:
        marks.append(text.strip() if trim else text)
        return _CONTENT_MARK.format(len(marks) - 1)

    def marked(value):
        if isinstance(value, str):
            return mark(value)
        if isinstance(value, dict):
            return {key: marked(item) for key, item in value.items()}
        if isinstance(value, list | tuple):
            return [marked(item) for item in value]
        return value

    def chat_message(message):
        content = mark(str(message['content']), trims)
        shown = message.get('images') or ()
        turn = {'role': message['role'],
                'content': [{'type': 'image'} for _ in shown] + [{'type': 'text', 'text': content}] if shown
                else content}
        if message.get('tool_calls'):
            turn['tool_calls'] = [{'type': 'function', 'function': {
                'name': call['name'], 'arguments': marked(tool_rules.call_arguments(call['arguments']))}}
                for call in message['tool_calls']]
        if message['role'] == 'tool':
            result = tool_rules.tool_result(message['content'])
            turn['content'] = marked(result) if isinstance(result, dict) else mark(result)
            if message.get('name'):
                turn['name'] = message['name']
        return turn

    chat = [chat_message(message) for message in messages]
    declared = [{'type': 'function', 'function': {'name': tool.name, 'description': mark(tool.description),
                                                  'parameters': marked(tool.parameters)}} for tool in tools]
    pieces = _MARKS.split(render(chat, declared))
    runs = _ImageRuns(shown_images(images, messages), vision)
    added = re.compile('|'.join(re.escape(token) for token in sorted(tokenizer.added_tokens_encoder, key=len,
                                                                       reverse=True)))

    def plain(text):
        return tokenizer(text, add_special_tokens=False, split_special_tokens=True).input_ids if text else []

    # the template's text next to a string (after a piece's last added token, before the next one's first) is
    # tokenized with it, as the tokenizer reads the whole rendered text (Gemma4Processor): '\n\nWhich' is not
    # '\n\n' + 'Which'
    ids: list[int] = []
    text = ''
    for position, piece in enumerate(pieces):
        if position % 2:   # a marked string
            text += marks[int(piece)]
            continue
        tokens = list(added.finditer(piece))
        if tokens:
            ids += plain(text + piece[:tokens[0].start()])
            ids += runs.expand(tokenizer(piece[tokens[0].start():tokens[-1].end()], add_special_tokens=False).input_ids)
            text = piece[tokens[-1].end():]
        else:
            text += piece
    ids += plain(text)
    runs.check_all_placed()
    return ids


def shown_images(images: tuple[ImageInput, ...], messages: list[dict] | None) -> tuple[ImageInput, ...]:
    """Return the images in the order the prompt shows them: each message's in its order, or all before a raw prompt."""
    if not messages:
        return tuple(images)
    return tuple(images[index] for message in messages for index in message.get('images') or ())


class _ImageRuns:
    """The image tokens a chat template writes, in order, replaced by the shown images' placeholder runs."""

    def __init__(self, shown: tuple[ImageInput, ...], vision):
        self._shown, self._vision, self._placed = shown, vision, 0

    def expand(self, ids: list[int]) -> list[int]:
        if not self._shown:
            return ids
        expanded = []
        for token in ids:
            if token != self._vision.image_token_id:
                expanded.append(token)
            elif self._placed < len(self._shown):
                expanded += self._vision.placeholder_ids(self._shown[self._placed])
                self._placed += 1
            else:
                raise ValueError("the target's chat template writes more image tokens than the messages show images")
        return expanded

    def check_all_placed(self) -> None:
        if self._placed != len(self._shown):
            raise ValueError("the target's chat template placed {} of the {} images the messages show: it must render "
                             'a message\'s {{"type": "image"}} content parts as the image token'.format(
                                 self._placed, len(self._shown)))


def _images_first(ids: list[int], field: str, images: tuple[ImageInput, ...], vision, bos_id: int | None) -> list[int]:
    """Return a raw prompt's ids with the images' placeholder runs first (after a leading BOS)."""
    if vision is None:
        return ids
    if vision.image_token_id in ids:
        raise ValueError('{} holds the image token (id {}): send the pixels in images, the engine writes their '
                         'placeholders'.format(field, vision.image_token_id))
    head = 1 if ids[:1] == [bos_id] else 0
    return ids[:head] + [token for image in images for token in vision.placeholder_ids(image)] + ids[head:]


def check_prompt_size(request: GenerationRequest, config: EngineConfig) -> None:
    """Raise ValueError when a text prompt or the messages are longer than max_prompt_chars."""
    if request.prompt_ids:
        return
    characters = sum(len(str(m.get('content', ''))) for m in request.messages if isinstance(m, dict)) \
        if request.messages else len(request.prompt)
    characters += len(request.tools) if isinstance(request.tools, str) else 0   # declared in the prompt too
    if characters > config.max_prompt_chars:
        raise ValueError('{} {} characters, more than {} = {}'.format(
            'messages and tools have' if request.tools else 'messages have' if request.messages else 'prompt has',
            characters, parameter_name('max_prompt_chars'), config.max_prompt_chars))


def prompt_ids(request: GenerationRequest, tokenizer, vocab_size: int, config: EngineConfig, vision=None,
               tools: tuple = ()) -> list[int]:
    """
    Tokenize the request's input (prompt_ids, else messages, else prompt) within the size limits.

    vision: the target's runtime.VisionTower (None: text only), which writes each image's placeholder run: where
    the messages show it, or first (after a leading BOS) in a raw prompt or prompt_ids.
    """
    if request.prompt_ids:
        ids = [int(token) for token in request.prompt_ids]
        if any(not 0 <= token < vocab_size for token in ids):
            raise ValueError('prompt_ids must be token ids in [0, {})'.format(vocab_size))
        return _images_first(ids, 'prompt_ids', request.images, vision, tokenizer.bos_token_id)
    check_prompt_size(request, config)
    if request.messages:
        return encode_messages(tokenizer, request.messages, request.images, vision, tools, request.thinking)
    if tools or request.thinking:
        raise ValueError('{}: declared in the chat template\'s system turn, so they need messages, not a raw '
                         'prompt'.format('tools' if tools else 'thinking'))
    if request.prompt:
        return _images_first(tokenizer(request.prompt).input_ids, 'prompt', request.images, vision,
                             tokenizer.bos_token_id)
    raise ValueError('empty request: give a prompt, prompt_ids or chat messages')


def check_messages(messages: list) -> None:
    """
    Check chat turns as every backend does: string role and content, content not empty, tool calls and results.

    An assistant message may carry tool_calls ({name, arguments: JSON object text}; its content may then be
    empty); a tool message answers the next unanswered call of the assistant message before it (its name, when
    given, must be that call's). Roles are the template's.
    """
    unanswered: list[str] = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get('role'), str) \
                or not isinstance(message.get('content'), str):
            raise ValueError('messages[{}] needs string "role" and "content", got {!r}'.format(index, message))
        calls = message.get('tool_calls') or []
        if calls and message['role'] != 'assistant':
            raise ValueError('messages[{}].tool_calls: only an assistant message makes tool calls'.format(index))
        if not message['content'].strip() and not message.get('images') and not calls:
            raise ValueError('messages[{}].content must not be empty (unless the message shows images or makes '
                             'tool calls)'.format(index))
        for number, call in enumerate(calls):
            tool_rules.check_history_call(call, 'messages[{}].tool_calls[{}]'.format(index, number))
        if message['role'] == 'tool':
            if not unanswered:
                raise ValueError('messages[{}]: a tool message answers a tool call, and the assistant message before '
                                 'it has no call left unanswered'.format(index))
            expected = unanswered.pop(0)
            if message.get('name') and message['name'] != expected:
                raise ValueError('messages[{}].name: {!r} answers no call here; the next unanswered call is '
                                 '{!r}'.format(index, message['name'], expected))
        elif message['role'] == 'assistant':
            unanswered = [call['name'] for call in calls]
        else:
            unanswered = []


def check_image_count(count: int, max_images: int, field: str = 'images') -> None:
    """Refuse more images than generation.max_images_per_goal (0 refuses every image)."""
    if count > max_images:
        raise ValueError('{}: {} images, more than {} = {}'.format(
            field, count, parameter_name('max_images_per_goal'), max_images))


def check_image_size(field: str, width: int, height: int, max_pixels: int) -> None:
    """Refuse an empty image, or one of more than generation.max_image_pixels pixels; field names it."""
    if width <= 0 or height <= 0:
        raise ValueError('{}: empty image ({}x{} pixels)'.format(field, width, height))
    if width * height > max_pixels:
        raise ValueError('{}: {}x{} = {} pixels, more than {} = {}'.format(
            field, width, height, width * height, parameter_name('max_image_pixels'), max_pixels))


def check_image_indices(messages: list | None, count: int, key: str = 'images') -> None:
    """
    Check that the messages show each of count images, by indices in range; ValueError naming the field.

    key: what errors call a message's list of indices ('image_indices' for a ROS goal's ChatMessage).
    """
    if count and not messages:
        raise ValueError('images need chat messages that show them (a message\'s {}): a raw prompt cannot place '
                         'them'.format(key))
    shown = set()
    for index, message in enumerate(messages or ()):
        indices = message.get('images', ()) if isinstance(message, dict) else ()
        if not isinstance(indices, list | tuple):
            raise ValueError('messages[{}].{} must be a list of image indices, got {!r}'.format(index, key, indices))
        for position, image in enumerate(indices):
            if isinstance(image, bool) or not isinstance(image, int) or not 0 <= image < count:
                raise ValueError('messages[{}].{}[{}]: {!r} is not an index into the {} image(s)'.format(
                    index, key, position, image, count))
            shown.add(image)
    unshown = sorted(set(range(count)) - shown)
    if unshown:
        raise ValueError('image(s) {} are shown by no message: list them in a message\'s {}'.format(unshown, key))


def check_images(request: GenerationRequest, config: EngineConfig, prompt_takes_images: bool = False) -> None:
    """
    Check a request's images: count, sizes, pixel bytes, and the messages that show them.

    prompt_takes_images: a raw prompt (no messages) may carry images, which go first (the local engine).
    """
    check_image_count(len(request.images), config.max_images_per_goal)
    for index, image in enumerate(request.images):
        field = 'images[{}]'.format(index)
        check_image_size(field, image.width, image.height, config.max_image_pixels)
        if len(image.rgb) != 3 * image.width * image.height:
            raise ValueError('{}.rgb: {} bytes, expected 3 x {} x {} = {}'.format(
                field, len(image.rgb), image.width, image.height, 3 * image.width * image.height))
    if request.messages or not prompt_takes_images:
        check_image_indices(request.messages, len(request.images))


def check_fields(request: GenerationRequest, config: EngineConfig) -> SamplingParams:
    """Check the fields every backend checks alike (stop strings, sampling, seed); return the sampling settings."""
    if len(request.stop) > config.max_stop_strings:
        raise ValueError('request has {} stop strings, more than {} = {}'.format(
            len(request.stop), parameter_name('max_stop_strings'), config.max_stop_strings))
    if any(not stop for stop in request.stop):
        raise ValueError('stop strings must not be empty')
    sampling = check_sampling(request)
    if not -1 <= request.seed <= INT64_MAX:
        raise ValueError('seed must be between 0 and {} (int64), or -1 for a random seed, got {}'.format(
            INT64_MAX, request.seed))
    return sampling


def plan_request(request: GenerationRequest, tokenizer, vocab_size: int, context_limit: int, config: EngineConfig,
                 loaded_drafters, default_drafter: str, default_k: int, constraints, vision=None) -> RequestPlan:
    """
    Validate a request, tokenize its prompt and compile its constraint; ValueError with a planner-readable message.

    constraints: the engine's grammar.ConstraintCompiler, vision its target's runtime.VisionTower (None: the target
    reads text only); passed in, so that this module imports no torch.
    """
    sampling = check_fields(request, config)
    if request.images and vision is None:
        raise ValueError('images: {}'.format(TEXT_ONLY_TARGET))
    check_images(request, config, prompt_takes_images=True)
    drafter = request.drafter or default_drafter
    check_drafter(drafter, loaded_drafters)
    check_num_draft_tokens(request.num_draft_tokens, config)
    tools, reply = reply_rules(request, ConversationTokens.of(tokenizer.get_vocab()))
    ids = prompt_ids(request, tokenizer, vocab_size, config, vision, tools)
    max_new = request.max_new_tokens or config.max_new_tokens
    if request.max_new_tokens:
        check_max_new_tokens(request.max_new_tokens, config)
    if len(ids) + max_new > context_limit:
        raise ValueError('prompt ({} tokens) + max_new_tokens ({}) exceeds the context limit of {} tokens ({}, at '
                         'most the model context); shorten the prompt or lower max_new_tokens'.format(
                             len(ids), max_new, context_limit, parameter_name('context_limit')))
    pinned = request.num_draft_tokens or default_k
    seed = request.seed if request.seed >= 0 else int.from_bytes(os.urandom(4), 'little')
    if request.seed >= 0 and not sampling.greedy and not pinned:
        # adaptive K follows measured timings, which would change the random draws: pin K so that the same
        # seed reproduces the same output
        pinned = max(1, config.max_draft_tokens // 2)
    compiled = constraints.compile_request(request.json_schema, request.grammar,  # cached per text
                                           request.json_free_whitespace, request.json_schema_unenforced,
                                           number_digits(config))
    calls = constraints.compile_calls(tools, reply.forced_tool) if reply.calls else None
    return RequestPlan(ids, max_new, sampling, list(request.stop), seed, drafter, pinned, compiled,
                       shown_images(request.images, request.messages), reply, tools, calls,
                       constraints.output_check(request.json_schema, request.json_schema_unenforced))


def number_digits(config: EngineConfig) -> tuple[int, int]:
    """Return the most digits of a JSON number's integer part and fraction in json_schema output (0: unbounded)."""
    return config.json_integer_digits, config.json_fraction_digits
