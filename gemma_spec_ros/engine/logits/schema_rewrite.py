"""
A JSON Schema rewritten into the forms xgrammar 0.2.8 enforces, and every keyword it cannot enforce named (a Gap).

xgrammar reads one form per schema node and silently drops what lies beside it (measured, see
docs/structured-output.md): siblings of `$ref`, `anyOf`, `oneOf`, `allOf`, `enum` and `const`; `required` names
missing from `properties`; references other than `#/$defs/NAME` or `#/definitions/NAME`; keywords of a kind whose
`type` is not stated. Every rewrite here keeps the meaning or narrows it (strict mode: no undeclared properties),
so that each string of the grammar validates against the original schema:

- `$ref`: every local JSON pointer becomes `#/$defs/NAME`; its siblings (draft 2019-09 and later) are merged in.
- `allOf`: its schemas are merged into one (types intersected, properties and bounds combined).
- `anyOf` / `oneOf` with siblings: the siblings are merged into each alternative. `oneOf` is compiled as the
  `anyOf` of each alternative's values that no other accepts, where they can be written (schema_oneof.py); an
  optional property no value satisfies is left out.
- `uniqueItems`: over a few item values (enum, const, booleans) the subsets in the values' order; other arrays
  are deferred (`deferred`): a local tracker may keep them (schema_unique.py), else they are gaps.
- `enum` / `const` with siblings: the values the siblings refuse are dropped (checked with the validator).
- `not` of `required`, `type`, `enum` / `const`, or `anyOf` of those: the properties are left out, the types or
  values taken away.
- required properties missing from `properties` are declared (their `patternProperties` or `additionalProperties`
  schema); draft-04 boolean exclusive bounds, array `items` lists, fractional integer bounds and typeless keywords
  get their modern, explicit forms; `format` gives way to `pattern` or lengths (it is an annotation).
- `pattern`: see schema_regex.py; lengths beside a pattern are folded into it where they can be.

Keywords that stay unenforced (`if` / `then` / `else`, `dependentRequired`, `dependentSchemas`, `dependencies`,
`contains`, untracked `uniqueItems`, fractional `multipleOf`, unsupported pattern features, `oneOf` not told
apart, unmergeable `allOf`, other `not`) are Gaps: removed from the grammar's copy; the caller refuses them or
checks the output.
"""

import itertools
import math
import re
from urllib.parse import unquote

import jsonschema

from .schema_merge import (
    ASSERTIONS,
    FORBIDDEN,
    MAX_INLINE,
    CannotMerge,
    Gap,
    Refused,
    Unsatisfiable,
    canonical,
    implied_types,
    types_of,
)
from .schema_oneof import Separating
from .schema_regex import Unsupported, read_pattern

__all__ = ['Gap', 'Refused', 'Rewriter']

UNENFORCED = ('if', 'dependentRequired', 'dependentSchemas', 'dependencies', 'contains', 'minContains',
              'maxContains', '$dynamicRef')
MAX_STEPPED_RANGE = 5000  # multipleOf holds within an integer range this wide (xgrammar 0.2.8 measured)
MAX_UNIQUE_VALUES = 6     # uniqueItems over at most this many item values: written as their subsets
_LEGACY_REFS = (jsonschema.Draft4Validator, jsonschema.Draft6Validator, jsonschema.Draft7Validator)

