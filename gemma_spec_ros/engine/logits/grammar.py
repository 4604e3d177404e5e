"""
Constrained decoding: a JSON Schema or an EBNF grammar turned into token masks with xgrammar.

Masks are bool tensors [n, vocab] (True = allowed) over the model's vocabulary. The constrained distribution of a
step is the target's distribution with disallowed tokens masked out and renormalised; applied to the target before
the unchanged `verify()`, a forbidden draft token has target probability 0 and is always rejected, so speculation
stays lossless. EOS ids are the grammar's stop tokens: allowed exactly where the grammar accepts termination.

JSON Schemas compile to compact JSON (separators ',' and ':', no whitespace between elements) unless a request
sets `json_free_whitespace`; schema.py reads them first (rewritten for xgrammar, unenforced keywords refused or
left to the final check) and bounds their numbers' digits. One `ConstraintCompiler` per tokenizer compiles and
caches grammars by (kind, text, free whitespace, policy, digit bounds); each request gets its own
`GrammarConstraint` (an xgrammar matcher that advances along accepted tokens and rolls back drafts).
"""

import functools
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager

import torch
import xgrammar

from ..conversation import tools as tool_rules
from ..conversation.format import ConversationTokens
from . import schema as schemas
from .ebnf_rules import ebnf_grammar
from .unique_tracker import TrackedGrammar, UniqueTracker, Vocabulary

JSON_SCHEMA = schemas.JSON_SCHEMA
GRAMMAR = 'grammar'
JSON_FREE_WHITESPACE = 'json_free_whitespace'
CACHE_SIZE = 64            # compiled grammars kept (least recently used dropped)
MAX_JSON_WHITESPACE = 16   # with json_free_whitespace, characters allowed between JSON elements: room for
                           # indentation, no endless runs
COMPACT_SEPARATORS = (',', ':')
_LENGTH_STRING_CHARACTERS = r'[^\"\\\r\n]'       # as xgrammar prints them: see _json_schema_grammar
_JSON_STRING_CHARACTERS = r'[^\0-\x1f\"\\\r\n]'
# xgrammar 0.2.8 separates the items of untyped values ({} or no "items") with ', ' whatever the separators: the
# compact grammar gets ',' there too (rule text as xgrammar prints it)
_UNTYPED_SEPARATOR_RULES = {
    'basic_array_items ::= ((", " basic_any))': 'basic_array_items ::= (("," basic_any))',
    'basic_object_properties ::= ((", " basic_string ":" basic_any))':
        'basic_object_properties ::= (("," basic_string ":" basic_any))',
}
_LIBRARY_PREFIX = re.compile(r'^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?')
CALLS = 'tools'    # the kind of a tool call's grammar (cache key; errors name the tools field)


