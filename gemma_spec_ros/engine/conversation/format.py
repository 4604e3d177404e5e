r"""
Gemma 4's control tokens, found by their text in a checkpoint's tokenizer (never by a fixed id).

    <|turn>system\n<|think>You are a planner.<turn|>\n          a system turn; <|think> switches thinking on
    <|tool>declaration:pick{...}<tool|>                         a tool's declaration (in the system turn)
    <|turn>user\nBring the cup.<turn|>\n
    <|turn>model\n<|channel>thought\n...<channel|>              thoughts, apart from the answer
    <|tool_call>call:pick{object:<|"|>cup<|"|>}<tool_call|>     a call; several may follow one another
    <|tool_response>response:pick{ok:true}<tool_response|>      its result, written into the same model turn
    The cup is at the sink.<turn|>

A reply ends with <turn|> (or <eos>), or with <|tool_response> after its calls: the planner runs them and sends
their results back.
"""

from dataclasses import dataclass

TURN_OPEN, TURN_CLOSE = '<|turn>', '<turn|>'
THINK = '<|think>'
CHANNEL_OPEN, CHANNEL_CLOSE = '<|channel>', '<channel|>'
TOOL_OPEN, TOOL_CLOSE = '<|tool>', '<tool|>'
CALL_OPEN, CALL_CLOSE = '<|tool_call>', '<tool_call|>'
RESPONSE_OPEN, RESPONSE_CLOSE = '<|tool_response>', '<tool_response|>'
QUOTE = '<|"|>'
IMAGE_OPEN, IMAGE_CLOSE, IMAGE = '<|image>', '<image|>', '<|image|>'
THOUGHT_LABEL = 'thought\n'   # what the model writes right after <|channel>, before its thoughts
# The tokens of the conversation's structure: never part of an answer's text (images are placed by the engine).
CONTROL_TOKENS = (TURN_OPEN, TURN_CLOSE, THINK, CHANNEL_OPEN, CHANNEL_CLOSE, TOOL_OPEN, TOOL_CLOSE, CALL_OPEN,
                  CALL_CLOSE, RESPONSE_OPEN, RESPONSE_CLOSE, QUOTE)


@dataclass(frozen=True)
class ConversationTokens:
    """A checkpoint's ids of Gemma 4's control tokens; an id is None where its tokenizer lacks the token."""

    turn_close: int | None
    channel_open: int | None
    channel_close: int | None
    call_open: int | None
    call_close: int | None
    response_open: int | None
    quote: int | None
    control: frozenset[int]   # every control token the tokenizer has

    @classmethod
    def of(cls, vocab: dict[str, int]) -> 'ConversationTokens':
        """Read the ids from a tokenizer's vocabulary (tokenizer.get_vocab())."""
        return cls(vocab.get(TURN_CLOSE), vocab.get(CHANNEL_OPEN), vocab.get(CHANNEL_CLOSE), vocab.get(CALL_OPEN),
                   vocab.get(CALL_CLOSE), vocab.get(RESPONSE_OPEN), vocab.get(QUOTE),
                   frozenset(vocab[token] for token in CONTROL_TOKENS if token in vocab))

    @property
    def thinking(self) -> bool:
        """The tokenizer can write a thought channel."""
        return self.channel_open is not None and self.channel_close is not None

    @property
    def tools(self) -> bool:
        """The tokenizer can write tool calls and ask for their results."""
        return None not in (self.call_open, self.call_close, self.response_open, self.quote)
