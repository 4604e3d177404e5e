"""
Tools and thinking on the vLLM backend: the chat request's fields, the reply grammar, and the calls of the stream.

A server started with Gemma 4's parsers (vllm_server.GEMMA4_PARSER_ARGS; the backend's vllm.parsers says so) splits
the reply as it streams: thoughts come as ``delta.reasoning``, calls as ``delta.tool_calls`` (a name, then JSON text
of the arguments in pieces). What vLLM 0.32's gemma4 parser does not do is hold the reply to the request: it parses
what the model writes, and a required or named tool_choice is not enforced (the parser's
``supports_required_and_named`` is False), nor are the arguments' schemas. So every goal with tools or thinking also
carries a grammar of its whole reply (``structured_outputs.grammar``, xgrammar's EBNF, the control tokens written as
``Token(id)``), the shape the local engine enforces (logits/reply.py):

    thought   (thinking on) <|channel>, ordinary tokens (at most max_thinking_tokens), <channel|>
    answer    ordinary tokens (tool_choice none or auto), or nothing (required or a tool's name)
    calls     (auto: may, required or a name: must) <|tool_call> call:NAME{...} <tool_call|>, several unless
              parallel_tool_calls is off; a call's body is conversation.tool_grammar.call_grammar's, arguments
              valid under the tool's schema

Two differences remain. The grammar cannot demand <|tool_response> after the calls: vLLM hands xgrammar every stop
token of the model (<|tool_response> is one) as an end, allowed only where the grammar is complete, so the reply may
end its calls with <turn|> or <eos> too; the backend counts its calls either way. And a string in a call cannot
hold '<' (the server's parser reads the reply as text, where '<' could start a control token's spelling).

Stdlib only; the control tokens' ids are learnt from the server (/tokenize), once.
"""

import json
import re
from collections.abc import Callable
from dataclasses import dataclass

from ..conversation import tools as tool_rules
from ..conversation.format import CONTROL_TOKENS, ConversationTokens
from ..conversation.reply import ReplyRules, reply_rules
from ..conversation.syntax import QUOTE_CHAR, call_arguments
from ..conversation.tool_grammar import call_grammar
from ..types import GenerationRequest, GenerationWarning, ToolCall, WarningKind, structure_incomplete

PARSERS = ('', 'gemma4')
PARSER_ARGS = ("--enable-auto-tool-choice --tool-call-parser gemma4 --reasoning-parser gemma4 "
               "--structured-outputs-config '{\"enable_in_reasoning\": true}'")
# check_reply's stand-in for the served model's control tokens: a Gemma 4 model has them all (their ids are learnt
# from the server when a goal needs them, and checked again then)
_GEMMA4_TOKENS = ConversationTokens(*range(1, 8), frozenset())
# the texts of Gemma 4's special tokens: no free text (thoughts, an answer) holds them; those that are not one token
# of the served model's vocabulary are skipped
SPECIAL_TEXTS = ('<pad>', '<eos>', '<bos>', '<unk>', '<mask>', '<|image>', '<image|>', '<|image|>', '<|audio>',
                 '<audio|>', '<|audio|>', '<|video>', '<video|>', '<|video|>') + CONTROL_TOKENS
# the quote token in tool_grammar.call_grammar's EBNF (an escape inside a string literal), and its string characters
_GRAMMAR_QUOTE = '\\u{:04x}'.format(ord(QUOTE_CHAR))
_PRIVATE_USE_RANGE = '\\ue000-\\ue0ff'   # in the class of a string's characters (which keeps the quote out)
_LEXEME = re.compile(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]')
_ESCAPE = re.compile(r'\\u[0-9a-fA-F]{4}|\\U[0-9a-fA-F]{8}|\\.|[^\\]', re.DOTALL)


@dataclass(frozen=True)
class ServerTokens:
    """The served model's ids of Gemma 4's control tokens, and of every special token (none in free text)."""

    conversation: ConversationTokens
    special: tuple[int, ...]

    @classmethod
    def learn(cls, tokenize: Callable[[str], list[int]]) -> 'ServerTokens':
        """Ask the server's tokenizer (tokenize: text -> ids, no BOS) for each special token's id."""
        ids = tokenize(''.join(SPECIAL_TEXTS))
        if len(ids) == len(SPECIAL_TEXTS):
            found = dict(zip(SPECIAL_TEXTS, ids, strict=True))
        else:   # some text is not one token: one at a time
            found = {text: pieces[0] for text in SPECIAL_TEXTS if len(pieces := tokenize(text)) == 1}
        return cls(ConversationTokens.of(found), tuple(sorted(set(found.values()))))


