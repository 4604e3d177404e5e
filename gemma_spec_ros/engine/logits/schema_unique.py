"""
`uniqueItems` that no grammar can hold, enforced by the local engine's tracker (unique_tracker.py): what it takes.

A context-free grammar cannot say "the items differ" when an item may be any string, so the rewrite leaves such an
array to the tracker where the tracker can enforce it exactly, and to a gap elsewhere (schema_rewrite.Rewriter
defers them, `plan` decides). The tracker reads the output as it grows and takes away every token after which no
completion is a valid output: one that would close an item equal to an earlier one, or leave an item with no
completion but earlier items (a string at its maxLength, the last value of an enum). The mask then allows exactly
the strings of the grammar whose arrays have distinct items, and never a dead end.

The tracker enforces `uniqueItems` on an array (`items`, no `prefixItems`) whose items are one of:

- `Str`: strings (`type: string`, with or without `minLength` / `maxLength`; no `pattern` or `format`);
- `Lit`: a finite set of scalars written as literals (`enum` / `const` of strings, integers, booleans and null,
  `type: boolean`, `type: null`);
- `Obj`: objects of named properties (no other names), each a `Str` or a `Lit`, written in the schema's order.

and only where the array is found without ambiguity: every schema node the output may be in when the array opens
(`anyOf` alternatives and `$ref`s followed, by the type of the value) is the same tracked array. Items compare as
the validator compares them (1 and 1.0 alike, true and 1 apart). The vLLM backend cannot run the tracker: there
these arrays stay gaps.
"""

import json
from dataclasses import dataclass

SIGMA = 0x110000 - 0x800 - 32 - 2   # characters a length-bounded string may hold: no surrogate, control, '"' or '\'
OTHER = '\x00other'                 # any property name an object does not declare
ANY, LITERAL = 'any', 'literal'     # a value of an untyped schema; a value inside an enum / const
KINDS = ('object', 'array', 'string', 'number', 'boolean', 'null')


def value_key(value):
    """Return a hashable key under which two JSON values are equal as the validator compares them."""
    if value is None:
        return ('z',)
    if isinstance(value, bool):
        return ('b', value)
    if isinstance(value, int | float):
        return ('n', value)
    if isinstance(value, str):
        return ('s', value)
    if isinstance(value, list):
        return ('a', tuple(value_key(item) for item in value))
    return ('o', frozenset((name, value_key(item)) for name, item in value.items()))


def capped_sum(terms, cap: int) -> int:
    total = 0
    for term in terms:
        total += term
        if total >= cap:
            return cap
    return total


def capped_product(factors, cap: int) -> int:
    total = 1
    for factor in factors:
        if factor == 0:
            return 0
        total = min(total * factor, cap)
    return total


@dataclass(frozen=True)
class Str:
    """String items: lengths in characters (max None: unbounded; then escapes may be written too)."""

    low: int = 0
    high: int | None = None

    def size(self, cap: int) -> int:
        """How many values (capped)."""
        return self.completions(0, 0, cap)

    def completions(self, chars: int, partial: int, cap: int) -> int:
        """How many values extend a prefix of `chars` whole characters (and `partial` ways to finish one more)."""
        if self.high is None:
            return cap
        if partial:
            return capped_sum((partial * SIGMA ** (length - chars - 1) for length in
                               range(max(self.low, chars + 1), self.high + 1)), cap)
        return capped_sum((SIGMA ** (length - chars) for length in range(max(self.low, chars), self.high + 1)), cap)


@dataclass(frozen=True)
class Lit:
    """Literal items: each value's text as the grammar writes it, and its key."""

    texts: tuple[bytes, ...]
    keys: tuple

    def size(self, cap: int) -> int:
        return min(len(set(self.keys)), cap)

    def matching(self, prefix: bytes) -> set:
        """Return the keys of the values whose text starts with prefix."""
        return {key for text, key in zip(self.texts, self.keys, strict=True) if text.startswith(prefix)}


@dataclass(frozen=True)
class Obj:
    """Object items: (name, the name's text after its opening quote, value spec, required) in the schema's order."""

    fields: tuple[tuple[str, bytes, 'Str | Lit', bool], ...]

    def size(self, cap: int) -> int:
        return self.rest(-1, cap)

    def rest(self, after: int, cap: int) -> int:
        """How many ways the fields after index `after` may be written (each present or, if optional, absent)."""
        return capped_product((spec.size(cap) + (not required) for _, _, spec, required in self.fields[after + 1:]),
                              cap)


@dataclass(frozen=True)
class Unique:
    """A tracked array: its item spec and item counts."""

    item: 'Str | Lit | Obj'
    min_items: int
    max_items: int | None
    path: str


def literal_text(value) -> bytes | None:
    """Return the text xgrammar writes for an enum / const scalar (None: not one the tracker takes)."""
    if isinstance(value, float) or isinstance(value, list | dict):
        return None
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 2 ** 53:
        return None
    text = json.dumps(value, ensure_ascii=False)
    return None if '\\' in text else text.encode()   # escapes: one text per value, as xgrammar writes it


