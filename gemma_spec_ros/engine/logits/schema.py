"""
JSON Schema goals whose results can be trusted: what the grammar enforces, what it cannot, and the final check.

A `json_schema` is read once per (text, policy) by `prepare`: checked against its metaschema, rewritten into the
forms xgrammar 0.2.8 enforces (schema_rewrite.py), and every keyword the grammar still cannot enforce is a `Gap`.
The request field `json_schema_unenforced` chooses what a gap does:

- 'refuse' (the default, also ''): the goal is refused with a ValueError naming `json_schema`, the keyword and its
  schema path;
- 'check': the goal runs on a grammar without the keyword, its result carries an UNENFORCED_KEYWORD warning naming
  it, and the output is validated at the end.

The local engine reads schemas with `tracked`: the uniqueItems arrays its tracker keeps distinct beside the grammar
(schema_unique.py, unique_tracker.py) are no gaps there; the vLLM backend runs xgrammar alone, so they are.

At the end of every json_schema goal, `check_output` validates the text with the `jsonschema` validator of the
draft the schema declares (`OutputCheck`, built once per schema): `structure_complete` is true only when the grammar
completed AND the output validates; a completed but invalid output gets a SCHEMA_VIOLATION warning that names the
failing path and keyword. Free grammars and tool calls are not checked here (tool-call arguments are checked with
their tools).

`bound_numbers` rewrites the number rules of xgrammar's JSON grammar so that a number has at most N digits before
its decimal point and F after it (the engine's json_integer_digits / json_fraction_digits): a model that would write
-1.0000000000... until its budget ends has to end the number. It is only a grammar, so the constrained distribution
stays exact.
"""

import functools
import json
import re
from dataclasses import dataclass

import jsonschema

from ..types import GenerationWarning, WarningKind
from . import schema_unique
from .schema_rewrite import Gap, Refused, Rewriter

JSON_SCHEMA = 'json_schema'
UNENFORCED_FIELD = 'json_schema_unenforced'
REFUSE, CHECK = 'refuse', 'check'
POLICIES = (REFUSE, CHECK)
_NOT_ENFORCED = '{}: {} is not enforced by the grammar engine'
_CACHE = 64


def check_policy(policy: str) -> str:
    """Return the policy of a request's json_schema_unenforced ('' means refuse); ValueError naming the field."""
    if not isinstance(policy, str) or policy not in POLICIES + ('',):
        raise ValueError('{} must be one of {} (\'\' = refuse), got {!r}'.format(UNENFORCED_FIELD, '|'.join(POLICIES),
                                                                                 policy))
    return policy or REFUSE


@dataclass(frozen=True)
class PreparedSchema:
    """A json_schema as the grammar engine gets it, and the keywords it leaves to the final check."""

    grammar_text: str          # the rewritten schema (JSON text) for xgrammar
    gaps: tuple[Gap, ...]      # keywords the grammar does not enforce (empty unless the policy is 'check')
    unique: 'schema_unique.Plan | None' = None   # tracked uniqueItems arrays (a tracker enforces them)


def parse_schema(text: str) -> dict:
    """Return a json_schema field checked against the metaschema of its draft; ValueError names the path."""
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError('{}: not valid JSON: {}'.format(JSON_SCHEMA, exc)) from exc
    if not isinstance(schema, dict):   # true/false are schemas too, but say nothing a grammar can hold to
        raise ValueError('{}: a JSON Schema must be a JSON object, got {} (use {{}} for any JSON value)'.format(
            JSON_SCHEMA, json.dumps(schema)[:40]))
    cls = jsonschema.validators.validator_for(schema)
    try:
        cls.check_schema(schema)
    except jsonschema.SchemaError as exc:
        path = ''.join('[{}]'.format(part) if isinstance(part, int) else '.{}'.format(part)
                       for part in exc.absolute_path)
        raise ValueError('{}: {} at ${}'.format(JSON_SCHEMA, exc.message, path)) from exc
    if cls is jsonschema.Draft3Validator:
        raise ValueError('{}: draft-03 schemas are not supported; declare draft-04 or later in $schema'.format(
            JSON_SCHEMA))
    _check_integers(schema)
    return schema


