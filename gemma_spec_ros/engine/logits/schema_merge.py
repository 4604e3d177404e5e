"""
Merging JSON Schemas for the rewrite (schema_rewrite.py).

`allOf` and a `$ref`'s siblings become one schema.

A merge is the conjunction of two schemas written as one: types intersected, properties combined name by name
(a name one schema leaves to its additionalProperties or patternProperties gets that schema), `required` joined,
bounds tightened, enums intersected. A keyword that resists (two different patterns, conditionals, ...) raises
CannotMerge, which the rewrite reports as a gap; a conjunction nothing satisfies raises Unsatisfiable.
`oneOf` is told apart in schema_oneof.py.
"""

import json
import re
from dataclasses import dataclass

ALL_TYPES = ('null', 'boolean', 'object', 'array', 'number', 'string')
KIND_KEYWORDS = {
    'string': ('minLength', 'maxLength', 'pattern', 'format'),
    'number': ('minimum', 'maximum', 'exclusiveMinimum', 'exclusiveMaximum', 'multipleOf'),
    'array': ('items', 'prefixItems', 'minItems', 'maxItems', 'uniqueItems', 'contains', 'unevaluatedItems'),
    'object': ('properties', 'required', 'additionalProperties', 'patternProperties', 'propertyNames',
               'minProperties', 'maxProperties', 'unevaluatedProperties', 'dependentRequired', 'dependentSchemas',
               'dependencies'),
}
ASSERTIONS = frozenset({'type', 'enum', 'const', 'not', 'allOf', 'anyOf', 'oneOf', '$ref', '$recursiveRef',
                        '$dynamicRef', 'if', 'then', 'else', 'additionalItems', 'minContains', 'maxContains'}.union(
    *KIND_KEYWORDS.values()))
FORBIDDEN = '\x00forbidden'     # names a `not required` leaves out (internal)
MAX_INLINE = 16                 # nested $ref inlined while merging (recursive schemas stop there)


@dataclass(frozen=True)
class Gap:
    """A keyword the grammar does not enforce, where it is, and why."""

    keyword: str
    path: str
    why: str = ''

    def describe(self) -> str:
        return '{!r} at {}{}'.format(self.keyword, self.path, ' ({})'.format(self.why) if self.why else '')


class Refused(ValueError):
    """A schema no output can satisfy, or one the validator cannot read: refused whatever the policy."""


class CannotMerge(Exception):
    def __init__(self, keyword: str, why: str = ''):
        super().__init__(keyword)
        self.keyword, self.why = keyword, why


class Unsatisfiable(Exception):
    pass


def canonical(value) -> str:
    return json.dumps(value, sort_keys=True)


def types_of(node: dict, grammar: bool) -> set[str]:
    """Return the JSON types a node allows ('integer': whole numbers); grammar: as the rewrite narrows it."""
    if 'type' in node:
        declared = node['type'] if isinstance(node['type'], list) else [node['type']]
        kinds = set(declared)
    elif 'const' in node or 'enum' in node:
        kinds = {_json_type(value) for value in ([node['const']] if 'const' in node else node['enum'])}
    elif grammar and implied_types(node):
        kinds = implied_types(node)
    else:
        kinds = set(ALL_TYPES)
    return kinds | {'integer'} if 'number' in kinds else kinds


def implied_types(node: dict) -> set[str]:
    return {kind for kind, keys in KIND_KEYWORDS.items() if any(key in node for key in keys)}


def _json_type(value) -> str:
    if value is None:
        return 'null'
    if isinstance(value, bool):
        return 'boolean'
    if isinstance(value, int) or isinstance(value, float) and value.is_integer():
        return 'integer'
    return {float: 'number', str: 'string', list: 'array', dict: 'object'}[type(value)]


def negated_required(node: dict) -> list[list[str]]:
    """Return the sets of names a node forbids together: `not` of `required` (or of an anyOf of them)."""
    negated = node.get('not')
    forms = negated.get('anyOf', []) if isinstance(negated, dict) and set(negated) == {'anyOf'} else [negated]
    found = [list(form['required']) for form in forms if isinstance(form, dict) and set(form) == {'required'}]
    return found + [[name] for name in node.get(FORBIDDEN, ())]


def combine(first, second):
    """Return the conjunction of two subschemas, unmerged (True / {} mean anything, False nothing)."""
    if first is True or first == {}:
        return second
    if second is True or second == {}:
        return first
    if first is False or second is False:
        return False
    return first if canonical(first) == canonical(second) else {'allOf': [first, second]}

