"""Incremental detokenization and stop strings for streaming."""

from transformers import PreTrainedTokenizerFast


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
