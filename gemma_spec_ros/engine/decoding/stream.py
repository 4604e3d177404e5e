"""Incremental detokenization, stop strings and a reply's parts (text, thoughts, tool calls) for streaming."""

from transformers import PreTrainedTokenizerFast

from ..conversation import tools as tool_rules
from ..conversation.format import THOUGHT_LABEL, ConversationTokens
from ..conversation.reply import TEXT, THOUGHT, ReplySplitter
from ..types import GenerationWarning, ToolCall, WarningKind


class IncrementalDetokenizer:
    """
    Turns token ids into text round by round; never emits a broken UTF-8 sequence.

    Decodes only a short window (the tokens since the previous emit point), so the work per round does not grow
    with the output length. Text ending in U+FFFD (an incomplete multi-byte sequence) is held until it completes.
    """

    def __init__(self, tokenizer):
        # a fast tokenizer's decode without clean-up is its Rust tokenizer's: called directly, it costs a fifth
        # (two calls a round)
        self._backend = tokenizer.backend_tokenizer if isinstance(tokenizer, PreTrainedTokenizerFast) else None
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._prefix = 0   # window start: text before it has been emitted
        self._read = 0     # tokens up to here have been emitted

    def _decode(self, ids: list[int]) -> str:
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=True)
        return self._tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def add(self, token_ids: list[int]) -> str:
        """Append token_ids and return the newly completed text."""
        self._ids.extend(token_ids)
        emitted = self._decode(self._ids[self._prefix:self._read])
        window = self._decode(self._ids[self._prefix:])
        if len(window) <= len(emitted) or window.endswith('\ufffd'):
            return ''
        self._prefix, self._read = self._read, len(self._ids)
        return window[len(emitted):]

    def flush(self) -> str:
        """Whatever is still held back (possibly incomplete) at the end of generation."""
        emitted = self._decode(self._ids[self._prefix:self._read])
        window = self._decode(self._ids[self._prefix:])
        self._prefix = self._read = len(self._ids)
        return window[len(emitted):]


class StopStrings:
    """
    Cuts the text before the first stop string, even when a match spans round boundaries.

    Text that could still be the start of a stop string is held back until it is decided.
    """

    def __init__(self, stops: list[str]):
        self._stops = list(stops)
        self._held = ''
        self.stopped = False

    def feed(self, text: str) -> str:
        """Text that is safe to emit; sets stopped when a stop string matched (the match is not emitted)."""
        if not self._stops:
            return text
        buffer = self._held + text
        matches = [index for index in (buffer.find(stop) for stop in self._stops) if index >= 0]
        if matches:
            self.stopped = True
            self._held = ''
            return buffer[:min(matches)]
        hold = self._longest_stop_prefix_suffix(buffer)
        self._held = buffer[len(buffer) - hold:] if hold else ''
        return buffer[:len(buffer) - hold]

    def flush(self) -> str:
        """Release held text at the end of generation (no stop string completed)."""
        held, self._held = self._held, ''
        return held

    def _longest_stop_prefix_suffix(self, buffer: str) -> int:
        longest = 0
        for stop in self._stops:
            for size in range(min(len(stop) - 1, len(buffer)), longest, -1):
                if buffer.endswith(stop[:size]):
                    longest = size
                    break
        return longest


class ReplyStream:
    r"""
    A reply's tokens turned into its answer text, its thoughts and its tool calls, round by round.

    Thoughts lose the channel's 'thought\n' label; a call comes out whole when its <tool_call|> arrives, parsed to
    JSON arguments (tools.parse_call). Stop tokens are not passed in.
    """

    def __init__(self, tokenizer, tokens: ConversationTokens, tools: tuple = ()):
        self._tokenizer, self._tools = tokenizer, tools
        self._splitter = ReplySplitter(tokens)
        self._text = IncrementalDetokenizer(tokenizer)
        self._thought = IncrementalDetokenizer(tokenizer)
        self._label = THOUGHT_LABEL   # still to strip from the thoughts' start ('' once decided)
        self._held = ''
        self.calls: list[ToolCall] = []
        self.warnings: list[GenerationWarning] = []

    def add(self, token_ids: list[int]) -> tuple[str, str, list[ToolCall]]:
        """Append a round's tokens; return its new answer text, new thought text and the calls it completed."""
        text, thought, calls = '', '', []
        for part in self._splitter.feed(token_ids):
            if part.kind == TEXT:
                text += self._text.add(part.ids)
            elif part.kind == THOUGHT:
                thought += self._thought.add(part.ids)
            else:
                call = self._call(part.ids)
                if call is not None:
                    calls.append(call)
        self.calls += calls
        return text, self._unlabelled(thought), calls

    def flush(self) -> tuple[str, str]:
        """Whatever text and thoughts are still held back at the end of generation."""
        thought = self._unlabelled(self._thought.flush(), final=True)
        return self._text.flush(), thought

    def _unlabelled(self, thought: str, final: bool = False) -> str:
        if not self._label:
            return thought
        self._held += thought
        if self._held.startswith(self._label):
            held, self._held, self._label = self._held[len(self._label):], '', ''
            return held
        if self._label.startswith(self._held):
            if final:   # the channel closed inside its label (a small max_thinking_tokens): no thoughts
                self._held = self._label = ''
            return ''   # may still be the label
        held, self._held, self._label = self._held, '', ''
        return held

    def _call(self, ids: list[int]) -> ToolCall | None:
        body = self._tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        try:
            return tool_rules.parse_call(body, self._tools, len(self.calls))
        except ValueError as exc:   # only where no grammar held the call: tool_choice none, or no tools
            self.warnings.append(GenerationWarning(WarningKind.DROPPED_TOOL_CALL,
                                                   'dropped a tool call the request did not allow ({})'.format(exc)))
            return None