def check_reply(request: GenerationRequest, parsers: str, url: str) -> tuple[tuple, ReplyRules | None]:
    """
    Check tools, tool_choice, parallel_tool_calls, thinking and max_thinking_tokens; ValueError names the field.

    The request rules are the local engine's (conversation.reply.reply_rules: the same refusals, word for word);
    then what the vllm backend cannot do: a goal that declares tools or thinks needs chat messages (the server's chat
    template declares them) and a server at url with Gemma 4's parsers (parsers: vllm.parsers). Returns the tools
    and the reply's rules (None when the goal has neither tools nor thinking).
    """
    tools, rules = reply_rules(request, _GEMMA4_TOKENS)
    if not tools and not rules.thinking:
        return tools, None
    field = 'tools' if tools else 'thinking'
    if not request.messages:
        if request.prompt_ids:
            raise ValueError('{}: the vllm backend declares them through the chat API, which needs messages, not '
                             'prompt_ids'.format(field))
        raise ValueError("{}: declared in the chat template's system turn, so they need messages, not a raw "
                         'prompt'.format(field))
    if not parsers:
        raise ValueError("{}: vllm.parsers is '': the vLLM server at {} is taken to run without Gemma 4's tool-call "
                         'and reasoning parsers (start it with {} and set vllm.parsers gemma4)'.format(
                             field, url, PARSER_ARGS))
    if rules.thinking and (request.json_schema or request.grammar):
        raise ValueError('thinking: the vllm backend cannot combine the thought channel with a {} (the server takes '
                         'one grammar for the whole reply); send it without thinking'.format(
                             'json_schema' if request.json_schema else 'grammar'))
    return tools, rules


def shape_reply(body: dict, request: GenerationRequest, tools: tuple, rules: ReplyRules, tokens: ServerTokens,
                constrained: bool) -> None:
    """
    Add a goal's tools and thinking to its chat body: the fields, and the grammar of its whole reply.

    constrained: the body already has the goal's json_schema / grammar (tool_choice none, no thinking), which then
    shapes the answer alone. ValueError when the served model's tokenizer cannot write them.
    """
    reply_rules(request, tokens.conversation)
    if tools:
        body.update(tools=openai_tools(tools), tool_choice=openai_tool_choice(rules),
                    parallel_tool_calls=rules.parallel_calls)
    # the parsers read the control tokens in the text; the template declares the tools and thinking
    body.update(chat_template_kwargs={'enable_thinking': rules.thinking}, skip_special_tokens=False)
    if not constrained:
        body['structured_outputs'] = {'grammar': reply_grammar(rules, tools, tokens)}


def reply_finish_reason(collected, rules: ReplyRules | None) -> str:
    """
    Return tool_calls when the reply ended after calls it may make; else the server's reason (its tool_calls: stop).

    collected: the stream (vllm_stream.Collected). The server says tool_calls for calls under tool_choice auto or
    required and stop for a named tool; the reply grammar ends a reply after its calls with any stop token.
    """
    reason = collected.finish_reason
    if reason in ('stop', 'tool_calls') and not collected.stop_string and collected.calls.calls and \
            rules is not None and rules.calls:
        return 'tool_calls'
    return 'stop' if reason == 'tool_calls' else reason


def cut_off_warnings(finish_reason: str, rules: ReplyRules | None, max_new_tokens: int) -> list[GenerationWarning]:
    """Return the local engine's warning when max_new_tokens cut a reply that may make calls; else none."""
    if finish_reason != 'length' or rules is None or not rules.calls:
        return []
    return [structure_incomplete(max_new_tokens)]


def openai_tools(tools: tuple[tool_rules.ToolSpec, ...]) -> list[dict]:
    """Return the tools in OpenAI's wrapper shape, as vLLM passes them to the chat template."""
    return [{'type': 'function', 'function': {'name': tool.name, 'description': tool.description,
                                              'parameters': tool.parameters}} for tool in tools]


def openai_tool_choice(rules: ReplyRules) -> str | dict:
    """tool_choice as the chat API takes it: 'none', 'auto', 'required' or the named function."""
    if rules.forced_tool:
        return {'type': 'function', 'function': {'name': rules.forced_tool}}
    return rules.tool_choice


def chat_messages(messages: list[dict], content: Callable[[dict], object]) -> list[dict]:
    """
    Return the messages in the chat API's shape (content(message) gives each one's content).

    An assistant message's calls become OpenAI tool calls, id 'call_<index>' unless the call has one, arguments as
    JSON text; a tool message answers the next unanswered call of the assistant message before it (requests.
    check_messages checked that there is one) and carries its tool_call_id and name.
    """
    chat, unanswered = [], []
    for message in messages:
        turn = {'role': message['role'], 'content': content(message)}
        calls = message.get('tool_calls') or []
        if message['role'] == 'assistant':
            if calls:
                turn['tool_calls'] = [{'id': call.get('id') or 'call_{}'.format(index), 'type': 'function',
                                       'function': {'name': call['name'], 'arguments': json.dumps(
                                           call_arguments(call.get('arguments', '')),
                                           ensure_ascii=False)}} for index, call in enumerate(calls)]
            unanswered = [(call['id'], call['function']['name']) for call in turn.get('tool_calls', ())]
        elif message['role'] == 'tool' and unanswered:
            call_id, name = unanswered.pop(0)
            turn['tool_call_id'], turn['name'] = call_id, message.get('name') or name
        elif message['role'] != 'tool':
            unanswered = []
        chat.append(turn)
    return chat