def mask_logits(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """
    Logits [n, vocab] with disallowed tokens at -inf (allowed [n, vocab] bool); a new tensor.

    Argmax of the result is the constrained greedy token; `logits_to_probs` of it is the constrained sampling
    distribution (the constraint applies before temperature, top-k and top-p, as in vLLM). A row that allows
    nothing becomes all -inf: the grammar never asks for that, see `GrammarConstraint`.
    """
    assert logits.shape == allowed.shape, (tuple(logits.shape), tuple(allowed.shape))
    return logits.masked_fill(~allowed, float('-inf'))


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Unpack xgrammar's int32 bitmask [n, ceil(vocab / 32)] (bit j of word i: token 32 i + j) -> [n, vocab] bool."""
    # host to device from pageable memory: staged at once, so the CPU buffer may be refilled; no stream sync
    words = bitmask.to(device, non_blocking=True) if device is not None else bitmask
    bits = (words.unsqueeze(-1) >> _bit_shifts(words.device)) & 1               # [n, words, 32]
    return bits.bool().reshape(words.shape[0], -1)[:, :vocab_size]


@functools.cache
def _bit_shifts(device: torch.device) -> torch.Tensor:
    return torch.arange(32, dtype=torch.int32, device=device)


class ConstraintCompiler:
    """
    Compiles JSON Schemas and EBNF grammars for one tokenizer and vocabulary; cached by kind, text, whitespace.

    vocab_size is the model's (the logits' width): ids the tokenizer lacks (padding rows) are never allowed, and
    neither are special tokens other than the stop tokens. Thread-safe.
    """

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Iterable[int], threads: int = 1,
                 cache_size: int = CACHE_SIZE):
        self.conversation = ConversationTokens.of(tokenizer.get_vocab())
        # an answer ends at a turn's end or EOS; <|tool_response> ends a reply only after its calls
        self._stop_ids = sorted(set(stop_token_ids) - {self.conversation.response_open})
        if not self._stop_ids:
            raise ValueError('a constraint needs at least one stop (EOS) token id')
        self.vocab_size = vocab_size
        self._tokenizer, self._threads = tokenizer, threads
        self._info = _tokenizer_info(tokenizer, vocab_size, self._stop_ids)
        self._compiler = xgrammar.GrammarCompiler(self._info, max_threads=threads, cache_enabled=False)
        self._call_compiler: xgrammar.GrammarCompiler | None = None   # built for the first request with tools
        special, named = _special_ids(tokenizer), set(tokenizer.get_vocab().values())
        # the tokens no free text holds: special and control tokens, and rows past the tokenizer's vocabulary
        self.special_ids = tuple(sorted(index for index in range(vocab_size) if index in special or index not in named))
        self._cache: OrderedDict[tuple, xgrammar.CompiledGrammar] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self._vocabulary: Vocabulary | None = None   # the tokens' bytes, for uniqueItems trackers (built once)

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """The tokens that end an answer (its grammar's stop tokens): a turn's end, EOS."""
        return tuple(self._stop_ids)

    def constraint(self, json_schema: str = '', grammar: str = '', json_free_whitespace: bool = False,
                   unenforced: str = '', number_digits: tuple[int, int] = (0, 0)) -> 'GrammarConstraint | None':
        """Return a fresh per-request constraint, or None when both are empty; ValueError names the bad field."""
        compiled = self.compile_request(json_schema, grammar, json_free_whitespace, unenforced, number_digits)
        return None if compiled is None else self.matcher(compiled)

    def compile_request(self, json_schema: str = '', grammar: str = '', json_free_whitespace: bool = False,
                        unenforced: str = '', number_digits: tuple[int, int] = (0, 0)
                        ) -> 'xgrammar.CompiledGrammar | TrackedGrammar | None':
        """
        Compile a request's constraint fields (json_schema or grammar), or None when both are empty; cached.

        unenforced: json_schema_unenforced (schema.POLICIES); number_digits: the most digits of a JSON number's
        integer part and fraction (0 = unbounded), see schema.bound_numbers. A json_schema with uniqueItems arrays
        that a tracker keeps distinct comes back as a TrackedGrammar (`matcher` takes either).
        """
        kind = constraint_kind(json_schema, grammar, json_free_whitespace, unenforced)
        if kind is None:
            return None
        compiled = self.compile(kind, json_schema or grammar, json_free_whitespace, unenforced, number_digits)
        plan = schemas.prepare(json_schema, unenforced, True).unique if kind == JSON_SCHEMA else None
        return compiled if plan is None else TrackedGrammar(compiled, plan)

    @staticmethod
    def output_check(json_schema: str, unenforced: str = '') -> 'schemas.OutputCheck | None':
        """Return the final check of a json_schema request (validator and gaps), or None without a json_schema."""
        return schemas.output_check(json_schema, unenforced, True)

    def matcher(self, compiled: 'xgrammar.CompiledGrammar | TrackedGrammar') -> 'GrammarConstraint':
        """Return a fresh per-request constraint at the start of a compiled grammar (with its tracker)."""
        if isinstance(compiled, TrackedGrammar):
            return GrammarConstraint(compiled.compiled, self.vocab_size, self._stop_ids,
                                     UniqueTracker(compiled.plan, self.vocabulary()))
        return GrammarConstraint(compiled, self.vocab_size, self._stop_ids)

    def vocabulary(self) -> Vocabulary:
        """Return the tokens' bytes as the grammar reads them, for uniqueItems trackers (built at the first)."""
        with self._lock:
            if self._vocabulary is None:
                tokens = [bytes(token) for token in self._info.decoded_vocab][:self.vocab_size]
                self._vocabulary = Vocabulary(tokens + [b''] * (self.vocab_size - len(tokens)))
            return self._vocabulary

    def compile_calls(self, tools: tuple, forced: str = '') -> xgrammar.CompiledGrammar:
        """
        Return the compiled grammar of one tool call's body ('call:NAME{...}'), for every tool or only forced; cached.

        Its vocabulary sees <|"|> as one character (tools.QUOTE_CHAR) that no other token can spell, and its stop
        token is <tool_call|>: a call's strings and its end are the model's control tokens, never look-alike text.
        """
        text = tool_rules.call_grammar(tools, (forced,) if forced else None)
        key = (CALLS, text, False)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
            if self._call_compiler is None:
                info = _call_tokenizer_info(self._tokenizer, self.vocab_size, self.conversation)
                self._call_compiler = xgrammar.GrammarCompiler(info, max_threads=self._threads, cache_enabled=False)
        try:
            compiled = self._call_compiler.compile_grammar(xgrammar.Grammar.from_ebnf(text))
        except (RuntimeError, ValueError) as exc:
            raise ValueError('{}: {}'.format(CALLS, _library_message(exc))) from exc
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def call_matcher(self, compiled: xgrammar.CompiledGrammar) -> 'GrammarConstraint':
        """Return a fresh constraint at the start of a call's body; <tool_call|> ends it."""
        return GrammarConstraint(compiled, self.vocab_size, [self.conversation.call_close])

    def compile(self, kind: str, text: str, json_free_whitespace: bool = False, unenforced: str = '',
                number_digits: tuple[int, int] = (0, 0)) -> xgrammar.CompiledGrammar:
        """
        Return the compiled grammar for kind 'json_schema' or 'grammar' (EBNF, root rule `root`); cached.

        A JSON Schema compiles to compact JSON, or with json_free_whitespace to JSON with up to
        MAX_JSON_WHITESPACE whitespace characters between elements; see constraint_grammar.
        """
        if json_free_whitespace and kind != JSON_SCHEMA:
            raise ValueError('{} applies to json_schema only'.format(JSON_FREE_WHITESPACE))
        if kind == JSON_SCHEMA:
            schemas.prepare(text, unenforced, True)   # refusals first: a grammar cached for 'check' serves no 'refuse'
        else:
            unenforced, number_digits = '', (0, 0)
        key = (kind, text, json_free_whitespace, schemas.check_policy(unenforced), tuple(number_digits))
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        # outside the lock: a slow schema does not block cached ones
        compiled = self._compile(kind, text, json_free_whitespace, unenforced, number_digits)
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, kind: str, text: str, json_free_whitespace: bool, unenforced: str,
                 number_digits: tuple[int, int]) -> xgrammar.CompiledGrammar:
        grammar = constraint_grammar(kind, text, json_free_whitespace, unenforced, number_digits, tracked=True)
        try:
            compiled = self._compiler.compile_grammar(grammar)
        except (RuntimeError, ValueError) as exc:
            raise ValueError('{}: {}'.format(kind, _library_message(exc))) from exc
        if not self.matcher(compiled).next_mask().any():
            # a grammar no text matches ('root ::= root'): decoding would have no token to pick, not even the end
            raise ValueError('{}: no text matches it (it allows no first token, not even the end)'.format(kind))
        return compiled