class Graph:
    """The rewritten schema read as the output grows: which schema nodes a value may be in (candidate sets)."""

    def __init__(self, root: dict):
        self.root, self.defs = root, root.get('$defs', {})
        self.nodes: dict[int, object] = {}
        self._expanded: dict[int, tuple] = {}

    def expand(self, node) -> frozenset:
        """Return the ids of the plain nodes a node stands for: $ref followed, anyOf alternatives."""
        key = id(node)
        if key not in self._expanded:
            self._expanded[key] = ()   # a reference cycle without a plain node stands for nothing more
            found: list = []
            if node is False:
                pass
            elif isinstance(node, dict) and '$ref' in node:
                found += self.expand(self.defs[node['$ref'].rsplit('/', 1)[-1]])
            elif isinstance(node, dict) and 'anyOf' in node:
                for branch in node['anyOf']:
                    found += self.expand(branch)
            else:
                node = ANY if node is True or node == {} else node
                self.nodes[id(node)] = node
                found.append(id(node))
            self._expanded[key] = tuple(found)
        return frozenset(self._expanded[key])

    def kinds(self, ident: int) -> set[str]:
        node = self.nodes[ident]
        if not isinstance(node, dict):
            return set(KINDS)
        if 'enum' in node or 'const' in node:
            values = [node['const']] if 'const' in node else node['enum']
            return {_kind(value) for value in values}
        if 'type' not in node:
            return set(KINDS)
        declared = node['type'] if isinstance(node['type'], list) else [node['type']]
        return {'number' if kind == 'integer' else kind for kind in declared}

    def of_kind(self, candidates: frozenset, kind: str) -> frozenset:
        return frozenset(ident for ident in candidates if kind in self.kinds(ident))

    def child(self, candidates: frozenset, step) -> frozenset:
        """Return the candidates of a member: step is an item index or a property name (OTHER: undeclared)."""
        found: set = set()
        for ident in candidates:
            node = self.nodes[ident]
            if not isinstance(node, dict) or 'enum' in node or 'const' in node:
                found |= self.expand(LITERAL if isinstance(node, dict) else ANY)
            elif isinstance(step, int):
                prefix = node.get('prefixItems', [])
                found |= self.expand(prefix[step] if step < len(prefix) else node.get('items', True))
            else:
                declared = node.get('properties', {})
                if step in declared:
                    found |= self.expand(declared[step])
                for subschema in node.get('patternProperties', {}).values():
                    found |= self.expand(subschema)
                if step not in declared:
                    found |= self.expand(node.get('additionalProperties', True))
        return frozenset(found)

    def steps(self, candidates: frozenset, kind: str) -> list:
        """Return the distinct member steps of a candidate set of one kind (item indices; names and OTHER)."""
        nodes = [self.nodes[ident] for ident in candidates if isinstance(self.nodes[ident], dict)]
        if kind == 'array':
            return list(range(max([len(node.get('prefixItems', [])) for node in nodes] + [0]) + 1))
        return sorted({name for node in nodes for name in node.get('properties', {})}) + [OTHER]


def _kind(value) -> str:
    if value is None:
        return 'null'
    if isinstance(value, bool):
        return 'boolean'
    return {int: 'number', float: 'number', str: 'string', list: 'array', dict: 'object'}[type(value)]


class Plan:
    """The tracked arrays of one rewritten schema: the candidate sets at which an array's items must differ."""

    def __init__(self, graph: Graph, arrays: dict[frozenset, Unique]):
        self.graph, self.arrays = graph, arrays
        self._child: dict[tuple, frozenset] = {}
        self.start = graph.expand(graph.root)

    def child(self, candidates: frozenset, step, kind: str) -> frozenset:
        """Return the candidates of a member value of this kind (cached)."""
        key = (candidates, step, kind)
        if key not in self._child:
            if not isinstance(step, int) and step != OTHER and not any(
                    step in self.graph.nodes[ident].get('properties', {}) for ident in candidates
                    if isinstance(self.graph.nodes[ident], dict)):
                step = OTHER
            if isinstance(step, int):
                step = min(step, max([len(self.graph.nodes[ident].get('prefixItems', [])) for ident in candidates
                                      if isinstance(self.graph.nodes[ident], dict)] + [0]))
            self._child[key] = self.graph.of_kind(self.graph.child(candidates, step), kind)
        return self._child[key]


