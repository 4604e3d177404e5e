"""
`oneOf` told apart for the rewrite (schema_rewrite.py): compiled as an anyOf that means the same.

A value is valid under a oneOf when exactly one alternative accepts it, so alternative A contributes its values
that no other alternative accepts: A and not B and not C... The rewrite writes anyOf of these parts, exactly, where
each part can be written as a schema (`separate`):

- an alternative whose outputs no other accepts stays as it is (`excludes`): other types, values (`enum` /
  `const`) the others refuse, a property it writes (or the other requires) with values the other refuses, a name
  the other forbids, an array of items the other refuses; alternatives that are themselves an anyOf / oneOf are
  read through, and a type list is told apart type by type;
- an object that the other accepts only in part becomes the objects the other refuses (`difference`): one
  alternative per name that tells them apart, with that name written (a name the other forbids or whose values
  it refuses) or left out (a name the other requires). Every other name it writes must be one the other accepts
  as it is written (the same schema, or anything), else it is a gap;
- an array becomes the arrays the other refuses by their items (at least one item) or their length;
- alternatives that accept every value (in draft-04 `const` is no keyword): two of them leave no value valid
  (the oneOf is unsatisfiable), one of them is a gap.

The other alternative is read as the validator reads it (keywords its draft lacks dropped), this one as the
grammar writes it. Whatever cannot be proven is a gap.
"""

from .schema_merge import (
    FORBIDDEN,
    CannotMerge,
    Merging,
    Refused,
    Unsatisfiable,
    canonical,
    negated_required,
    types_of,
)

MAX_PARTS = 16      # the alternatives one oneOf alternative may become
_BASE = {'integer': 'number'}


class _Apart(Exception):
    """The parts cannot be written exactly."""