def constraint_kind(json_schema: str = '', grammar: str = '', json_free_whitespace: bool = False,
                    unenforced: str = '') -> str | None:
    """
    Return the kind of a request's constraint (JSON_SCHEMA, GRAMMAR, or None); ValueError names a bad field.

    json_free_whitespace or json_schema_unenforced without a json_schema is refused: a grammar spells out its own
    whitespace and is enforced whole, and unconstrained output has no limit, so the planner would not get what it
    asked for.
    """
    for name, value in ((JSON_SCHEMA, json_schema), (GRAMMAR, grammar)):
        if not isinstance(value, str):
            raise ValueError('{} must be a string (the document as text), got {}'.format(name, type(value).__name__))
    if not isinstance(json_free_whitespace, bool):
        raise ValueError('{} must be a bool, got {}'.format(JSON_FREE_WHITESPACE, type(json_free_whitespace).__name__))
    if json_schema and grammar:
        raise ValueError('set at most one of json_schema and grammar')
    if json_free_whitespace and not json_schema:
        raise ValueError('{} applies to json_schema only (a grammar spells out its own whitespace); set a '
                         'json_schema or leave it false'.format(JSON_FREE_WHITESPACE))
    if schemas.check_policy(unenforced) != schemas.REFUSE and not json_schema:
        raise ValueError("{} applies to json_schema only; set a json_schema or leave it ''".format(
            schemas.UNENFORCED_FIELD))
    if json_schema:
        return JSON_SCHEMA
    return GRAMMAR if grammar else None