def reply_grammar(rules: ReplyRules, tools: tuple[tool_rules.ToolSpec, ...], tokens: ServerTokens) -> str:
    """Return the EBNF of a whole reply under rules (see the module's notes); ValueError 'tools: ...'."""
    conversation = tokens.conversation
    lines, parts = [], []
    if rules.thinking:
        budget = '{{0,{}}}'.format(rules.thinking_budget) if rules.thinking_budget else '*'
        parts.append('Token({}) reply_text{} Token({})'.format(conversation.channel_open, budget,
                                                                conversation.channel_close))
    if rules.tool_choice == 'required':
        parts.append('reply_calls')
    elif rules.calls:
        parts.append('reply_text* reply_calls?')
    else:
        parts.append('reply_text*')
    lines.append('root ::= ' + ' '.join(parts))
    if rules.thinking or rules.tool_choice != 'required':
        lines.append('reply_text ::= ExcludeToken({})'.format(', '.join(str(token) for token in tokens.special)))
    if rules.calls:
        lines.append('reply_calls ::= reply_call' + ('+' if rules.parallel_calls else ''))
        lines.append('reply_call ::= Token({}) reply_body Token({})'.format(conversation.call_open,
                                                                           conversation.call_close))
        lines.append(_server_call_grammar(call_grammar(tools, (rules.forced_tool,) if rules.forced_tool else None),
                                          conversation.quote))
    return '\n'.join(lines) + '\n'


def _server_call_grammar(text: str, quote: int) -> str:
    """tool_grammar.call_grammar's text for the server: root renamed reply_body, the quote character its Token(id)."""
    if not text.startswith('root ::= '):
        raise ValueError('tools: the tool-call grammar does not start with its root rule')
    text = 'reply_body ::= ' + text[len('root ::= '):]

    def server(match: re.Match) -> str:
        lexeme = match.group()
        if lexeme.startswith('['):
            # a string's characters: not '<' either
            return '[^<' + lexeme[2:] if lexeme.startswith('[^') and _PRIVATE_USE_RANGE in lexeme.lower() else lexeme
        pieces, current = [], ''
        for unit in _ESCAPE.findall(lexeme[1:-1]):
            if unit.lower() == _GRAMMAR_QUOTE:
                pieces += ['"{}"'.format(current)] if current else []
                pieces.append('Token({})'.format(quote))
                current = ''
            else:
                current += unit
        if not any(piece.startswith('Token(') for piece in pieces):
            return lexeme
        pieces += ['"{}"'.format(current)] if current else []
        return '({})'.format(' '.join(pieces))

    converted = _LEXEME.sub(server, text)
    if _GRAMMAR_QUOTE in converted.lower():
        raise ValueError('tools: the tool-call grammar writes the quote token where the vLLM grammar cannot take it')
    return converted.rstrip('\n')


class CallReader:
    """
    Assembles a stream's ``delta.tool_calls`` into ToolCalls.

    A call is complete when the next one begins, or when the reply ends (finished). Ids are 'call_<index>' as the
    local engine gives them (the server's own ids are random); arguments are JSON text, compact, checked against
    the tool's schema.
    """

    def __init__(self, tools: tuple[tool_rules.ToolSpec, ...]):
        self._tools = {tool.name: tool for tool in tools}
        self._calls: list[dict] = []    # per server index: name, argument pieces
        self._read = 0                   # calls taken so far
        self.calls: list[ToolCall] = []
        self.warnings: list[GenerationWarning] = []

    def add(self, pieces: list[dict], finished: bool) -> list[ToolCall]:
        """Take a chunk's delta.tool_calls; return the calls it completed (finished: the reply ended here)."""
        for piece in pieces:
            index = piece.get('index', len(self._calls))
            while len(self._calls) <= index:
                self._calls.append({'name': '', 'arguments': []})
            function = piece.get('function') or {}
            self._calls[index]['name'] += function.get('name') or ''
            self._calls[index]['arguments'].append(function.get('arguments') or '')
        ready = len(self._calls) if finished else len(self._calls) - 1
        completed = []
        while self._read < ready:
            call = self._call(self._calls[self._read])
            self._read += 1
            if call is not None:
                completed.append(call)
                self.calls.append(call)
        return completed

    def _call(self, raw: dict) -> ToolCall | None:
        name, text = raw['name'], ''.join(raw['arguments'])
        try:
            if name not in self._tools:
                raise ValueError('unknown tool "{}" (tools: {})'.format(name, ', '.join(self._tools) or 'none'))
            arguments = json.loads(text or '{}')
            if not isinstance(arguments, dict):
                raise ValueError('arguments {} are not an object'.format(text))
            tool_rules.validate_arguments(self._tools[name], arguments)
        except ValueError as exc:   # json.JSONDecodeError too
            self.warnings.append(GenerationWarning(WarningKind.DROPPED_TOOL_CALL,
                                                   'dropped a tool call the server parsed ({})'.format(exc)))
            return None
        return ToolCall('call_{}'.format(len(self.calls)), name,
                        json.dumps(arguments, separators=(',', ':'), ensure_ascii=False))
