r"""
What the grammar engine makes of a JSON Schema `pattern`: the subset it enforces, and the lengths its strings take.

xgrammar 0.2.8 turns a pattern into grammar rules, and every string it lets through matches the whole pattern. It
refuses some regular-expression features (lookbehind, backreferences, word boundaries, Unicode classes) and
silently mis-reads others (a lookahead is dropped, an anchor inside a group or before the end is ignored, `\Z` is
the letter Z), so a pattern is read here first, with a parser of the subset that both xgrammar and the validator
(Python's `re`, searching) read alike:

- literals, escaped punctuation, `.`, `\d \D \w \W \s \S`, `\t \n \r \f \v`, `\xHH`, `\uHHHH`;
- classes `[...]` and `[^...]` of those, with ranges;
- groups `(...)` and `(?:...)`, alternation, the quantifiers `* + ? {n} {n,} {n,m}` (lazy or not);
- `^` / `\A` only where a match starts, `$` / `\Z` only where it ends.

Anything else is an `Unsupported` feature: the schema layer refuses it or, when the request allows, checks the
output after generation. Only the text handed to xgrammar changes (`\A`, `\Z` become `^`, `$`); the validator reads
the schema's own pattern. The lengths of a pattern's strings (`Pattern.min_length`, `max_length`) tell whether a
`minLength` / `maxLength` beside it says anything more; xgrammar ignores those beside a pattern.

Two forms of negative lookahead are written out, exactly (`without_lookaheads`): a lookahead of one character
before one character, `(?![:*$])[\x00-\x7F]` (the class without those characters), and lookaheads of literals
where the pattern starts, before `.*` or `.+`: `^(?!\.).+` or `^(?!variables$).+$` (the strings that do not
start with, or are not, those literals, spelled out letter by letter). Two slips of xgrammar 0.2.8 are written
around (`_split_long`): it reads an optional group `(?:ab*)?` as `a?b*` (written `(?:ab*){0,1}`), and it lets
quotes, backslashes and control characters into a pattern's strings past a repetition of more than 128 of one
character that could match them (`.{1,512}`: the character written without them, which no such string holds).
"""

import re
from dataclasses import dataclass

_CLASS_ESCAPES = set('dDwWsS')
_CONTROL_ESCAPES = set('tnrfv')
_HEX = {'x': 2, 'u': 4}
_CONTROL = re.compile('[\x00-\x1f\x7f]')
_QUANTIFIER = re.compile(r'\{(\d+)(,(\d*))?\}')
_LONG = 128       # the most repetitions of one character xgrammar keeps to JSON's string characters
_META = set('()[]{}|*+?.^$\\')


class Unsupported(ValueError):
    """A pattern feature the grammar engine does not enforce as the validator reads it."""


@dataclass
class _Item:
    """One quantified atom of a sequence: its lengths, where its quantifier is, and whether it is one character."""

    low: int
    high: int | None          # None: unbounded
    single: bool              # one character per repetition (a literal, an escape or a class), not a group
    repeat: tuple[int, int | None] = (1, 1)
    start: int = 0            # the atom's span in the pattern, and its quantifier's end
    atom_end: int = 0
    end: int = 0


@dataclass(frozen=True)
class Pattern:
    """A pattern in the enforced subset: the text for xgrammar, and the lengths of the strings it matches."""

    grammar_text: str
    min_length: int
    max_length: int | None
    variable: _Item | None    # the only item of variable length, when it is one repeated character (else None)
    source: str = ''
    repeats: tuple = ()       # (quantifier start, end, low, high) of every repetition, in the source pattern
    unsplit: str = ''         # grammar_text before long repetitions are split (the positions of `variable`)

    def capped(self, max_length: int) -> 'Pattern | None':
        """
        Return the pattern with every repetition capped so that no string is longer than max_length, or None.

        The caps are one bound, as high as the length allows ({1,} becomes {1,B}): the strings are the pattern's own,
        the long ones left out.
        """
        if self.max_length is not None and self.max_length <= max_length:
            return self
        if self.min_length > max_length:
            return None

        def with_cap(bound: int) -> Pattern:
            text = self.source
            for start, end, low, high in sorted(self.repeats, reverse=True):
                top = max(low, bound if high is None else min(high, bound))
                text = text[:start] + '{{{},{}}}'.format(low, top) + text[end:]
            return read_pattern(text)

        low, high = 0, max_length
        if with_cap(low).max_length > max_length:
            return None
        while low < high:   # the largest cap within max_length (lengths grow with it)
            middle = (low + high + 1) // 2
            low, high = (middle, high) if with_cap(middle).max_length <= max_length else (low, middle - 1)
        return with_cap(low)

    def with_lengths(self, min_length: int, max_length: int | None) -> str | None:
        """
        Return grammar text whose strings also have min_length..max_length characters, or None when not expressible.

        Expressible when the pattern's lengths lie within the bounds already, or when its only variable part is one
        repeated character (`^[a-z0-9-]{1,64}$`, `^arn:aws:.+$`): that repetition takes the bounds.
        """
        high_ok = max_length is None or (self.max_length is not None and self.max_length <= max_length)
        if self.min_length >= min_length and high_ok:
            return self.grammar_text
        item = self.variable
        if item is None:
            return None
        fixed = self.min_length - item.low
        low = max(item.repeat[0], min_length - fixed)
        high = max_length - fixed if max_length is not None else item.repeat[1]
        if item.repeat[1] is not None:
            high = item.repeat[1] if high is None else min(high, item.repeat[1])
        if high is not None and low > high:
            return None
        text = self.unsplit
        return _split_long(text[:item.atom_end] + '{{{},{}}}'.format(low, '' if high is None else high) +
                           text[item.end:])