def constraint_grammar(kind: str, text: str, json_free_whitespace: bool = False, unenforced: str = '',
                       number_digits: tuple[int, int] = (0, 0), tracked: bool = False) -> xgrammar.Grammar:
    """
    Return the EBNF grammar (xgrammar) of a json_schema or grammar field; ValueError names the field.

    Both backends enforce this grammar: the local engine compiles it into token masks, the vLLM backend sends its
    text to the server's structured outputs, so a schema means the same output on either. A json_schema is read by
    schema.prepare (refused keywords, the rewrite for xgrammar) and its numbers bounded by number_digits. tracked:
    the caller runs uniqueItems trackers (the local engine; see schema.prepare).
    """
    if json_free_whitespace and kind != JSON_SCHEMA:
        raise ValueError('{} applies to json_schema only'.format(JSON_FREE_WHITESPACE))
    if kind == JSON_SCHEMA:
        prepared = schemas.prepare(text, unenforced, tracked)
        build = lambda: _json_schema_grammar(prepared.grammar_text, json_free_whitespace, number_digits)  # noqa: E731
    elif kind == GRAMMAR:
        build = lambda: ebnf_grammar(text)  # noqa: E731
    else:
        raise ValueError('unknown constraint kind {!r}; use {!r} or {!r}'.format(kind, JSON_SCHEMA, GRAMMAR))
    try:
        return build()
    except (RuntimeError, ValueError) as exc:
        raise ValueError('{}: {}'.format(kind, _library_message(exc))) from exc


