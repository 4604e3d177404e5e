"""
A request's prompt as token ids, and the rules of chat messages.

Chat messages are rendered with the target's chat template (tools declared, thinking on or off, images as their
placeholder runs); a raw prompt or prompt_ids are taken as they are.

Imports no torch: the tokenizer and the target's vision tower are passed in.
"""

import re
import threading

from ..types import GenerationRequest, ImageInput
from . import tools as tool_rules

# A fast tokenizer keeps split_special_tokens as a flag of its backend, which every call sets: two goals validated at
# once (the node's executor threads) could tokenize a message's text with special tokens live, or the template's
# image token as text. Every call here sets the flag it needs under this lock.
TOKENIZER_LOCK = threading.Lock()


def encode(tokenizer, text: str, split_special_tokens: bool, add_special_tokens: bool = False) -> list[int]:
    """Token ids of text: special tokens typed in it stay text (split_special_tokens) or are the tokens."""
    with TOKENIZER_LOCK:
        return tokenizer(text, add_special_tokens=add_special_tokens,
                         split_special_tokens=split_special_tokens).input_ids

CHAT_ROLES = ('system', 'user', 'assistant', 'tool')   # the roles of gemma_spec_msgs/ChatMessage
_TEMPLATE_ROLE = re.compile(r"""message\[['"]role['"]\]\s*==\s*['"](\w+)['"]""")
_CONTENT_MARK = '\ue000{}\ue001'                # private-use characters around a marked string's index
_MARKS = re.compile('\ue000(\\d+)\ue001')


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
        return encode(tokenizer, text, split_special_tokens=True) if text else []

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
            ids += runs.expand(encode(tokenizer, piece[tokens[0].start():tokens[-1].end()], split_special_tokens=False))
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


def prompt_ids(request: GenerationRequest, tokenizer, vocab_size: int, vision=None, tools: tuple = ()) -> list[int]:
    """
    Tokenize the request's input (prompt_ids, else messages, else prompt); requests.check_prompt_size bounds it first.

    vision: the target's runtime.VisionTower (None: text only), which writes each image's placeholder run: where
    the messages show it, or first (after a leading BOS) in a raw prompt or prompt_ids.
    """
    if request.prompt_ids:
        ids = [int(token) for token in request.prompt_ids]
        if any(not 0 <= token < vocab_size for token in ids):
            raise ValueError('prompt_ids must be token ids in [0, {})'.format(vocab_size))
        return _images_first(ids, 'prompt_ids', request.images, vision, tokenizer.bos_token_id)
    if request.messages:
        return encode_messages(tokenizer, request.messages, request.images, vision, tools, request.thinking)
    if tools or request.thinking:
        raise ValueError('{}: declared in the chat template\'s system turn, so they need messages, not a raw '
                         'prompt'.format('tools' if tools else 'thinking'))
    if request.prompt:
        raw = encode(tokenizer, request.prompt, split_special_tokens=False, add_special_tokens=True)
        return _images_first(raw, 'prompt', request.images, vision,
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