def read_pattern(pattern: str) -> Pattern:
    """Parse a pattern of the enforced subset; Unsupported names the first feature outside it."""
    pattern = _CONTROL.sub(lambda match: '\\x{:02x}'.format(ord(match.group(0))), pattern)   # xgrammar: escapes
    parser = _Parser(pattern)
    try:
        low, high, items = parser.alternation()
    except Unsupported as exc:
        written = without_lookaheads(pattern) if 'negative lookahead' in str(exc) else None
        if written is None or '(?' in written.replace('(?:', ''):
            raise
        return read_pattern(written)
    if parser.pos != len(pattern):
        raise Unsupported('an unbalanced ")"')
    text, shift = parser.rewritten()
    variable = [item for item in items or () if item.low != item.high]
    single = variable[0] if len(variable) == 1 and variable[0].single else None
    if single is not None:   # its span in the text for xgrammar
        single = _Item(single.low, single.high, True, single.repeat, shift(single.start), shift(single.atom_end),
                       shift(single.end))
    return Pattern(_split_long(text), low, high, single, pattern, tuple(parser.repeats), text)


def without_lookaheads(pattern: str) -> str | None:
    """Return the pattern with its negative lookaheads written out (the same strings), or None when it cannot."""
    start = re.match(r'\^((?:\(\?![^()]*\))+)(\.[*+])(\$?)$', pattern)
    if start is not None:   # ^(?!LITERAL)(?!LITERAL$)... then .* or .+
        words = []
        for body in re.findall(r'\(\?!([^()]*)\)', start.group(1)):
            whole = body.endswith('$') and not body.endswith('\\$')
            literal = _literal(body[:-1] if whole else body)
            if literal is None:
                return None
            words.append((literal, whole))
        rest = _not_starting(words, start.group(2) == '.*')
        return None if rest is None else '^' + rest + start.group(3)
    while '(?!' in pattern:   # (?!C)X: one character that is X and not C
        at = pattern.index('(?!')
        taken, after = _atom(pattern, at + 3)
        if taken is None or not pattern.startswith(')', after):
            return None
        kept, end = _atom(pattern, after + 1)
        both = (_charset(kept), _charset(taken)) if kept is not None else (None, None)
        text = _difference(*both) if None not in both else None
        if text is None:
            return None
        group = next((len(opening) for opening in ('(?:', '(') if pattern[:at].endswith(opening)), 0)
        if group and pattern.startswith(')', end):
            at, end = at - group, end + 1
        elif pattern[end:end + 1] and pattern[end] in '*+?{':
            return None   # the lookahead holds for the first repetition only
        pattern = pattern[:at] + text + pattern[end:]
    return pattern


def _literal(text: str) -> str | None:
    chars, index = [], 0
    while index < len(text) and text[index] not in _META - {'\\'}:
        code, index = _code_at(text, index)
        chars.append(chr(code) if code is not None else '')
    return ''.join(chars) if index == len(text) and all(chars) else None