class GrammarConstraint:
    """
    One request's position in its grammar: masks for the next token(s), advanced by the accepted tokens.

    Before termination a mask always allows something (at least a stop token once the grammar is complete).
    Drafts are explored with `masks_along` or `lookahead` and rolled back; only `accept` moves the position.
    tracker: a json_schema's uniqueItems tracker (unique_tracker.py), moved and rolled back with the matcher; its
    masks leave out the tokens after which the tracked arrays' items could not stay distinct.
    """

    def __init__(self, compiled: xgrammar.CompiledGrammar, vocab_size: int, stop_token_ids: Sequence[int],
                 tracker: UniqueTracker | None = None):
        self.vocab_size = vocab_size
        self._matcher = xgrammar.GrammarMatcher(compiled, override_stop_tokens=list(stop_token_ids))
        self._bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)  # [rows, words] int32, CPU; grows
        self._tracker = tracker

    @property
    def completed(self) -> bool:
        """The accepted tokens form a complete string of the grammar (with or without the stop token)."""
        return self._matcher.is_completed()

    @property
    def terminated(self) -> bool:
        """A stop token was accepted: nothing may follow."""
        return self._matcher.is_terminated()

    def reset(self) -> None:
        """Back to the start of the grammar (a new request with the same grammar)."""
        self._matcher.reset()
        if self._tracker is not None:
            self._tracker.reset()

    def next_mask(self, device: torch.device | str | None = None) -> torch.Tensor:
        """Return the allowed tokens [1, vocab] bool for the next token (the first one after prefill)."""
        self._fill_mask_row(0)
        return unpack_bitmask(self._bitmask[:1], self.vocab_size, device)

    def masks_along(self, draft_tokens: Sequence[int] | torch.Tensor,
                    device: torch.device | str | None = None) -> tuple[torch.Tensor, int]:
        """
        Masks [k + 1, vocab] bool for every verify position of k drafts, and how many drafts the grammar allows.

        Row i is the mask for the token after draft i - 1 (row 0: after the accepted tokens; row k: the bonus
        position). Past the first refused draft (or a stop token) the rows repeat the last mask: verify rejects
        that draft, so they are never used, but they stay valid distributions. The matcher is left where it was.
        """
        draft = draft_tokens.tolist() if isinstance(draft_tokens, torch.Tensor) else list(draft_tokens)
        rows = len(draft) + 1
        if self._bitmask.shape[0] < rows:
            self._bitmask = xgrammar.allocate_token_bitmask(rows, self.vocab_size)
        self._fill_mask_row(0)
        allowed, filled = 0, 1
        for token in draft:
            if self._tracker is not None and not self._in_row(allowed, token):
                break   # the tracker's mask: checked before the matcher moves
            if not self._matcher.accept_token(token):
                break
            if self._tracker is not None:
                self._tracker.push(token)
            allowed += 1
            if self._matcher.is_terminated():  # a stop token: nothing may follow
                break
            self._fill_mask_row(allowed)
            filled += 1
        self.rollback(allowed)
        self._bitmask[filled:rows] = self._bitmask[filled - 1]
        return unpack_bitmask(self._bitmask[:rows], self.vocab_size, device), allowed

    def allowed_prefix_len(self, tokens: Sequence[int] | torch.Tensor) -> int:
        """How many leading tokens the grammar allows from here (the n-gram drafter cuts its proposal there)."""
        return allowed_prefix_len(self, tokens)

    @contextmanager
    def lookahead(self) -> Iterator['Lookahead']:
        """Explore a draft token by token (model drafters); everything pushed is rolled back on exit."""
        look = Lookahead(self)
        try:
            yield look
        finally:
            self.rollback(look.pushed)

    def accept(self, tokens: Iterable[int]) -> None:
        """Advance by emitted tokens (accepted drafts + recovered or bonus token, cut at EOS / max_new_tokens)."""
        for token in tokens:
            ok = self.advance(int(token))
            assert ok, 'token {} violates the grammar: it was emitted without the mask'.format(token)

    def advance(self, token: int) -> bool:
        """Move past token; False (nothing changes) when the grammar refuses it or has terminated."""
        if self._matcher.is_terminated() or not self._matcher.accept_token(int(token)):
            return False
        if self._tracker is not None and not self._tracker.push(int(token)):
            self._matcher.rollback(1)
            return False
        return True

    def rollback(self, count: int) -> None:
        """Undo the last count tokens that advance or accept moved past."""
        if count:
            self._matcher.rollback(count)
            if self._tracker is not None:
                self._tracker.rollback(count)

    def _fill_mask_row(self, row: int) -> None:
        assert not self._matcher.is_terminated(), 'no token may follow a stop token'
        self._matcher.fill_next_token_bitmask(self._bitmask, row)
        if self._tracker is not None:
            self._tracker.restrict(self._bitmask, row)

    def _in_row(self, row: int, token: int) -> bool:
        word = int(self._bitmask[row, token >> 5])
        return bool((word >> (token & 31)) & 1)


def allowed_prefix_len(constraint, tokens: Sequence[int] | torch.Tensor) -> int:
    """How many leading tokens a constraint (advance, rollback) allows from its position; it is left there."""
    tokens = tokens.tolist() if isinstance(tokens, torch.Tensor) else tokens
    allowed = 0
    for token in tokens:
        if not constraint.advance(token):
            break
        allowed += 1
    constraint.rollback(allowed)
    return allowed


class Lookahead:
    """A drafter's view of the grammar during one round (see `GrammarConstraint.lookahead`)."""

    def __init__(self, constraint):
        self._constraint = constraint   # a GrammarConstraint, or a reply.ReplyConstraint
        self.pushed = 0

    def mask(self, device: torch.device | str | None = None) -> torch.Tensor:
        """Return the allowed tokens [1, vocab] bool after the tokens pushed so far."""
        return self._constraint.next_mask(device)

    def push(self, token: int) -> bool:
        """Advance by a drafted token drawn under `mask()`; False when it was a stop token (the draft ends there)."""
        ok = self._constraint.advance(token)
        assert ok, 'draft token {} violates the grammar: it was drawn without the mask'.format(token)
        self.pushed += 1
        return not self._constraint.terminated


