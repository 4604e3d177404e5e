"""
Merging JSON Schemas for the rewrite (schema_rewrite.py), and telling oneOf alternatives apart.

`allOf` and a `$ref`'s siblings become one schema.

A merge is the conjunction of two schemas written as one: types intersected, properties combined name by name
(a name one schema leaves to its additionalProperties or patternProperties gets that schema), `required` joined,
bounds tightened, enums intersected. A keyword that resists (two different patterns, conditionals, ...) raises
CannotMerge, which the rewrite reports as a gap; a conjunction nothing satisfies raises Unsatisfiable.

`oneOf` is compiled as `anyOf`, so its alternatives must exclude each other as the grammar writes them: by type,
by enumerated values, by a property one requires that another never writes or forbids, or by a property whose
values differ. An object alternative that may write a name another requires is narrowed to leave it out.
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
    """The merging and oneOf half of schema_rewrite.Rewriter (which gives flat, validator and gap)."""

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

    def separate(self, branches: list, path: str) -> list:
        """
        Return oneOf alternatives whose outputs validate against no other one, or the alternatives and a gap.

        Where an alternative's outputs could validate against another, it is narrowed (`narrowed`).
        """
        try:
            flat = [self.flat(branch, where) for where, branch in branches]
            original = list(flat)
            for i in range(len(flat)):
                for j, other in enumerate(original):   # the validator reads the alternatives as they are
                    if i == j or self.excludes(flat[i], other):
                        continue
                    narrowed = self.narrowed(flat[i], other)
                    if narrowed is None:
                        self.gap('oneOf', path, 'its alternatives may overlap; keep them apart with types, a const '
                                 'property or required properties')
                        return branches
                    flat[i] = narrowed
        except (CannotMerge, Unsatisfiable, Refused):
            self.gap('oneOf', path, 'its alternatives could not be told apart')
            return branches
        return [(where, narrowed if narrowed is not unchanged else branch) for (where, branch), narrowed, unchanged
                in zip(branches, flat, original, strict=True)]

    def narrowed(self, one, other) -> dict | None:
        """
        Return one narrowed so that no output of it validates against other, or None.

        An object that may write a name other requires leaves it out; one that may write a name other forbids
        writes it always; an array has at least one item (when their items exclude each other).
        """
        if not isinstance(one, dict) or not isinstance(other, dict):
            return None
        kinds = self.kinds(one, True)
        if kinds == {'object'}:
            closed = one.get('additionalProperties') in (None, False) and not one.get('patternProperties') and \
                bool(one.get('properties') or one.get('required'))
            required = set(one.get('required', ()))
            for name in other.get('required', ()):
                if name not in required and closed:
                    candidate = dict(one, **{FORBIDDEN: list(one.get(FORBIDDEN, ())) + [name]})
                    if self.excludes(candidate, other):
                        return candidate
            for name, subschema in one.get('properties', {}).items():
                if name not in required and subschema is not False and self.property_schema(other, name) is False:
                    candidate = dict(one, required=list(one.get('required', ())) + [name])
                    if self.excludes(candidate, other):
                        return candidate
        if kinds == {'array'} and one.get('minItems', 0) < 1:
            candidate = dict(one, minItems=1)
            if self.excludes(candidate, other):
                return candidate
        return None

    def excludes(self, one, other) -> bool:
        if one is False or other is False:
            return True
        if one is True or other is True:
            return False
        one_types, other_types = self.kinds(one, True), self.kinds(other, False)
        if not one_types & other_types:
            return True
        if 'const' in one or 'enum' in one:
            check = self.validator.evolve(schema=other)
            return not any(check.is_valid(value) for value in ([one['const']] if 'const' in one else one['enum']))
        if 'const' in other or 'enum' in other:   # one's outputs are none of the values other allows
            check = self.validator.evolve(schema=one)
            return not any(check.is_valid(value) for value in ([other['const']] if 'const' in other else other['enum']))
        if one_types == {'array'} and one.get('minItems', 0) >= 1 and isinstance(one.get('items'), dict) and \
                isinstance(other.get('items'), dict) and not other.get('prefixItems') and not one.get('prefixItems'):
            return self.excludes(self.flat(one['items'], '$'), self.flat(other['items'], '$'))
        if one_types != {'object'}:
            return False
        required, theirs_required = set(one.get('required', ())), set(other.get('required', ()))
        declared = set(one.get('properties', {})) | required
        extra = one.get('additionalProperties', one.get('unevaluatedProperties')) not in (None, False) or bool(
            one.get('patternProperties')) or not declared
        unwritten = {name for names in negated_required(one) for name in names} - required
        if any(set(names) <= required for names in negated_required(other)):
            return True   # one always writes names other forbids together
        for name in required | theirs_required:
            theirs = self.property_schema(other, name)
            if name in required and theirs is False:
                return True
            if name in theirs_required and ((name not in declared and not extra) or name in unwritten):
                return True   # other requires a name one never writes
            mine = self.flat(one.get('properties', {}).get(name, True), '$') if name in declared else True
            if isinstance(mine, dict) and ('const' in mine or 'enum' in mine) and theirs is not True:
                values = [mine['const']] if 'const' in mine else mine['enum']
                if not any(self.validator.evolve(schema=theirs).is_valid(value) for value in values):
                    return True   # written, one's values fail other's; or (other requires it) not written
        return False

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