def _not_starting(words: list[tuple[str, bool]], empty: bool) -> str | None:
    """Return a regex of the lines that are none of the whole words and start with none of the others."""
    trie: dict = {}
    for word, whole in words:
        node = trie
        for char in word:
            node = node.setdefault(char, {})
        node[whole] = True   # True: this word whole; False: anything that starts with it

    def spell(node: dict, depth: int) -> str | None:
        if node.get(False):
            return None
        children = {char: spell(child, depth + 1) for char, child in node.items() if isinstance(char, str)}
        options = ['[^{}\\n].*'.format(''.join(_escape(char) for char in children))]
        options += [_escape(char) + rest for char, rest in children.items() if rest is not None]
        return '(?:{})'.format('|'.join(options)) + ('{0,1}' if not node.get(True) and (depth or empty) else '')

    return spell(trie, 0)


def _escape(char: str) -> str:
    return char if char.isascii() and char.isalnum() else '\\u{:04x}'.format(ord(char))


def _atom(text: str, index: int) -> tuple[str | None, int]:
    """Return the one-character atom at index (a literal, an escape, '.', a class) and where it ends."""
    if index >= len(text):
        return None, index
    char = text[index]
    if char == '[':
        end = index + 1 + text[index + 1:index + 2].startswith('^')
        end += text[end:end + 1] == ']'
        while end < len(text) and text[end] != ']':
            end += 2 if text[end] == '\\' else 1
        return (text[index:end + 1], end + 1) if end < len(text) else (None, index)
    if char == '\\':
        _, end = _code_at(text, index)
        return text[index:end], end
    if char in _META - {'.'}:
        return None, index
    return char, index + 1


def _code_at(text: str, index: int) -> tuple[int | None, int]:
    """Return the code point of a character or escape at index (None: a class escape) and where it ends."""
    if text[index] != '\\':
        return ord(text[index]), index + 1
    escape = text[index + 1:index + 2]
    if escape in _HEX:
        return int(text[index + 2:index + 2 + _HEX[escape]], 16), index + 2 + _HEX[escape]
    if escape in _CONTROL_ESCAPES:
        return ord({'t': '\t', 'n': '\n', 'r': '\r', 'f': '\f', 'v': '\v'}[escape]), index + 2
    return (None if escape.isalnum() else ord(escape)), index + 2


def _charset(atom: str) -> tuple[bool, list] | None:
    """(negated, ranges) of a one-character atom of literals, escapes and ranges; None with a class escape."""
    if atom == '.':
        return True, [(10, 10)]
    if not atom.startswith('['):
        code = _code_at(atom, 0)[0]
        return None if code is None else (False, [(code, code)])
    body = atom[1:-1]
    negated = body.startswith('^')
    body, ranges, index = body[negated:], [], 0
    while index < len(body):
        low, index = _code_at(body, index)
        high, index = _code_at(body, index + 1) if body.startswith('-', index) and index + 1 < len(body) else (
            low, index)
        if low is None or high is None:
            return None
        ranges.append((low, high))
    return negated, _merged(ranges)


def _merged(ranges: list) -> list:
    out: list = []
    for low, high in sorted(ranges):
        out[-1:] = [(out[-1][0], max(out[-1][1], high))] if out and low <= out[-1][1] + 1 else out[-1:] + [(low, high)]
    return out


def _minus(ranges: list, taken: list) -> list:
    out = []
    for low, high in ranges:
        for cut_low, cut_high in taken:
            if cut_high < low or cut_low > high:
                continue
            if cut_low > low:
                out.append((low, cut_low - 1))
            low = cut_high + 1
        if low <= high:
            out.append((low, high))
    return out


def _difference(kept: tuple, taken: tuple) -> str | None:
    """Return a class of the characters of kept that are not in taken (None when empty or not written)."""
    (kept_negated, kept_ranges), (taken_negated, taken_ranges) = kept, taken
    if not kept_negated:
        left, negated = _minus(kept_ranges, _minus([(0, 0x10FFFF)], taken_ranges) if taken_negated else
                               taken_ranges), False
    elif not taken_negated:
        left, negated = _merged(kept_ranges + taken_ranges), True
    else:
        left, negated = _minus(taken_ranges, kept_ranges), False
    if (not left and not negated) or any(high > 0xFFFF for _, high in left):
        return None
    spelled = ''.join(_escape(chr(low)) + ('-' + _escape(chr(high)) if high > low else '') for low, high in left)
    return '[{}{}]'.format('^' if negated else '', spelled)