def _tokenizer_info(tokenizer, vocab_size: int, stop_ids: list[int], blank: str = '',
                    spelled: dict[int, str] | None = None) -> xgrammar.TokenizerInfo:
    """
    Describe the vocabulary to xgrammar, with special tokens blanked so that grammars never allow them.

    blank: a character whose tokens are blanked too; spelled: special tokens the grammar sees as this text.
    """
    detected = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_ids)
    special = _special_ids(tokenizer)
    encoded = [''] * vocab_size  # xgrammar treats empty tokens (and padding rows) as special: never allowed
    for token, index in tokenizer.get_vocab().items():
        if index < vocab_size and index not in special and not (blank and blank in token):
            encoded[index] = token
    for index, text in (spelled or {}).items():
        encoded[index] = text
    return xgrammar.TokenizerInfo(encoded, detected.vocab_type, vocab_size=vocab_size, stop_token_ids=stop_ids,
                                  add_prefix_space=detected.add_prefix_space)


def _special_ids(tokenizer) -> set[int]:
    special = set(tokenizer.all_special_ids)
    special.update(index for index, token in tokenizer.added_tokens_decoder.items() if token.special)
    return special


def byte_level_chars() -> dict[int, str]:
    """GPT-2 byte-level BPE's byte -> character table (printable bytes map to themselves, the rest above 255)."""
    printable = [*range(ord('!'), ord('~') + 1), *range(ord('¡'), ord('¬') + 1), *range(ord('®'), ord('ÿ') + 1)]
    others = [b for b in range(256) if b not in printable]
    table = {b: chr(b) for b in printable}
    table.update({b: chr(256 + n) for n, b in enumerate(others)})
    return table


def _call_tokenizer_info(tokenizer, vocab_size: int, conversation: ConversationTokens) -> xgrammar.TokenizerInfo:
    """
    Describe the vocabulary as a tool call's grammar sees it: <|"|> is tools.QUOTE_CHAR, <tool_call|> the stop.

    QUOTE_CHAR is a private-use character (U+E000-U+EFFF, the ones whose UTF-8 starts with byte 0xEE): every other
    token that holds byte 0xEE is blanked, so that no ordinary text can spell the quote.
    """
    chars = byte_level_chars()
    quote = ''.join(chars[byte] for byte in tool_rules.QUOTE_CHAR.encode())
    info = _tokenizer_info(tokenizer, vocab_size, [conversation.call_close], blank=chars[0xEE],
                           spelled={conversation.quote: quote})
    if info.vocab_type != xgrammar.VocabType.BYTE_LEVEL:
        raise ValueError("tools: tool calls need a byte-level BPE tokenizer (the target's is {})".format(
            info.vocab_type))
    return info


def _json_schema_grammar(text: str, free_whitespace: bool, number_digits: tuple[int, int] = (0, 0)
                         ) -> xgrammar.Grammar:
    """
    Return xgrammar's grammar of a JSON Schema: compact JSON, or free whitespace (bounded) between elements.

    number_digits: the most digits of a number's integer part and fraction (0 = unbounded; schema.bound_numbers).

    xgrammar 0.2.8 writes the characters of a minLength / maxLength string as a class that admits raw control
    characters, which JSON forbids in strings (mlc-ai/xgrammar#800); they are swapped for the class of its other
    strings. Escapes stay unavailable in such strings. A pattern would also exclude control characters, but its
    masks cost up to 100 times more per token (measured with bench/grammar_timing).
    """
    if free_whitespace:
        grammar = xgrammar.Grammar.from_json_schema(text, any_whitespace=True, max_whitespace_cnt=MAX_JSON_WHITESPACE,
                                                    strict_mode=True)
    else:
        grammar = xgrammar.Grammar.from_json_schema(text, any_whitespace=False, separators=COMPACT_SEPARATORS,
                                                    strict_mode=True)
    ebnf = original = str(grammar)
    if not free_whitespace:
        for rule, compact_rule in _UNTYPED_SEPARATOR_RULES.items():
            ebnf = ebnf.replace(rule, compact_rule)
    ebnf = schemas.bound_numbers(ebnf.replace(_LENGTH_STRING_CHARACTERS, _JSON_STRING_CHARACTERS), *number_digits)
    return grammar if ebnf == original else xgrammar.Grammar.from_ebnf(ebnf)


def _library_message(exc: Exception) -> str:
    """Return xgrammar's message without its log prefix ('[12:00:00] /project/cpp/file.cc:42: ')."""
    return _LIBRARY_PREFIX.sub('', str(exc).strip())