class Merging:
    """The merging part of schema_rewrite.Rewriter (which gives flat, validator and gap)."""

    def merge(self, first, second) -> dict | bool:
        """Return the conjunction of two flat schemas as one; CannotMerge names the keyword that resists."""
        if first is False or second is False:
            raise Unsatisfiable('allOf: a false schema')
        if first is True:
            return second
        if second is True:
            return first
        out = {}
        objects = {'properties', 'additionalProperties', 'patternProperties'}
        for key in [key for key in first if key not in objects] + [key for key in second if key not in objects]:
            if key in out:
                continue
            if key not in second or key not in first:
                out[key] = first[key] if key in first else second[key]
            else:
                out[key] = self.merge_keyword(key, first[key], second[key])
        if objects & (first.keys() | second.keys()):
            self.merge_properties(first, second, out)
        return out

    def merge_keyword(self, key: str, first, second):
        if canonical(first) == canonical(second):
            return first
        if key == 'type':
            first_types = types_of({'type': first}, False)
            common = sorted(first_types & types_of({'type': second}, False))
            if 'number' in common and not ({'number'} <= first_types and {'number'} <= types_of({'type': second},
                                                                                               False)):
                common.remove('number')
            if not common:
                raise Unsatisfiable('allOf: no type is common to {} and {}'.format(first, second))
            return common if len(common) > 1 else common[0]
        if key in ('required', FORBIDDEN):
            return list(first) + [name for name in second if name not in first]
        if key in ('minimum', 'minLength', 'minItems', 'minProperties', 'exclusiveMinimum') and \
                not isinstance(first, bool) and not isinstance(second, bool):
            return max(first, second)
        if key in ('maximum', 'maxLength', 'maxItems', 'maxProperties', 'exclusiveMaximum') and \
                not isinstance(first, bool) and not isinstance(second, bool):
            return min(first, second)
        if key == 'enum':
            common = [value for value in first if canonical(value) in {canonical(v) for v in second}]
            if not common:
                raise Unsatisfiable('allOf: no enum value is common')
            return common
        if key == 'const':
            raise Unsatisfiable('allOf: two different const values')
        if key in ('items', 'propertyNames', 'unevaluatedItems', 'unevaluatedProperties'):
            return combine(first, second)
        if key == 'not':
            return {'anyOf': [first, second]}
        if key == 'uniqueItems':
            return first or second
        if key == 'format':
            return first   # an annotation
        raise CannotMerge(key, 'two different values to merge')

    def merge_properties(self, first: dict, second: dict, out: dict) -> None:
        patterns = [side.get('patternProperties') for side in (first, second)]
        if patterns[0] != patterns[1] and any(patterns):
            other = second if patterns[0] else first
            if other.get('additionalProperties', True) not in (True, {}) or other.get('properties'):
                raise CannotMerge('patternProperties', 'beside properties of another schema')
            out['patternProperties'] = patterns[0] or patterns[1]
        elif patterns[0]:
            out['patternProperties'] = patterns[0]
        names = list(first.get('properties', {})) + [name for name in second.get('properties', {})
                                                      if name not in first.get('properties', {})]
        out['properties'] = {name: combine(self.property_schema(first, name), self.property_schema(second, name))
                             for name in names}
        if 'additionalProperties' in first or 'additionalProperties' in second:
            out['additionalProperties'] = combine(first.get('additionalProperties', True),
                                                   second.get('additionalProperties', True))

    @staticmethod
    def property_schema(node: dict, name: str):
        """Return the schema a node gives a property: declared, patternProperties, else additionalProperties."""
        if name in node.get('properties', {}):
            return node['properties'][name]
        matching = [schema for pattern, schema in node.get('patternProperties', {}).items()
                    if re.search(pattern, name)]
        if matching:
            return matching[0] if len(matching) == 1 else {'allOf': matching}
        return node.get('additionalProperties', True)

    def kinds(self, node, grammar: bool, depth: int = 0) -> set[str]:
        """Return the JSON types a flat node allows (types_of), its alternatives' types joined."""
        alternatives = node.get('anyOf', node.get('oneOf')) if isinstance(node, dict) else None
        if not alternatives or 'type' in node or depth > 8:
            return types_of(node, grammar) if isinstance(node, dict) else set(ALL_TYPES) | {'integer'}
        found: set[str] = set()
        for branch in alternatives:
            branch = self.flat(branch, '$')
            found |= self.kinds(branch, grammar, depth + 1) if isinstance(branch, dict) else (
                set(ALL_TYPES) | {'integer'} if branch else set())
        return found