def _split_long(text: str) -> str:
    r"""
    Write the pattern so that xgrammar 0.2.8 reads it right.

    A group made optional with `?` as `{0,1}` (it reads `(?:ab*)?` as `a?b*`); a character repeated more than _LONG
    times as one that cannot be '"', '\' or a control (past that xgrammar lets them into the string, and takes
    seconds to minutes to compile the repetition): no string of the grammar holds them anyway.
    """
    parser = _Parser(text)
    parser.alternation()
    edits = [(atom_end, end, '{0,1}') for atom_end, end in parser.optional_groups]
    for start, atom_end, _, _, high in parser.singles:
        if high is not None and high > _LONG:
            edits.append((start, atom_end, _writable(text[start:atom_end])))
    for start, end, written in sorted(edits, reverse=True):
        text = text[:start] + written + text[end:]
    return text


def _writable(atom: str) -> str:
    r"""Return the atom without the characters a pattern's JSON string cannot hold raw ('"', '\', controls)."""
    charset, unwritable = _charset(atom), [(0, 0x1F), (0x22, 0x22), (0x5C, 0x5C)]
    if charset is None:   # with a class escape: a negated one takes them out, the others hold none but \s's
        negated = {'\\D': '[^\\d', '\\W': '[^\\w', '\\S': '[^\\s'}.get(atom, atom[:-1] if atom.startswith('[^') else '')
        return negated + '\\u0000-\\u001f\\u0022\\u005c]' if negated else atom
    negated, ranges = charset
    left = _merged(ranges + unwritable) if negated else _minus(ranges, unwritable)
    if not left or left == ranges or any(high > 0xFFFF for _, high in left):
        return atom   # (none to take out)
    return '[{}{}]'.format('^' if negated else '', ''.join(
        _escape(chr(low)) + ('-' + _escape(chr(high)) if high > low else '') for low, high in left))


