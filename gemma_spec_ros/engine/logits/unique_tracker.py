"""
The local engine's `uniqueItems` tracker: the output read byte by byte beside the grammar, tokens taken away.

`UniqueTracker` follows one request's output (the JSON text the grammar lets through) with the plan of its schema
(schema_unique.Plan). Inside a tracked array it knows the items written so far, and a token is allowed only when,
after it, some completion of the output has distinct items: a token that closes an item equal to an earlier one
is taken away, and so is one after which the open item can only become an earlier one (a string at its
maxLength, an enum with no value left, an object whose last field can only repeat an earlier object). Everything
else the grammar decides, so the mask stays exact and never leads to a dead end.

Its state moves with the grammar's: one snapshot per accepted token, rolled back with it (speculative drafts,
lookahead), so a draft explored and rolled back leaves no trace.

To keep a mask cheap, only the tokens that can end somewhere new are read: inside an item's free string, the
tokens that close it as an earlier value, fill it to its maxLength as one, or hold more than one quote or a
backslash; where a string opens, those that open it as an earlier value at its maxLength; elsewhere in a tracked
array, every token the grammar allows.
"""

import json
from dataclasses import dataclass, replace

import numpy as np
import torch

from .schema_unique import OTHER, Lit, Plan, Str, utf8_completions, value_key, whole_chars

_SPACE = frozenset(b' \t\n\r')
_ATOM_END = frozenset(b',]}') | _SPACE
_QUOTE, _BACKSLASH = ord('"'), ord('\\')
_PARTIAL = 64    # a started character has at least this many completions (utf8_completions)


@dataclass(frozen=True)
class TrackedGrammar:
    """A compiled json_schema (xgrammar) whose uniqueItems arrays a tracker keeps distinct (a schema_unique.Plan)."""

    compiled: object
    plan: Plan


class Vocabulary:
    """
    The tokens' bytes, and the classes of tokens a mask reads in a tracked array (built once per vocabulary).

    Read from inside a string: `one` closes it once (text before the quote in `closing`, before and after in
    `split`), `two` closes it and opens another (by the text before the first quote), `escaped` closes it after
    an escape, `tricky` does more (three quotes, or a container after a quote). The rest stays inside.
    """

    def __init__(self, tokens: list[bytes]):
        self.tokens = tokens
        self.by_bytes: dict[bytes, list[int]] = {}
        self.closing: dict[bytes, list[int]] = {}
        self.closing_twice: dict[bytes, list[int]] = {}
        self.split: dict[tuple[bytes, bytes], list[int]] = {}
        self.one, self.two, self.escaped, self.tricky = (np.zeros(len(tokens), dtype=bool) for _ in range(4))
        self.before = np.full(len(tokens), -1, dtype=np.int64)
        numbers: dict[bytes, int] = {}
        for index, data in enumerate(tokens):
            self.by_bytes.setdefault(data, []).append(index)
            if b'\\' in data:
                self.escaped[index] = _closes_after_escapes(data)
                continue
            parts = data.split(b'"')
            if len(parts) == 1:
                continue
            if len(parts) > 3 or any(byte in parts[1] for byte in b'{['):
                self.tricky[index] = True
            elif len(parts) == 3:
                self.two[index] = True
                self.closing_twice.setdefault(parts[0], []).append(index)
            else:
                self.one[index] = True
                self.closing.setdefault(parts[0], []).append(index)
                self.split.setdefault((parts[0], parts[1]), []).append(index)
                self.before[index] = numbers.setdefault(parts[0], len(numbers))
        self.befores = list(numbers)
        self.longest = max((len(data) for data in tokens), default=0)


def _closes_after_escapes(data: bytes) -> bool:
    """Return whether a token read from inside a string (no escape open) closes it."""
    index = 0
    while index < len(data):
        if data[index] == _BACKSLASH:
            index += 6 if data[index + 1:index + 2] == b'u' else 2
        elif data[index] == _QUOTE:
            return True
        else:
            index += 1
    return False


@dataclass(frozen=True)
class _Uniq:
    """A tracked array being written: its spec, the items so far (keys), and the item being written."""

    depth: int
    spec: object           # schema_unique.Unique
    used: tuple = ()
    committed: bool = False   # after ',': another item must come
    item: tuple | None = None
    # item: ('s', raw content) | ('l', raw text) | ('o', done ((field, key), ...), last field, phase, field, raw)