INT64 = (-2 ** 63, 2 ** 63 - 1)   # xgrammar reads a schema's integers as int64 (and fails without a message past it)


def _check_integers(schema: dict) -> None:
    """Refuse an integer beyond int64 anywhere in the schema (a bound, a length, an enum value, a default)."""
    stack = [(schema, '$')]
    while stack:
        item, path = stack.pop()
        if isinstance(item, dict):
            stack += [(value, '{}.{}'.format(path, key)) for key, value in item.items()]
        elif isinstance(item, list):
            stack += [(value, '{}[{}]'.format(path, index)) for index, value in enumerate(item)]
        elif isinstance(item, int) and not isinstance(item, bool) and not INT64[0] <= item <= INT64[1]:
            raise ValueError('{}: the integer at {} has {} digits; the grammar engine reads integers of at most '
                             '19 (from {} to {})'.format(JSON_SCHEMA, path, len(str(abs(item))), *INT64))


@functools.lru_cache(maxsize=_CACHE)
def prepare(text: str, policy: str = REFUSE, tracked: bool = False) -> PreparedSchema:
    """
    Read a json_schema for the grammar engine; ValueError names the field, and a refused keyword with its path.

    Raised whatever the policy: a schema no value satisfies, and a reference or pattern the validator cannot read.
    tracked: the caller runs a uniqueItems tracker (unique_tracker.py, the local engine): the arrays whose items
    it can keep distinct are no gaps (PreparedSchema.unique); without it they are.
    """
    policy = check_policy(policy)
    schema = parse_schema(text)
    cls = jsonschema.validators.validator_for(schema)
    try:
        rewriter = Rewriter(schema, cls, track=tracked)
        rewritten, plan = rewriter.rewrite(), None
        if tracked and rewriter.deferred:
            plan, untracked = schema_unique.plan(rewritten, rewriter.deferred)
            enumerable = frozenset(path for path, _ in untracked) & rewriter.enumerable
            if enumerable:   # the tracker cannot keep them: their items' subsets, as without a tracker
                rewriter = Rewriter(schema, cls, track=True, enumerate_at=enumerable)
                rewritten = rewriter.rewrite()
                plan, untracked = schema_unique.plan(rewritten, rewriter.deferred)
            tracked_paths = {path for _, path in rewriter.deferred} - {path for path, _ in untracked}
            rewriter.gaps = [gap for gap in rewriter.gaps
                             if gap.keyword != 'uniqueItems' or gap.path not in tracked_paths]
    except Refused as exc:
        raise ValueError('{}: {}'.format(JSON_SCHEMA, exc)) from None
    if rewriter.gaps and policy == REFUSE:
        raise ValueError((_NOT_ENFORCED + "; remove it, or set {} to '{}' to generate without it and validate the "
                          'output at the end').format(JSON_SCHEMA, rewriter.gaps[0].describe(), UNENFORCED_FIELD,
                                                      CHECK))
    return PreparedSchema(json.dumps(rewritten), tuple(rewriter.gaps), plan)


class OutputCheck:
    """The validator of one json_schema (its declared draft) and the gaps its grammar left; thread-safe."""

    def __init__(self, text: str, gaps: tuple[Gap, ...] = ()):
        schema = json.loads(text)
        self.validator = jsonschema.validators.validator_for(schema)(schema)
        self.gaps = gaps

    def violation(self, text: str) -> str:
        """Why text fails the schema ('' when it validates): the first failing path, keyword and message."""
        try:
            instance = json.loads(text)
        except json.JSONDecodeError as exc:
            return 'the output is not JSON ({})'.format(exc)
        error = jsonschema.exceptions.best_match(self.validator.iter_errors(instance))
        if error is None:
            return ''
        return '{} fails {!r} at {} ({})'.format(error.json_path, error.validator, _schema_path(error),
                                                 error.message[:200])


