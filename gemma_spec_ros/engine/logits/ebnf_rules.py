"""
The rules of a compiled EBNF grammar that derive no text: decoding that enters one finds no token, not even the end.

xgrammar 0.2.8 compiles `root ::= "a" b` with `b ::= b` and lets "a" through; after it the mask is empty. The check
reads the grammar as xgrammar prints it once normalized (`str(xgrammar.Grammar)`: one rule per line, alternatives
of sequences, repetitions split into rules of their own), finds the rules that derive no finite text (a fixpoint
over the alternatives) and names those the root can reach. That printed form is xgrammar's, not a public
format: a line it does not read makes the check say nothing (the first-token check in grammar.py still runs).
"""

import re

_TOKEN = re.compile(r'''
    \s*(?:
      (?P<literal>"(?:[^"\\]|\\.)*")
    | (?P<cls>\[(?:[^\]\\]|\\.)*\]\*?)
    | (?P<name>[A-Za-z_][A-Za-z0-9_]*)(?P<repeat>\{\s*\d+\s*(?:,\s*-?\d*\s*)?\})?
    | (?P<punct>[()|])
    )''', re.VERBOSE)


class _Unread(Exception):
    """A printed rule in a form this module does not read."""


def _alternatives(body: str) -> list[list[str]]:
    """Return a rule body's alternatives, each the rule names it refers to; '' stands for a terminal."""
    alternatives, current, depth, at = [], [], 0, 0
    while at < len(body):
        match = _TOKEN.match(body, at)
        if not match or match.end() == at:
            if body[at:].strip():
                raise _Unread(body[at:])
            break
        at = match.end()
        punct = match.group('punct')
        if punct == '(':
            depth += 1
            if depth > 2:   # a group inside a sequence: not in the printed form this reads
                raise _Unread(body)
        elif punct == ')':
            depth -= 1
        elif punct == '|':
            if depth != 1:
                raise _Unread(body)
            alternatives.append(current)
            current = []
        else:
            current.append(match.group('name') or '')
    if depth != 0:
        raise _Unread(body)
    return alternatives + [current]


def _rules(printed: str) -> dict[str, list[list[str]]]:
    rules = {}
    for line in filter(None, printed.splitlines()):
        name, separator, body = line.partition(' ::= ')
        if not separator:
            raise _Unread(line)
        body = re.sub(r'\s*\(=.*\)$', '', body)   # a lookahead after the body: it adds no text of its own
        rules[name] = _alternatives(body)
    return rules


def barren_rules(printed: str, root: str = 'root') -> list[str]:
    """Return the rules the root reaches that derive no finite text, nearest first ([] also when not read)."""
    try:
        rules = _rules(printed)
    except _Unread:
        return []
    if root not in rules or any(name and name not in rules for alts in rules.values() for alt in alts
                                for name in alt):
        return []
    fertile: set[str] = set()
    grown = True
    while grown:
        grown = False
        for name, alternatives in rules.items():
            if name not in fertile and any(all(not ref or ref in fertile for ref in alt) for alt in alternatives):
                fertile.add(name)
                grown = True
    seen, order = {root}, [root]
    for name in order:   # breadth first from the root
        for ref in (ref for alt in rules[name] for ref in alt if ref and ref not in seen):
            seen.add(ref)
            order.append(ref)
    return [name for name in order if name not in fertile]


def ebnf_grammar(text: str):
    """Return xgrammar's grammar of EBNF text; ValueError when the root reaches a barren rule (the caller names it)."""
    import xgrammar

    grammar = xgrammar.Grammar.from_ebnf(text)
    barren = barren_rules(str(grammar))
    if barren:
        raise ValueError("rule{} {} derive{} no finite text (each alternative needs one of them again), so decoding "
                         'could enter one and find no next token'.format(
                             's' if len(barren) > 1 else '', ', '.join(repr(name) for name in barren),
                             's' if len(barren) == 1 else ''))
    return grammar