@dataclass(frozen=True)
class _State:
    stack: tuple = ()      # (kind 'o' / 'a', candidates, member count, the open key's candidates)
    mode: str = 'V'        # V value, K key, C colon, S string, A atom, P after a value, X lost
    key: bool = False      # the open string is a key
    escape: int = 0        # in a string: -1 after a backslash, n > 0: hex digits left
    name: bytes = b''      # the open key's bytes
    uniq: _Uniq | None = None


_LOST = _State(mode='X')   # the output is no JSON the tracker reads: it stops taking tokens away


class Dead(Exception):
    """The output can no longer complete with distinct items."""


class UniqueTracker:
    """One request's tracker (see the module docstring); the same moves as grammar.GrammarConstraint's matcher."""

    def __init__(self, plan: Plan, vocabulary: Vocabulary):
        self.plan, self.vocabulary = plan, vocabulary
        self.history = [_State()]

    def reset(self) -> None:
        del self.history[1:]

    def push(self, token: int) -> bool:
        """Move past token; False (nothing changes) when it leaves no completion with distinct items."""
        state = self.after(self.history[-1], self.vocabulary.tokens[token])
        if state is None:
            return False
        self.history.append(state)
        return True

    def rollback(self, count: int) -> None:
        if count:
            del self.history[len(self.history) - count:]

    def restrict(self, bitmask: torch.Tensor, row: int) -> None:
        """Clear from a filled bitmask row (xgrammar's int32 words) the tokens that leave no completion."""
        state = self.history[-1]
        if state.uniq is None:
            return
        words = bitmask[row].numpy().view(np.uint32)   # shares the tensor's memory
        allowed = np.unpackbits(words.view(np.uint8), bitorder='little')[:len(self.vocabulary.tokens)].astype(bool)
        dead = [token for token in self.candidates(state, allowed)
                if self.after(state, self.vocabulary.tokens[token]) is None]
        if len(dead) == int(allowed.sum()):   # never from a state the tracker reached: it lost the thread
            self.history[-1] = _LOST
            return
        for token in dead:
            words[token >> 5] &= np.uint32(0xFFFFFFFF ^ (1 << (token & 31)))

    def candidates(self, state: _State, allowed: np.ndarray):
        """Return the allowed tokens that may end where no completion is left (a superset; see the docstring)."""
        text = self.free_text(state)
        if text is not None:
            return self.in_text(state, allowed, text)
        vocabulary = self.vocabulary
        found = set(np.flatnonzero(allowed & ~vocabulary.one).tolist())
        ones = np.flatnonzero(allowed & vocabulary.one)
        numbers = vocabulary.before[ones]
        for number in np.unique(numbers).tolist():   # the same text before the quote: one opening to read
            members = ones[numbers == number]
            before = vocabulary.befores[number]
            opened = self.after(state, before + b'"')
            text = self.free_text(opened) if opened is not None else None
            if text is None or len(text[2]) >= _PARTIAL:
                found.update(members.tolist())
            elif text[1].high is not None:   # a new string at its maxLength, equal to an earlier value
                found.update(token for value in text[2] for token in vocabulary.split.get((before, value), ())
                             if allowed[token])
        return found

    def in_text(self, state: _State, allowed: np.ndarray, text) -> set:
        """Return the candidates inside a Str string of a tracked item: what may close it or fill it."""
        uniq, vocabulary = state.uniq, self.vocabulary
        raw, spec, earlier = text
        whole = len(raw) - len(whole_chars(raw)[1])
        try:
            if b'\\' in raw:   # escapes written (a free string): compare what they stand for
                raw = json.loads('"' + raw[:whole].decode('utf-8') + '"').encode('utf-8', 'surrogatepass') + \
                    raw[whole:]
            else:
                raw[:whole].decode('utf-8')
            clean = not any('\ufffd'.encode() in value for value in earlier)
        except (UnicodeDecodeError, ValueError):
            clean = False   # bytes that are no UTF-8 (U+FFFD for the validator): every allowed token is read
        found = set(np.flatnonzero(allowed & (vocabulary.tricky | vocabulary.escaped)).tolist())
        if not clean or len(earlier) >= _PARTIAL or spec_size(uniq.spec.item, len(uniq.used) + 2) <= \
                len(uniq.used) + 1:
            return found | set(np.flatnonzero(allowed).tolist())
        if spec.high is not None and spec.high <= vocabulary.longest:   # a second string may reach maxLength
            found.update(np.flatnonzero(allowed & vocabulary.two).tolist())
        for value in earlier:
            if value.startswith(raw):
                rest = value[len(raw):]
                for table in (vocabulary.closing, vocabulary.closing_twice) + (
                        (vocabulary.by_bytes,) if spec.high is not None else ()):
                    found.update(token for token in table.get(rest, ()) if allowed[token])
        return found

    def free_text(self, state: _State):
        """In a Str string of a tracked item (no escape open): (its bytes, its spec, the earlier values' bytes)."""
        uniq = state.uniq
        if state.mode != 'S' or state.key or state.escape or uniq is None or uniq.item is None:
            return None
        item, spec = uniq.item, uniq.spec.item
        if item[0] == 's':
            return item[1], spec, [key[1].encode('utf-8', 'surrogatepass') for key in uniq.used]
        if item[0] == 'o' and item[3] == 'field' and isinstance(spec.fields[item[4]][2], Str):
            field = item[4]
            earlier = [dict(key[1])[field][1].encode('utf-8', 'surrogatepass') for key in uniq.used
                       if _first_after(key[1], item[2]) == field and _prefix(key[1], item[2]) == item[1]]
            return item[5], spec.fields[field][2], earlier
        return None

    # ------------------------------------------------------------------------------------------- reading
    def after(self, state: _State, data: bytes) -> _State | None:
        """Return the state after data, or None when no completion with distinct items is left."""
        try:
            for byte in data:
                state = self.byte(state, byte)
            if state.uniq is not None and self.dead(state):
                return None
        except Dead:
            return None
        except (IndexError, KeyError, StopIteration, ValueError, AttributeError, TypeError):
            return _LOST   # not JSON as the tracker reads it (an xgrammar slip): the final check decides
        return state

    def byte(self, state: _State, byte: int) -> _State:
        mode = state.mode
        if mode == 'X':
            return state
        if mode == 'S':
            return self.string(state, byte)
        if mode == 'A':
            if byte not in _ATOM_END:
                return self.grow(state, byte)
            state = self.end_value(replace(state, mode='P'))
            mode = 'P'
        if byte in _SPACE:
            return state
        if mode == 'V':
            if byte == ord(']'):
                return self.close(state)
            return self.open_value(state, byte)
        if mode == 'K':
            if byte == ord('}'):
                return self.close(state)
            return self.grow(replace(state, mode='S', key=True, name=b''), None)
        if mode == 'C':
            return self.on_colon(replace(state, mode='V'))
        # 'P': after a value
        if byte == ord(','):
            kind, candidates, count, _ = state.stack[-1]
            state = replace(state, stack=state.stack[:-1] + ((kind, candidates, count + 1, None),),
                            mode='V' if kind == 'a' else 'K')
            return self.on_comma(state)
        return self.close(state)

    def open_value(self, state: _State, byte: int) -> _State:
        kind = {ord('{'): 'object', ord('['): 'array', ord('"'): 'string', ord('t'): 'boolean', ord('f'): 'boolean',
                ord('n'): 'null'}.get(byte, 'number')
        candidates = self.member(state, kind)
        state = self.on_value(state, kind)
        if kind == 'object':
            return replace(state, stack=state.stack + (('o', candidates, 0, None),), mode='K')
        if kind == 'array':
            state = replace(state, stack=state.stack + (('a', candidates, 0, None),), mode='V')
            spec = self.plan.arrays.get(candidates)
            if spec is not None and state.uniq is None:
                state = replace(state, uniq=_Uniq(len(state.stack) - 1, spec))
            return state
        if kind == 'string':
            return self.grow(replace(state, mode='S', key=False), None)
        return self.grow(replace(state, mode='A'), byte)

    def member(self, state: _State, kind: str):
        if not state.stack:
            return self.plan.graph.of_kind(self.plan.start, kind)
        container, candidates, count, key = state.stack[-1]
        return self.plan.child(candidates, count if container == 'a' else key, kind)

    def string(self, state: _State, byte: int) -> _State:
        escape = state.escape
        if escape == -1:
            state = replace(state, escape=4 if byte == ord('u') else 0)
        elif escape > 0:
            state = replace(state, escape=escape - 1)
        elif byte == _BACKSLASH:
            state = replace(state, escape=-1)
        elif byte == _QUOTE:
            if state.key:
                return self.end_key(state)
            return self.end_value(replace(self.grow(state, byte, closing=True), mode='P'))
        return self.grow(state, byte)

    def close(self, state: _State) -> _State:
        if not state.stack:
            raise IndexError('nothing to close')
        depth = len(state.stack) - 1
        state = replace(state, stack=state.stack[:-1], mode='P')
        if state.uniq is not None and state.uniq.depth == depth:
            return replace(state, uniq=None)
        return self.end_value(state)

    # ------------------------------------------------------------------------------------------- the tracked array
    def end_key(self, state: _State) -> _State:
        name = json.loads(b'"' + state.name + b'"')
        _, candidates, _, _ = state.stack[-1]
        declared = any(name in self.plan.graph.nodes[ident].get('properties', {}) for ident in candidates
                       if isinstance(self.plan.graph.nodes[ident], dict))
        frame = state.stack[-1][:3] + (name if declared else OTHER,)
        state = replace(state, stack=state.stack[:-1] + (frame,), mode='C', key=False)
        uniq = state.uniq
        if uniq is not None and uniq.item is not None and len(state.stack) - 2 == uniq.depth:
            fields = uniq.spec.item.fields
            field = next(index for index in range(uniq.item[2] + 1, len(fields)) if fields[index][0] == name)
            state = replace(state, uniq=replace(uniq, item=uniq.item[:3] + ('colon', field, b'')))
        return state

    def on_colon(self, state: _State) -> _State:
        uniq = state.uniq
        if uniq is not None and uniq.item is not None and uniq.item[0] == 'o' and uniq.item[3] == 'colon':
            state = replace(state, uniq=replace(uniq, item=uniq.item[:3] + ('value',) + uniq.item[4:]))
        return state

    def on_comma(self, state: _State) -> _State:
        uniq = state.uniq
        if uniq is None:
            return state
        if len(state.stack) - 1 == uniq.depth:
            return replace(state, uniq=replace(uniq, committed=True))
        if uniq.item is not None and uniq.item[0] == 'o':
            return replace(state, uniq=replace(uniq, item=uniq.item[:3] + ('next', -1, b'')))
        return state

    def on_value(self, state: _State, kind: str) -> _State:
        """Open a value: a tracked item, or a field of one."""
        uniq = state.uniq
        if uniq is None:
            return state
        if len(state.stack) - 1 == uniq.depth:
            item = ('o', (), -1, 'start', -1, b'') if kind == 'object' else (
                ('s', b'') if isinstance(uniq.spec.item, Str) else ('l', b''))
            return replace(state, uniq=replace(uniq, item=item, committed=False))
        if uniq.item is not None and uniq.item[0] == 'o' and uniq.item[3] == 'value':
            return replace(state, uniq=replace(uniq, item=uniq.item[:3] + ('field',) + uniq.item[4:]))
        return state

    def grow(self, state: _State, byte: int | None, closing: bool = False) -> _State:
        """Add a byte to the open key, or to the tracked item's text (a Lit keeps its quotes, a Str not)."""
        byte_text = b'' if byte is None else bytes((byte,))
        if state.key:
            state = replace(state, name=state.name + byte_text)
        uniq = state.uniq
        if uniq is None or uniq.item is None:
            return state
        item = uniq.item
        if item[0] == 'o':
            if state.key and item[3] in ('start', 'next', 'key'):
                return replace(state, uniq=replace(uniq, item=item[:3] + ('key', -1, state.name)))
            if item[3] != 'field':
                return state
            spec = uniq.spec.item.fields[item[4]][2]
        else:
            spec = uniq.spec.item
        if byte is None and isinstance(spec, Lit):
            byte_text = b'"'   # the opening quote of a literal string
        elif byte is None or (closing and isinstance(spec, Str)):
            return state
        return replace(state, uniq=replace(uniq, item=item[:-1] + (item[-1] + byte_text,)))

    def end_value(self, state: _State) -> _State:
        """Close a value: a tracked item (its key must be new), or a field of one."""
        uniq = state.uniq
        if uniq is None or uniq.item is None:
            return state
        depth, item = len(state.stack) - 1, uniq.item
        if item[0] == 'o' and depth == uniq.depth + 1:   # a field
            spec = uniq.spec.item.fields[item[4]][2]
            done = item[1] + ((item[4], _key(spec, item[5])),)
            return replace(state, uniq=replace(uniq, item=('o', done, item[4], 'after', -1, b'')))
        if depth != uniq.depth:
            return state
        key = ('o', item[1]) if item[0] == 'o' else _key(uniq.spec.item, item[1])
        if key in uniq.used:
            raise Dead
        return replace(state, uniq=replace(uniq, used=uniq.used + (key,), item=None))

    def dead(self, state: _State) -> bool:
        """Tell whether no completion with distinct items is left (exact: see schema_unique's counts)."""
        uniq = state.uniq
        spec, used, item = uniq.spec.item, uniq.used, uniq.item
        cap = len(used) + 2   # counts are capped above what the earlier items can cover (and one to take away)
        if item is None:
            return uniq.committed and spec_size(spec, cap) <= len(used)
        if item[0] != 'o':
            keys = _completions(spec, item[1], cap)
            if isinstance(keys, set):
                return keys <= set(used)
            return keys <= sum(_extends(spec, key, item[1]) for key in used)
        done, last, phase, field, raw = item[1:]
        fields = spec.fields
        mine = [key[1] for key in used if _prefix(key[1], last) == done]
        if phase in ('start', 'after'):
            return spec.rest(last, cap) <= len(mine)
        if phase == 'next':
            optional = all(not required for _, _, _, required in fields[last + 1:])
            return spec.rest(last, cap) - optional <= sum(_first_after(key, last) is not None for key in mine)
        if phase == 'key':
            choices = [index for index in range(last + 1, len(fields)) if fields[index][1].startswith(raw)
                       and all(not fields[skipped][3] for skipped in range(last + 1, index))]
            total = min(cap, sum(spec_size(fields[index][2], cap) * spec.rest(index, cap) for index in choices))
            return total <= sum(_first_after(key, last) in choices for key in mine)
        mine = [key for key in mine if _first_after(key, last) == field]
        value = fields[field][2]
        if phase in ('colon', 'value'):
            return min(cap, spec_size(value, cap) * spec.rest(field, cap)) <= len(mine)
        keys = _completions(value, raw, cap)
        matching = [key for key in mine if (dict(key)[field] in keys if isinstance(keys, set) else
                                            _extends(value, dict(key)[field], raw))]
        count = len(keys) if isinstance(keys, set) else keys
        return min(cap, count * spec.rest(field, cap)) <= len(matching)


def spec_size(spec, cap: int) -> int:
    return spec.size(cap)


def _completions(spec, raw: bytes, cap: int):
    """Return a Lit's keys whose text extends raw; a Str's count of values that extend raw (capped)."""
    if isinstance(spec, Lit):
        return spec.matching(raw)
    chars, partial = whole_chars(raw)
    if partial:
        ways = utf8_completions(partial)
        return spec.completions(chars, ways, cap) if ways else cap   # invalid UTF-8: the final check decides
    return spec.completions(chars, 0, cap)


def _extends(spec: Str, key, raw: bytes) -> bool:
    return key[1].encode('utf-8', 'surrogatepass').startswith(raw)


def _key(spec, raw: bytes):
    if isinstance(spec, Str):
        return ('s', json.loads('"' + raw.decode('utf-8', 'replace') + '"'))
    return value_key(json.loads(raw.decode('utf-8', 'replace')))


def _prefix(fields: tuple, last: int) -> tuple:
    return tuple(entry for entry in fields if entry[0] <= last)


def _first_after(fields: tuple, last: int) -> int | None:
    return next((entry[0] for entry in fields if entry[0] > last), None)


__all__ = ['TrackedGrammar', 'UniqueTracker', 'Vocabulary']