def _schema_path(error) -> str:
    return '$' + ''.join('[{}]'.format(part) if isinstance(part, int) else '.{}'.format(part)
                         for part in error.absolute_schema_path)


@functools.lru_cache(maxsize=_CACHE)
def output_check(text: str, policy: str = '', tracked: bool = False) -> OutputCheck | None:
    """Return the final check of a json_schema (cached; None for ''); ValueError as `prepare` raises it."""
    return OutputCheck(text, prepare(text, check_policy(policy), tracked).gaps) if text else None


def check_output(check: OutputCheck | None, text: str, complete: bool,
                 warnings: list[GenerationWarning]) -> bool:
    """
    Validate a json_schema goal's output once, at its end: return its structure_complete; warnings gets the news.

    complete: the grammar completed (and no stop string cut the text). The gaps of a 'check' goal are named in
    UNENFORCED_KEYWORD warnings; a completed output that fails the schema gets a SCHEMA_VIOLATION warning and is
    not complete. check None (no json_schema): complete as it is.
    """
    if check is None:
        return complete
    warnings.extend(GenerationWarning(WarningKind.UNENFORCED_KEYWORD, (
        _NOT_ENFORCED + '; the output was validated at the end').format(JSON_SCHEMA, gap.describe()))
        for gap in check.gaps)
    if not complete:
        return False
    violation = check.violation(text)
    if violation:
        warnings.append(GenerationWarning(WarningKind.SCHEMA_VIOLATION, 'schema violation: the output completed '
                                          'the grammar but {}: structure_complete is false'.format(violation)))
    return not violation


# xgrammar 0.2.8's JSON numbers (rule text as it prints them): the integer part, fraction and exponent
_INTEGER_PART = re.compile(r'\[1-9\] (\[0-9\]\*|(\w+)\{(\d+), -1\})')
_FRACTION = re.compile(r'"\." (\w+)\{(\d+), (-1|\d+)\}')
_EXPONENT = re.compile(r'(\[eE\] \w+ )(\w+)\{1, -1\}')
_DIGIT_RULE = re.compile(r'^(\w+) ::= \(\(\[0-9\]\)\)$', re.MULTILINE)
EXPONENT_DIGITS = 3


def bound_numbers(ebnf: str, integer_digits: int, fraction_digits: int) -> str:
    """
    Bound the digits of the JSON numbers of a grammar that xgrammar wrote for a JSON Schema (0 = no bound).

    integer_digits bounds the integer part (a leading digit 1-9, then digits), fraction_digits the digits after
    the point; with either set, an exponent has at most 3 digits. Bounds never drop below a schema's own: a
    repetition {n, -1} becomes {n, max(n, bound)}.
    """
    digits = set(_DIGIT_RULE.findall(ebnf))

    def integer(match: re.Match) -> str:
        if match.group(2) is None:
            return '[1-9] [0-9]{{0, {}}}'.format(integer_digits - 1)
        if match.group(2) not in digits:
            return match.group(0)
        low = int(match.group(3))
        return '[1-9] {}{{{}, {}}}'.format(match.group(2), low, max(low, integer_digits - 1))

    def fraction(match: re.Match) -> str:
        rule, low, high = match.group(1), int(match.group(2)), int(match.group(3))
        if rule not in digits or high >= 0:   # a schema's range bounds its own fractions already
            return match.group(0)
        return '"." {}{{{}, {}}}'.format(rule, low, max(low, fraction_digits))

    if integer_digits:
        ebnf = _INTEGER_PART.sub(integer, ebnf)
    if fraction_digits:
        ebnf = _FRACTION.sub(fraction, ebnf)
    if integer_digits or fraction_digits:
        ebnf = _EXPONENT.sub(lambda match: '{}{}{{1, {}}}'.format(match.group(1), match.group(2), EXPONENT_DIGITS)
                             if match.group(2) in digits else match.group(0), ebnf)
    return ebnf