class Rewriter(Separating):
    """Rewrites one schema (a dict checked against its metaschema) for xgrammar; see the module docstring."""

    def __init__(self, root: dict, validator_class, track: bool = False, enumerate_at: frozenset = frozenset()):
        self.root, self.validator = root, validator_class(root)
        self.track, self.enumerate_at = track, enumerate_at   # uniqueItems: left to a tracker, except these paths
        self.deferred: list[tuple[dict, str]] = []   # uniqueItems arrays the grammar leaves (gaps unless tracked)
        self.enumerable: set[str] = set()
        self.legacy = validator_class in _LEGACY_REFS
        base = root.get('$id', root.get('id'))
        self.base = base.split('#')[0] if isinstance(base, str) else ''
        self.names: dict[str, str] = {}              # JSON pointer -> its name in $defs
        self.pending: list[tuple[str, str]] = []
        self.defs: dict[str, dict | bool] = {}
        self.merging: dict[str, str] = {}            # merged schemas being rewritten (canonical text -> name)
        self.recursive: set[str] = set()             # those a merged schema met again inside itself
        self.gaps: list[Gap] = []

    def rewrite(self) -> dict:
        """Return the schema for xgrammar; Refused when nothing can satisfy it; gaps in self.gaps."""
        try:
            out = self.node(self.root, '$')
            while self.pending:
                fragment, name = self.pending.pop(0)
                self.defs[name] = self.node(self.resolve(fragment, '$'), self.path_of(fragment))
        except Unsatisfiable as exc:
            raise Refused(str(exc)) from None
        defs = self.defs
        if out is False or False in defs.values():
            raise Refused('no value satisfies the schema{}'.format(' ($ref to a false schema)' if out else ''))
        if '' in self.names:   # '#': the root refers to itself
            defs[self.names['']] = out
            out = {'$ref': '#/$defs/' + self.names['']}
        return dict(out, **{'$defs': defs}) if defs else out

    def gap(self, keyword: str, path: str, why: str = '') -> None:
        if not any(gap.keyword == keyword and gap.path == path for gap in self.gaps):
            self.gaps.append(Gap(keyword, path, why))

    # ------------------------------------------------------------------------------------------- references
    def fragment(self, ref, path: str) -> str:
        """Return the JSON pointer of a local $ref ('' for the root); Refused for any other reference."""
        if isinstance(ref, str) and self.base and ref.startswith(self.base):
            ref = ref[len(self.base):] or '#'
        if not isinstance(ref, str) or not ref.startswith('#') or ref[1:2] not in ('', '/'):
            raise Refused("'$ref' {!r} at {}: only references inside the document ('#/...') are read".format(
                ref, path))
        fragment = unquote(ref[1:])
        self.resolve(fragment, path)
        return fragment

    def resolve(self, fragment: str, path: str):
        node = self.root
        for part in fragment.split('/')[1:]:
            part = part.replace('~1', '/').replace('~0', '~')
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                raise Refused("'$ref' '#{}' at {} points at nothing".format(fragment, path))
        return node

    def path_of(self, fragment: str) -> str:
        return '$' + ''.join('.' + part.replace('~1', '/').replace('~0', '~') for part in fragment.split('/')[1:])

    def ref(self, fragment: str) -> dict:
        if fragment not in self.names:
            self.names[fragment] = self.new_name(fragment.rsplit('/', 1)[-1] or 'root')
            self.pending.append((fragment, self.names[fragment]))
        return {'$ref': '#/$defs/' + self.names[fragment]}

    def new_name(self, base: str) -> str:
        base = re.sub(r'[^A-Za-z0-9_]', '_', base)
        name, number, taken = base, 1, set(self.names.values()) | set(self.merging.values()) | set(self.defs)
        while name in taken:
            number += 1
            name = '{}_{}'.format(base, number)
        return name

    def shared(self, merged: dict, path: str):
        """
        Rewrite a schema made by merging (a $ref inlined).

        When it meets itself inside (a recursive schema merged with siblings), it becomes a $defs entry that refers
        to itself, instead of being inlined forever.
        """
        key = canonical(merged)
        if key in self.merging:
            self.recursive.add(key)
            return {'$ref': '#/$defs/' + self.merging[key]}
        name = self.merging[key] = self.new_name('merged')
        try:
            out = self.plain(merged, path)
        finally:
            del self.merging[key]
        if key not in self.recursive:
            return out
        self.defs[name] = out
        return {'$ref': '#/$defs/' + name}

    def flat(self, schema, path: str, depth: int = 0) -> dict | bool:
        """Return the schema with its own $ref and allOf merged in (nested subschemas stay as they are)."""
        if not isinstance(schema, dict):
            return schema is not False
        schema = {key: value for key, value in schema.items() if key in ASSERTIONS or key == FORBIDDEN}
        ref = schema.pop('$ref', schema.pop('$recursiveRef', None))
        parts = []
        if ref is not None:
            if depth >= MAX_INLINE:
                raise CannotMerge('$ref', 'nested too deep to merge')
            parts.append(self.flat(self.resolve(self.fragment(ref, path), path), path, depth + 1))
            if self.legacy:   # draft 7 and before: a $ref's siblings are ignored
                schema = {}
        parts += [self.flat(part, path, depth + 1) for part in schema.pop('allOf', ())]
        merged = schema
        for part in parts:
            merged = self.merge(merged, part)
        return merged

    # ------------------------------------------------------------------------------------------- nodes
    def node(self, schema, path: str):
        """Rewrite one subschema (see the module docstring)."""
        if schema is True or schema is False:
            return {} if schema else False
        if not isinstance(schema, dict):
            return {}
        ref = schema.get('$ref', schema.get('$recursiveRef'))
        siblings = {key for key in schema if key in ASSERTIONS} - {'$ref', '$recursiveRef'}
        if ref is not None and (self.legacy or not siblings):
            return self.ref(self.fragment(ref, path))
        if ref is not None or 'allOf' in schema:
            try:
                schema = self.flat(schema, path)
            except CannotMerge as exc:
                self.gap('allOf' if 'allOf' in schema else '$ref', path, '{!r} {}'.format(exc.keyword, exc.why))
                schema = {key: value for key, value in schema.items() if key not in ('allOf', '$ref')}
            if schema is True or schema is False:
                return {} if schema else False
            return self.shared(schema, path)
        return self.plain(schema, path)

    def plain(self, schema: dict, path: str):
        """Rewrite a subschema without $ref or allOf of its own."""
        schema = dict(schema)
        if 'not' in schema:
            self.negate(schema, schema.pop('not'), path)
        if 'anyOf' in schema or 'oneOf' in schema:
            return self.union(schema, path)
        if 'enum' in schema or 'const' in schema:
            return self.values(schema, path)
        return self.typed(schema, path)

    @staticmethod
    def modern(schema: dict) -> dict:
        """Draft-04 boolean exclusive bounds and draft 2019-09 items lists in their 2020-12 forms."""
        for bound, flag in (('minimum', 'exclusiveMinimum'), ('maximum', 'exclusiveMaximum')):
            if isinstance(schema.get(flag), bool):
                if schema.pop(flag) and bound in schema:
                    schema[flag] = schema.pop(bound)
        if isinstance(schema.get('items'), list):
            schema['prefixItems'] = schema.pop('items')
            if 'additionalItems' in schema:
                schema['items'] = schema.pop('additionalItems')
        schema.pop('additionalItems', None)   # no effect without an items list
        return schema

    def negate(self, schema: dict, negated, path: str) -> None:
        """Narrow schema by `not negated` where that can be written without `not`; else a gap."""
        try:
            negated = self.flat(negated, path)
        except CannotMerge:
            negated = None
        keys = {key for key in self.validated(negated) if key in ASSERTIONS} if isinstance(negated, dict) else None
        if negated is False:
            return
        if negated is True or keys == set():
            raise Unsatisfiable("'not' at {}: not of a schema that accepts everything".format(path))
        if keys == {'required'}:
            names = [name for name in negated['required'] if name not in schema.get('required', ())]
            if not names:
                raise Unsatisfiable("'not' at {}: it forbids properties that are required".format(path))
            schema[FORBIDDEN] = list(schema.get(FORBIDDEN, ())) + names
        elif keys == {'type'}:
            taken = types_of(negated, False)
            left = [kind for kind in ('null', 'boolean', 'object', 'array', 'string', 'number', 'integer')
                    if kind in types_of(schema, False) - taken and not (kind == 'integer' and 'number' in taken)]
            if 'number' in left and 'integer' in taken:
                return self.gap('not', path, 'numbers that are not whole cannot be written apart')
            left = [kind for kind in left if not (kind == 'integer' and 'number' in left)]
            if not left:
                raise Unsatisfiable("'not' at {}: it takes away every type".format(path))
            schema['type'] = left if len(left) > 1 else left[0]
        elif keys in ({'enum'}, {'const'}) and ('enum' in schema or 'const' in schema):
            taken = {canonical(value) for value in ([negated['const']] if 'const' in negated else negated['enum'])}
            schema['enum'] = [value for value in ([schema.pop('const')] if 'const' in schema else schema['enum'])
                              if canonical(value) not in taken]
        elif keys == {'anyOf'}:
            for index, branch in enumerate(negated['anyOf']):
                self.negate(schema, branch, '{}.not.anyOf[{}]'.format(path, index))
        else:
            self.gap('not', path)

    def union(self, schema: dict, path: str):
        key = 'oneOf' if 'oneOf' in schema else 'anyOf'
        if 'anyOf' in schema and 'oneOf' in schema:
            self.gap('oneOf', path, 'beside anyOf')
            key = 'anyOf'
        siblings = {name: value for name, value in schema.items()
                    if name in ASSERTIONS and name not in ('anyOf', 'oneOf') or name == FORBIDDEN}
        branches = []
        for index, branch in enumerate(schema[key]):
            where = '{}.{}[{}]'.format(path, key, index)
            try:
                branch = self.merge(siblings, self.flat(branch, where)) if siblings else branch
            except Unsatisfiable:
                continue
            except CannotMerge as exc:
                self.gap(key, where, 'its siblings do not merge into it: {!r}'.format(exc.keyword))
            if branch is not False:
                branches.append((where, branch))
        if not branches:
            raise Unsatisfiable('{!r} at {}: no alternative can be satisfied'.format(key, path))
        if key == 'oneOf':
            branches = self.separate(branches, path)
        rewritten = []
        for where, branch in branches:
            try:
                merged = isinstance(branch, dict) and (siblings or FORBIDDEN in branch)
                rewritten.append(self.shared(branch, where) if merged else self.node(branch, where))
            except Unsatisfiable:
                continue
        rewritten = [branch for branch in rewritten if branch is not False]
        if not rewritten:
            raise Unsatisfiable('{!r} at {}: no alternative can be satisfied'.format(key, path))
        return rewritten[0] if len(rewritten) == 1 else {'anyOf': rewritten}

    def values(self, schema: dict, path: str) -> dict:
        """Return an enum or const without the values its siblings refuse (the validator decides)."""
        values = [schema['const']] if 'const' in schema else list(schema['enum'])
        rest = {key: value for key, value in schema.items() if key in ASSERTIONS and key not in ('enum', 'const')}
        forbidden = set(schema.get(FORBIDDEN, ()))
        check = self.validator.evolve(schema=rest)
        kept = [value for value in values if check.is_valid(value)
                and not (isinstance(value, dict) and forbidden & value.keys())]
        if not kept:
            raise Unsatisfiable('{!r} at {}: no value satisfies the keywords beside it'.format(
                'const' if 'const' in schema else 'enum', path))
        return {'const': kept[0]} if len(kept) == 1 else {'enum': kept}

    def typed(self, schema: dict, path: str) -> dict:
        """Rewrite a node of plain keywords: its type stated (or implied by its keywords), each kind's keywords."""
        for keyword in UNENFORCED:
            if keyword in schema and schema[keyword] not in ({}, [], None) and (keyword != 'if' or 'then' in schema
                                                                              or 'else' in schema):
                self.gap(keyword, path)
        schema = self.modern(schema)
        if schema.get(FORBIDDEN) and 'type' not in schema and not implied_types(schema):
            schema['type'] = 'object'   # `not required` says something about objects only: narrowed to them
        kinds = types_of(schema, True) if 'type' in schema or implied_types(schema) else set()
        out: dict = {}
        if 'type' in schema or kinds:
            declared = schema.get('type', sorted(kinds - {'integer'} if 'number' in kinds else kinds))
            out['type'] = declared
        if 'string' in kinds:
            self.string(schema, out, path)
        if 'integer' in kinds:
            self.number(schema, out, path)
        if 'array' in kinds:
            self.array(schema, out, path)
        if 'object' in kinds:
            self.object(schema, out, path)
        return out

    def string(self, schema: dict, out: dict, path: str) -> None:
        lengths = {key: schema[key] for key in ('minLength', 'maxLength') if key in schema}
        pattern = schema.get('pattern')
        if pattern is not None:
            try:
                re.compile(pattern)
            except re.error as exc:
                raise Refused("'pattern' at {} is not a regular expression the validator reads: {}".format(
                    path, exc)) from None
            try:
                read = read_pattern(pattern)
            except Unsupported as exc:
                self.gap('pattern', path, 'it uses {}'.format(exc))
                pattern = None
            else:
                text = read.with_lengths(lengths.get('minLength', 0), lengths.get('maxLength'))
                capped = read.capped(lengths['maxLength']) if text is None and 'maxLength' in lengths else None
                if capped is not None:   # long strings left out: the pattern's repetitions capped
                    text = capped.with_lengths(lengths.get('minLength', 0), lengths['maxLength'])
                if text is None:
                    self.gap(next(iter(lengths)), path, 'beside a pattern it cannot be folded into')
                out['pattern'] = text or read.grammar_text
                return
        out.update(lengths)
        if 'format' in schema and not lengths:
            out['format'] = schema['format']

    def number(self, schema: dict, out: dict, path: str) -> None:
        types = out['type'] if isinstance(out['type'], list) else [out['type']]
        whole = 'number' not in types
        step = schema.get('multipleOf')
        if step is not None and not float(step).is_integer():
            if not whole or not (1 / step).is_integer():
                self.gap('multipleOf', path, 'a fractional step')
            step = None   # (whole numbers are all multiples of 1 / n)
        if step is not None:
            out['multipleOf'] = int(step)
            if not whole:   # the multiples of a whole step are whole: the grammar writes integers
                types = [kind for kind in types if kind != 'integer']
                types[types.index('number')] = 'integer'
                out['type'], whole = types if len(types) > 1 else types[0], True
        for key in ('minimum', 'maximum', 'exclusiveMinimum', 'exclusiveMaximum'):
            if key in schema:
                out[key] = schema[key]
        if whole:   # xgrammar takes whole bounds for integers: the whole numbers within the same range
            for key, nearest in (('minimum', math.ceil), ('maximum', math.floor)):
                if key in out:
                    out[key] = nearest(out[key])
            if 'exclusiveMinimum' in out:
                out['minimum'] = max(out.get('minimum', -math.inf), math.floor(out.pop('exclusiveMinimum')) + 1)
            if 'exclusiveMaximum' in out:
                out['maximum'] = min(out.get('maximum', math.inf), math.ceil(out.pop('exclusiveMaximum')) - 1)
        if out.get('multipleOf') == 1:   # every integer
            del out['multipleOf']
        elif 'multipleOf' in out and not \
                out.get('maximum', math.inf) - out.get('minimum', -math.inf) <= MAX_STEPPED_RANGE:
            self.gap('multipleOf', path, 'without both bounds, or beside a wide range, xgrammar drops it')
            del out['multipleOf']

    def array(self, schema: dict, out: dict, path: str) -> None:
        if 'prefixItems' in schema:
            out['prefixItems'] = [self.node(item, '{}.prefixItems[{}]'.format(path, index))
                                  for index, item in enumerate(schema['prefixItems'])]
        items = schema.get('items', schema.get('unevaluatedItems', True))
        out['items'] = self.node(items, path + '.items')   # absent: any item (strict mode would allow none)
        for key in ('minItems', 'maxItems'):
            if key in schema:
                out[key] = schema[key]
        if schema.get('uniqueItems') is True and schema.get('maxItems', 2) > 1:
            values = self.item_values(items, path) if 'prefixItems' not in schema else None
            if values is not None and len(values) <= MAX_UNIQUE_VALUES and out['type'] == 'array':
                self.enumerable.add(path)
            if path not in self.enumerable or (self.track and path not in self.enumerate_at):
                self.deferred.append((out, path))
                return self.gap('uniqueItems', path)
            low, high = schema.get('minItems', 0), min(schema.get('maxItems', len(values)), len(values))
            subsets = [subset for size in range(low, high + 1) for subset in itertools.combinations(values, size)]
            if not subsets:
                raise Unsatisfiable('{}: fewer distinct items than minItems'.format(path))
            out.clear()   # distinct values: the subsets of the item values, each in their order
            out['anyOf'] = [{'type': 'array', 'prefixItems': [{'const': value} for value in subset], 'items': False}
                            if subset else {'type': 'array', 'maxItems': 0} for subset in subsets]

    def item_values(self, items, path: str) -> list | None:
        """Return the values an item may take when they are few (an enum, a const, booleans), else None."""
        try:
            flat = self.flat(items, path)
        except CannotMerge:
            return None
        if isinstance(flat, dict) and ('enum' in flat or 'const' in flat):
            rewritten = self.values(dict(flat), path)
            return [rewritten['const']] if 'const' in rewritten else rewritten['enum']
        if isinstance(flat, dict) and flat.get('type') == 'boolean' and set(flat) <= {'type'}:
            return [False, True]
        return None

    def object(self, schema: dict, out: dict, path: str) -> None:
        """
        Properties, required ones declared, forbidden ones left out.

        With properties xgrammar writes no other names unless additionalProperties allows them; an object that
        declares nothing stays free (additionalProperties {}), unless `not required` forbids names: then empty.
        """
        declared, required = schema.get('properties', {}), list(dict.fromkeys(schema.get('required', ())))
        additional = schema.get('additionalProperties', schema.get('unevaluatedProperties'))
        forbidden = set(schema.get(FORBIDDEN, ()))
        if additional is None and not declared and not required and not schema.get('patternProperties') \
                and not forbidden:
            additional = True
        open_ = additional not in (None, False)
        properties, never = {}, set()
        for name, subschema in declared.items():
            if name in forbidden or subschema is False:
                if name in required:
                    raise Unsatisfiable('{} requires {!r}, which it forbids'.format(path, name))
                continue
            gaps = len(self.gaps)
            try:
                properties[name] = self.node(subschema, '{}.properties.{}'.format(path, name))
            except Unsatisfiable:
                if name in required:
                    raise
                del self.gaps[gaps:]   # no value satisfies it: the name is never written (its gaps are moot)
                never.add(name)
        for name in required:
            if name in properties:
                continue
            subschema = self.property_schema(schema, name)
            if name in forbidden or subschema is False:
                raise Unsatisfiable('{} requires {!r}, which it does not allow'.format(path, name))
            properties[name] = self.node(subschema, '{}.required'.format(path))
        if open_ and (forbidden or never or any(subschema is False for subschema in declared.values())):
            self.gap('not' if forbidden else 'properties', path, 'a forbidden property beside additionalProperties')
        out['properties'] = properties
        if required:
            out['required'] = required
        if additional is not None:
            out['additionalProperties'] = self.node(additional, path + '.additionalProperties')
        if schema.get('patternProperties'):
            out['patternProperties'] = {}
            for pattern, subschema in schema['patternProperties'].items():
                try:
                    out['patternProperties'][read_pattern(pattern).grammar_text] = self.node(
                        subschema, '{}.patternProperties.{}'.format(path, pattern))
                except Unsupported as exc:
                    self.gap('patternProperties', path, 'it uses {}'.format(exc))
        if 'propertyNames' in schema:
            out['propertyNames'] = self.node(schema['propertyNames'], path + '.propertyNames')
        for key in ('minProperties', 'maxProperties'):
            if key in schema:
                out[key] = schema[key]