class _Parser:
    def __init__(self, pattern: str):
        self.text, self.pos = pattern, 0
        self.swaps: dict[int, str] = {}    # \A and \Z at their places: ^ and $ for xgrammar
        self.repeats: list[tuple[int, int, int, int | None]] = []
        self.singles: list[tuple[int, int, int, int, int | None]] = []   # repetitions of one character
        self.optional_groups: list[tuple[int, int]] = []                  # a group's '?' (its span)

    def rewritten(self) -> tuple[str, callable]:
        r"""Return the text for xgrammar (\A, \Z as ^, $), and the map from positions in the pattern to it."""
        text = self.text
        for position in sorted(self.swaps, reverse=True):
            text = text[:position] + self.swaps[position] + text[position + 2:]
        return text, lambda position: position - sum(1 for swap in self.swaps if swap < position)

    def alternation(self, at_start: bool = True, at_end: bool = True):
        """
        Parse alternatives up to ')' or the end; return (min length, max length, items of a lone sequence).

        at_start / at_end: a match may start / end where they begin / end (anchors are allowed there).
        """
        branches = [self.sequence(at_start, at_end)]
        while self.pos < len(self.text) and self.text[self.pos] == '|':
            self.pos += 1
            branches.append(self.sequence(at_start, at_end))
        low = min(branch[0] for branch in branches)
        high = None if any(branch[1] is None for branch in branches) else max(branch[1] for branch in branches)
        return low, high, branches[0][2] if len(branches) == 1 else None

    def sequence(self, at_start: bool, at_end: bool):
        items: list[_Item] = []
        begin = self.pos
        while self.pos < len(self.text) and self.text[self.pos] not in '|)':
            char = self.text[self.pos]
            if char in '^$' or self.text.startswith(('\\A', '\\Z'), self.pos):
                self._anchor(char if char in '^$' else self.text[self.pos + 1], begin, at_start, at_end)
                continue
            items.append(self._item(at_start and self.pos == begin, at_end))
        low = sum(item.low for item in items)
        high = None if any(item.high is None for item in items) else sum(item.high for item in items)
        return low, high, items

    def _anchor(self, kind: str, begin: int, at_start: bool, at_end: bool) -> None:
        start = self.pos
        self.pos += 1 if kind in '^$' else 2
        if kind in '^A':
            if not (at_start and self.text[begin:start].strip('^') == '' and '\\A' not in self.text[begin:start]):
                raise Unsupported("'{}' where a match cannot start".format('^' if kind == '^' else '\\A'))
        elif not at_end or (self.pos < len(self.text) and self.text[self.pos] not in '|)'):
            raise Unsupported("'{}' before the end of the match".format('$' if kind == '$' else '\\Z'))
        if kind in 'AZ':
            self.swaps[start] = '^' if kind == 'A' else '$'

    def _item(self, at_start: bool, at_end: bool) -> _Item:
        start, char = self.pos, self.text[self.pos]
        if char == '(':
            item = self._group(at_start, at_end)
        elif char == '[':
            self._class()
            item = _Item(1, 1, True)
        elif char == '\\':
            self._escape(in_class=False)
            item = _Item(1, 1, True)
        elif char in '*+?{':
            raise Unsupported('a quantifier with nothing to repeat' if char != '{' else "a literal '{'")
        elif char == '}':
            raise Unsupported("a literal '}'")
        else:
            self.pos += 1
            item = _Item(1, 1, True)
        item.start, item.atom_end = start, self.pos
        return self._quantified(item)

    def _group(self, at_start: bool, at_end: bool) -> _Item:
        self.pos += 1
        if self.text.startswith('?', self.pos):
            if not self.text.startswith('?:', self.pos):
                feature = {'?=': 'a lookahead', '?!': 'a negative lookahead', '?<=': 'a lookbehind',
                           '?<!': 'a negative lookbehind'}
                name = next((name for prefix, name in feature.items() if self.text.startswith(prefix, self.pos)),
                            'a group flag or name')
                raise Unsupported(name)
            self.pos += 2
        after = self._after_group()
        quantified = after < len(self.text) and self.text[after] in '*+?{'
        last = after >= len(self.text) or self.text[after] in '|)'
        low, high, _ = self.alternation(at_start=at_start and not quantified, at_end=at_end and last)
        if self.pos >= len(self.text) or self.text[self.pos] != ')':
            raise Unsupported('an unclosed group')
        self.pos += 1
        return _Item(low, high, False)

    def _after_group(self) -> int:
        """Return the position after the closing parenthesis of the group that opens here (else the end)."""
        depth, index = 1, self.pos
        while index < len(self.text) and depth:
            char = self.text[index]
            if char == '\\':
                index += 1
            elif char == '[':
                close = self.text.find(']', index + 2)
                index = close if close >= 0 else len(self.text)
            elif char in '()':
                depth += 1 if char == '(' else -1
            index += 1
        return index

    def _class(self) -> None:
        self.pos += 1
        if self.text.startswith('^', self.pos):
            self.pos += 1
        if self.text.startswith(']', self.pos):
            raise Unsupported("a class that starts with ']'")
        while self.pos < len(self.text) and self.text[self.pos] != ']':
            if self.text[self.pos] == '[':
                raise Unsupported("a '[' inside a class (a POSIX class or a nested set)")
            if self.text[self.pos] == '\\':
                self._escape(in_class=True)
            else:
                self.pos += 1
        if self.pos >= len(self.text):
            raise Unsupported('an unclosed class')
        self.pos += 1

    def _escape(self, in_class: bool) -> None:
        if self.pos + 1 >= len(self.text):
            raise Unsupported('a trailing backslash')
        char = self.text[self.pos + 1]
        self.pos += 2
        if char in _HEX:
            digits = self.text[self.pos:self.pos + _HEX[char]]
            if len(digits) != _HEX[char] or not all(c in '0123456789abcdefABCDEF' for c in digits):
                raise Unsupported("'\\{}' without {} hex digits".format(char, _HEX[char]))
            self.pos += _HEX[char]
        elif char.isalnum() and char not in _CLASS_ESCAPES | _CONTROL_ESCAPES:
            raise Unsupported("the escape '\\{}'".format(char))

    def _quantified(self, item: _Item) -> _Item:
        if self.pos >= len(self.text):
            item.end = self.pos
            return item
        char, low, high = self.text[self.pos], 1, 1
        if char in '*+?':
            self.pos += 1
            low, high = {'*': (0, None), '+': (1, None), '?': (0, 1)}[char]
        elif char == '{':
            match = _QUANTIFIER.match(self.text, self.pos)
            if match is None:
                raise Unsupported("a '{' that is not a repetition {n}, {n,} or {n,m}")
            self.pos = match.end()
            low = int(match.group(1))
            high = low if match.group(2) is None else (int(match.group(3)) if match.group(3) else None)
            if high is not None and high < low:
                raise Unsupported('a repetition {n,m} with m < n')
        else:
            item.end = self.pos
            return item
        if self.text.startswith('?', self.pos):   # lazy: the same strings
            self.pos += 1
        if self.pos < len(self.text) and self.text[self.pos] in '*+{':
            raise Unsupported('a possessive or repeated quantifier')
        item.repeat, item.end = (low, high), self.pos
        self.repeats.append((item.atom_end, item.end, low, high))
        if item.single:
            self.singles.append((item.start, item.atom_end, item.end, low, high))
        elif char == '?':
            self.optional_groups.append((item.atom_end, item.end))
        item.low = item.low * low
        item.high = None if high is None or item.high is None else item.high * high
        return item