def plan(root: dict, deferred: list[tuple[dict, str]]) -> tuple['Plan | None', list[tuple[str, str]]]:
    """
    Return the plan of the deferred uniqueItems arrays of a rewritten schema, and those it cannot track.

    deferred: (the array's rewritten node, its schema path). The untracked come back as (path, why). An array is
    tracked only where every candidate set it belongs to is tracked arrays of one spec; one untracked member
    leaves the others of its sets untracked too (else they would hold only in some places).
    """
    graph = Graph(root)
    paths = {id(node): path for node, path in deferred}
    found: dict[int, Unique] = {}
    why: dict[int, str] = {}
    for node, path in deferred:
        spec, reason = _unique(graph, node, path)
        if spec is None:
            why[id(node)] = reason
        else:
            found[id(node)] = spec
    array_sets, seen, queue = [], set(), [graph.expand(root)]
    while queue:
        candidates = queue.pop()
        if candidates in seen:
            continue
        seen.add(candidates)
        for kind in ('array', 'object'):
            mine = graph.of_kind(candidates, kind)
            if mine and kind == 'array' and mine & paths.keys():
                array_sets.append(mine)
            queue += [graph.child(mine, step) for step in graph.steps(mine, kind)] if mine else []
    changed = True
    while changed:
        changed = False
        for mine in array_sets:
            specs = {(found[ident].item, found[ident].min_items, found[ident].max_items)
                     if ident in found and ident not in why else None for ident in mine}
            if len(specs) > 1 or None in specs:
                for ident in mine:
                    if ident in paths and ident not in why:
                        why[ident] = 'the array may be written where other arrays may be'
                        changed = True
    arrays = {mine: found[next(iter(mine))] for mine in array_sets if not any(ident in why for ident in mine)}
    untracked = [(path, why[id(node)]) for node, path in deferred if id(node) in why]
    return (Plan(graph, arrays) if arrays else None), untracked


def _unique(graph: Graph, node: dict, path: str) -> tuple['Unique | None', str]:
    if node.get('prefixItems'):
        return None, 'beside prefixItems'
    items = graph.expand(node.get('items', True))
    if len(items) != 1:
        return None, 'its items have alternatives'
    item = _item(graph, graph.nodes[next(iter(items))], True)
    if item is None:
        return None, 'its items are not strings, enum values or objects of those'
    low, high = node.get('minItems', 0), node.get('maxItems')
    if item.size(low + 1) < low:
        return None, 'fewer distinct items than minItems'
    return Unique(item, low, high, path), ''


def _item(graph: Graph, node, objects: bool):
    if not isinstance(node, dict):
        return None
    if 'enum' in node or 'const' in node:
        values = [node['const']] if 'const' in node else node['enum']
        texts = [literal_text(value) for value in values]
        if any(text is None for text in texts):
            return None
        return Lit(tuple(texts), tuple(value_key(value) for value in values))
    kind = node.get('type')
    kind = kind[0] if isinstance(kind, list) and len(kind) == 1 else kind
    rest = set(node) - {'type'}
    if kind == 'boolean' and not rest:
        return Lit((b'true', b'false'), (('b', True), ('b', False)))
    if kind == 'null' and not rest:
        return Lit((b'null',), (('z',),))
    if kind == 'string' and rest <= {'minLength', 'maxLength'}:
        high = node.get('maxLength')
        return Str(node.get('minLength', 0), None if high is None else int(high)) if (
            high is None or node.get('minLength', 0) <= high) else None
    if kind == 'object' and objects and rest <= {'properties', 'required', 'additionalProperties'} and \
            node.get('additionalProperties', False) is False and node.get('properties'):
        required = set(node.get('required', ()))
        fields = []
        for name, subschema in node['properties'].items():
            expanded = graph.expand(subschema)
            text = json.dumps(name, ensure_ascii=False)
            spec = _item(graph, graph.nodes[next(iter(expanded))], False) if len(expanded) == 1 else None
            if spec is None or '\\' in text:
                return None
            fields.append((name, text[1:].encode(), spec, name in required))
        return Obj(tuple(fields)) if required <= set(node['properties']) else None
    return None


def utf8_completions(partial: bytes) -> int:
    """How many characters (valid UTF-8, no surrogate) have an encoding that starts with these 1-3 bytes."""
    lead = partial[0]
    width = 2 if 0xC2 <= lead <= 0xDF else 3 if 0xE0 <= lead <= 0xEF else 4 if 0xF0 <= lead <= 0xF4 else 0
    if not width or any(byte & 0xC0 != 0x80 for byte in partial[1:]):
        return 0
    second = _SECOND.get(lead, (0x80, 0xBF))   # the second byte's range: no overlong form, surrogate or > U+10FFFF
    if len(partial) > 1 and not second[0] <= partial[1] <= second[1]:
        return 0
    missing = width - len(partial)
    if len(partial) == 1:
        return (second[1] - second[0] + 1) * 64 ** (missing - 1)
    return 64 ** missing


_SECOND = {0xE0: (0xA0, 0xBF), 0xED: (0x80, 0x9F), 0xF0: (0x90, 0xBF), 0xF4: (0x80, 0x8F)}


def whole_chars(raw: bytes) -> tuple[int, bytes]:
    """Return how many characters UTF-8 bytes hold, counted as the grammar counts them, and a started one's bytes."""
    count, index = 0, 0
    while index < len(raw):
        byte = raw[index]
        width = 2 if byte >> 5 == 6 else 3 if byte >> 4 == 14 else 4 if byte >> 3 == 30 else 1
        if index + width > len(raw):
            return count, raw[index:]
        count, index = count + 1, index + width
    return count, b''
