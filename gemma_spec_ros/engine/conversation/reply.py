"""
What a request asks of its reply (ReplyRules), and a reply's tokens split into its parts as they stream.

A reply is, in order: thoughts in a channel (thinking on), the answer's text, then tool calls, each between
<|tool_call> and <tool_call|>. The control tokens around the parts are dropped; the parts' own tokens are kept.
"""

from dataclasses import dataclass, field

from ..types import GenerationRequest
from . import tools
from .format import ConversationTokens

TEXT, THOUGHT, CALL = 'text', 'thought', 'call'
INT64_MAX = 2 ** 63 - 1


@dataclass(frozen=True)
class ReplyRules:
    """The shape a request allows its reply: thinking and its budget, and tool calls (tool_choice)."""

    thinking: bool = False
    thinking_budget: int = 0        # thought tokens before the channel is forced closed; 0 = no budget
    tool_choice: str = 'none'       # none|auto|required (a tool's name is 'required' with one tool's grammar)
    forced_tool: str = ''           # the tool every call must name ('' = any declared tool)
    parallel_calls: bool = True     # False: one call, then the reply asks for its result
    chat: bool = False              # a reply in a chat turn: without declared tools it never calls one
    resumes: bool = False           # the reply goes on with the model's turn after its calls' results: with
                                    # thinking on it may think again but need not (the turn began with its thoughts)

    @property
    def calls(self) -> bool:
        return self.tool_choice != 'none'


@dataclass
class ReplyPart:
    """A run of a reply's tokens of one kind: text or thought pieces, or a whole call's body."""

    kind: str          # TEXT, THOUGHT or CALL
    ids: list[int] = field(default_factory=list)


class ReplySplitter:
    """
    Splits a reply's token ids, round by round, into text, thought and call parts.

    A call's part comes out whole, once its <tool_call|> arrives. Stop tokens are not passed in (the engine cuts
    them off before).
    """

    def __init__(self, tokens: ConversationTokens):
        self._tokens = tokens
        self._kind = TEXT
        self._call: list[int] = []

    @property
    def in_call(self) -> bool:
        """A call was opened and not closed yet."""
        return self._kind == CALL

    def feed(self, ids: list[int]) -> list[ReplyPart]:
        """Return the parts of ids, in order (consecutive ids of one kind in one part)."""
        tokens, parts = self._tokens, []
        for token in ids:
            if token == tokens.channel_open and self._kind == TEXT:
                self._kind = THOUGHT
            elif token == tokens.channel_close and self._kind == THOUGHT:
                self._kind = TEXT
            elif token == tokens.call_open and self._kind != CALL:
                self._kind, self._call = CALL, []
            elif token == tokens.call_close and self._kind == CALL:
                parts.append(ReplyPart(CALL, self._call))
                self._kind, self._call = TEXT, []
            elif self._kind == CALL:
                self._call.append(token)
            elif token not in tokens.control:
                if not parts or parts[-1].kind != self._kind:
                    parts.append(ReplyPart(self._kind))
                parts[-1].ids.append(token)
        return parts


def reply_rules(request: GenerationRequest, tokens: ConversationTokens) -> tuple[tuple, ReplyRules]:
    """
    Check a request's tools, tool_choice and thinking against what the checkpoint's tokenizer can write.

    Returns the parsed tools (conversation.tools.ToolSpec) and the reply's rules; ValueError names the field.
    """
    if not isinstance(request.thinking, bool):
        raise ValueError('thinking must be a bool, got {!r}'.format(request.thinking))
    budget = request.max_thinking_tokens
    if isinstance(budget, bool) or not isinstance(budget, int) or not 0 <= budget <= INT64_MAX:
        raise ValueError('max_thinking_tokens must be an integer >= 0 (0 = no budget), got {!r}'.format(budget))
    if budget and not request.thinking:
        raise ValueError('max_thinking_tokens applies with thinking on; set thinking or leave it 0')
    if request.thinking and not tokens.thinking:
        raise ValueError("thinking: the target's tokenizer has no thought channel (<|channel>, <channel|>)")
    declared = tools.parse_tools(request.tools)
    choice = tools.check_tool_choice(request.tool_choice, declared)
    if declared and not tokens.tools:
        raise ValueError("tools: the target's tokenizer cannot write Gemma 4 tool calls (<|tool_call>, <tool_call|>, "
                         '<|"|>, <|tool_response>)')
    if choice != 'none' and (request.json_schema or request.grammar):
        raise ValueError('{} constrains the answer\'s text, which tool_choice {!r} may replace by calls: set '
                         'tool_choice none to use both'.format('json_schema' if request.json_schema else 'grammar',
                                                               choice))
    if not isinstance(request.parallel_tool_calls, bool):
        raise ValueError('parallel_tool_calls must be a bool, got {!r}'.format(request.parallel_tool_calls))
    forced = '' if choice in ('auto', 'none', 'required') else choice
    resumes = bool(request.messages) and isinstance(request.messages[-1], dict) and \
        request.messages[-1].get('role') == 'tool'
    rules = ReplyRules(request.thinking, budget, 'required' if forced else choice, forced, request.parallel_tool_calls,
                       bool(request.messages), resumes)
    return declared, rules