class Separating(Merging):
    """The oneOf part of schema_rewrite.Rewriter (which gives flat, validator and gap)."""

    def separate(self, branches: list, path: str) -> list:
        """Return the (where, schema) alternatives of an anyOf equal to a oneOf of branches, or them and a gap."""
        flat = []
        for where, branch in branches:
            try:
                flat.append(self.flat(branch, where))
            except Unsatisfiable:
                flat.append(False)
            except (CannotMerge, Refused):
                self.gap('oneOf', path, 'its alternatives could not be told apart')
                return branches
        vacuous = [where for (where, _), node in zip(branches, flat, strict=True) if self.vacuous(node)]
        if len(vacuous) > 1:
            raise Unsatisfiable("'oneOf' at {}: {} and {} accept every value, so none is valid under exactly "
                                'one'.format(path, *vacuous[:2]))
        try:
            if vacuous:
                raise _Apart
            out = []
            for index, (where, branch) in enumerate(branches):
                parts = [flat[index]]
                for other_index, other in enumerate(flat):
                    if other_index != index:
                        parts = [piece for part in parts for piece in self.apart(part, self.validated(other))]
                        if len(parts) > MAX_PARTS:
                            raise _Apart
                out += [(where, branch)] if len(parts) == 1 and parts[0] is flat[index] else [
                    (where, part) for part in parts]
        except _Apart:
            self.gap('oneOf', path, 'its alternatives may overlap; keep them apart with types, a const property or '
                     'required properties')
            return branches
        except (CannotMerge, Unsatisfiable, Refused):
            self.gap('oneOf', path, 'its alternatives could not be told apart')
            return branches
        return out

    def apart(self, one, other) -> list:
        """Return schemas whose outputs are exactly those of one that other refuses; _Apart when not written."""
        if self.excludes(one, other):
            return [one]
        if not isinstance(one, dict) or not isinstance(other, dict):
            raise _Apart
        kinds = {_BASE.get(kind, kind) for kind in self.kinds(one, True)}
        if len(kinds) > 1:
            return [piece for kind in sorted(kinds) for piece in self.apart(restricted(one, kind), other)]
        parts = self.difference(one, other)
        if parts is None:
            raise _Apart
        return parts

    def difference(self, one: dict, other: dict) -> list | None:
        """Return one's outputs that other refuses, for an object or an array of one type; None when not written."""
        kinds = self.kinds(one, True)
        if any(key in one for key in ('anyOf', 'oneOf', 'enum', 'const')) or \
                not set(other) <= {'type', 'properties', 'required', 'additionalProperties', FORBIDDEN, 'items',
                                   'minItems', 'maxItems'}:
            return None
        if kinds == {'array'}:
            return self.array_difference(one, other)
        if kinds != {'object'} or not set(one) <= {'type', 'properties', 'required', 'additionalProperties',
                                                   FORBIDDEN, 'minProperties', 'maxProperties', 'propertyNames'} \
                or one.get('additionalProperties') not in (None, False) or not one.get('properties'):
            return None   # written names: one's declared ones (the grammar's strict mode)
        required, forbidden = set(one.get('required', ())), set(one.get(FORBIDDEN, ()))
        tells: list[dict] = []
        for name, mine in one['properties'].items():
            theirs = self.property_schema(other, name)
            if name in forbidden or mine is False:
                continue
            if theirs is False or self.excludes(self.flat(mine, '$'), self.validated(self.flat(theirs, '$'))):
                tells.append(dict(one, required=list(one.get('required', ())) + [name]))
            elif not (self.vacuous(self.flat(theirs, '$')) or canonical(mine) == canonical(theirs)):
                return None   # a name the other may accept or refuse: not written exactly
        for name in other.get('required', ()):
            if name not in required and name in one['properties'] and name not in forbidden:
                tells.append(dict(one, **{FORBIDDEN: list(one.get(FORBIDDEN, ())) + [name]}))
        for names in negated_required(other):
            if len(names) != 1:
                return None
            if names[0] in one['properties'] and names[0] not in forbidden and names[0] not in required:
                tells.append(dict(one, required=list(one.get('required', ())) + names))
        return [part for part in tells if not set(part.get('required', ())) & set(part.get(FORBIDDEN, ()))]

    def array_difference(self, one: dict, other: dict) -> list | None:
        if not set(one) <= {'type', 'items', 'minItems', 'maxItems'} or 'items' not in one or \
                isinstance(other.get('items'), list) or isinstance(one['items'], list):
            return None
        low, high = one.get('minItems', 0), one.get('maxItems')
        theirs_low, theirs_high = other.get('minItems', 0), other.get('maxItems')
        mine, theirs = self.flat(one['items'], '$'), self.validated(self.flat(other.get('items', True), '$'))
        parts = []
        if theirs_low > low:
            parts.append(dict(one, maxItems=min(theirs_low - 1, high) if high is not None else theirs_low - 1))
        if theirs_high is not None and (high is None or high > theirs_high):
            parts.append(dict(one, minItems=max(low, theirs_high + 1)))
        if self.excludes(mine, theirs):   # any item: the other refuses it; no item: the other's minItems may
            return [dict(one, minItems=max(low, 1))] + ([dict(one, maxItems=0)] if low == 0 < theirs_low else [])
        if self.vacuous(theirs) or canonical(mine) == canonical(theirs):
            return [part for part in parts if part.get('minItems', 0) <= part.get('maxItems', part.get('minItems', 0))]
        return None

    def validated(self, node):
        """Return the node as the validator of the schema's draft reads it: keywords the draft lacks dropped."""
        if not isinstance(node, dict):
            return node
        known = self.validator.VALIDATORS
        return {key: value for key, value in node.items() if key in known or key == FORBIDDEN}

    def vacuous(self, node) -> bool:
        """Tell whether the (flat) node accepts every value, as the validator reads it."""
        return node is True or (isinstance(node, dict) and not self.validated(node))

    def excludes(self, one, other, depth: int = 0) -> bool:
        """No output of one (as the grammar writes it) validates against other (as the validator reads it)."""
        if one is False or other is False:
            return True
        other = self.validated(other)
        if one is True or self.vacuous(other) or depth > 8:
            return False
        for key in ('anyOf', 'oneOf'):   # read through alternatives: each apart, or the keywords beside them
            if key in one:
                rest = {name: value for name, value in one.items() if name != key}
                if (rest and self.excludes(rest, other, depth + 1)) or all(
                        self.excludes(self.flat(branch, '$'), other, depth + 1) for branch in one[key]):
                    return True
            if key in other:
                rest = {name: value for name, value in other.items() if name != key}
                if (rest and self.excludes(one, rest, depth + 1)) or all(
                        self.excludes(one, self.flat(branch, '$'), depth + 1) for branch in other[key]):
                    return True
        if any(key in one for key in ('anyOf', 'oneOf')) or any(key in other for key in ('anyOf', 'oneOf')):
            return False
        one_types, other_types = self.kinds(one, True), self.kinds(other, False)
        if not one_types & other_types:
            return True
        common = {_BASE.get(kind, kind) for kind in one_types & other_types}
        if len(common) > 1 and not ('const' in one or 'enum' in one):   # type by type
            return all(self.excludes(restricted(one, kind), other, depth + 1) for kind in sorted(common))
        if 'const' in one or 'enum' in one:
            check = self.validator.evolve(schema=other)
            return not any(check.is_valid(value) for value in ([one['const']] if 'const' in one else one['enum']))
        if 'const' in other or 'enum' in other:   # one's outputs are none of the values other allows
            check = self.validator.evolve(schema=one)
            return not any(check.is_valid(value) for value in ([other['const']] if 'const' in other else other['enum']))
        if one_types <= {'array'} and one.get('minItems', 0) >= 1 and isinstance(one.get('items'), dict) and \
                isinstance(other.get('items'), dict) and not other.get('prefixItems') and not one.get('prefixItems'):
            return self.excludes(self.flat(one['items'], '$'), self.flat(other['items'], '$'), depth + 1)
        if one_types != {'object'}:
            return False
        return self.objects_apart(one, other, depth)

    def objects_apart(self, one: dict, other: dict, depth: int) -> bool:
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
            if name in required and mine is not True and theirs is not True and \
                    self.excludes(mine, self.flat(theirs, '$'), depth + 1):
                return True   # always written, with values other refuses
            if isinstance(mine, dict) and ('const' in mine or 'enum' in mine) and theirs is not True:
                values = [mine['const']] if 'const' in mine else mine['enum']
                if not any(self.validator.evolve(schema=theirs).is_valid(value) for value in values):
                    return True   # written, one's values fail other's; or (other requires it) not written
        return False


def restricted(node: dict, kind: str) -> dict:
    """Return the node's values of one JSON type ('number' with its integers)."""
    if 'const' in node or 'enum' in node:
        values = [node['const']] if 'const' in node else node['enum']
        kept = [value for value in values if _BASE.get(types_of({'const': value}, False).pop(), None) == kind
                or kind in types_of({'const': value}, False)]
        return dict({key: value for key, value in node.items() if key not in ('const', 'enum')}, enum=kept)
    declared = node.get('type')
    if declared is None:
        return dict(node, type=kind)
    declared = declared if isinstance(declared, list) else [declared]
    kept = [name for name in declared if _BASE.get(name, name) == kind]
    return dict(node, type=kept[0] if len(kept) == 1 else kept)
