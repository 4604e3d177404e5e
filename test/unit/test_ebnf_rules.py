"""Barren EBNF rules (engine/logits/ebnf_rules.py): rules that derive no finite text, read from xgrammar's form."""

import pytest
import xgrammar

from gemma_spec_ros.engine.logits.ebnf_rules import barren_rules, ebnf_grammar


def barren(ebnf: str) -> list[str]:
    return barren_rules(str(xgrammar.Grammar.from_ebnf(ebnf)))


@pytest.mark.parametrize('ebnf, expected', [
    ('root ::= "a" b\nb ::= b', ['root', 'b']),
    ('root ::= root', ['root']),
    ('root ::= "a" b | "c"\nb ::= b "x"', ['b']),               # root has text ("c"), b can be entered after "a"
    ('root ::= "a" b{0,3}\nb ::= "x\\"y|(" b', ['root', 'b']),  # quotes and bars inside a literal
    ('root ::= "a" c\nc ::= d\nd ::= "e" c', ['root', 'c', 'd']),
    ('root ::= "a" b\nb ::= "x" b | "y"', []),
    ('root ::= ("a" | [0-9]+)* b?\nb ::= "q"{2,3} (= "z")', []),  # repetitions, a lookahead
    ('root ::= "[" (x ("," x)*)? "]"\nx ::= [0-9]+', []),
    ('root ::= "a" | ""', []),
])
def test_barren_rules_are_those_without_finite_text_that_the_root_reaches(ebnf, expected):
    assert barren(ebnf) == expected


def test_a_form_it_does_not_read_says_nothing():
    assert barren_rules('root ::= (("a" b))\nb ::= ((b)) %%% unknown') == []
    assert barren_rules('no rules here') == []


def test_ebnf_grammar_refuses_a_barren_rule_and_compiles_the_rest():
    with pytest.raises(ValueError, match=r"^rule 'b' derives no finite text \(each alternative needs one of them "
                                         r"again\), so decoding could enter one and find no next token$"):
        ebnf_grammar('root ::= "a" b | "c"\nb ::= b "x"')
    assert 'root' in str(ebnf_grammar('root ::= "a" b\nb ::= "x" b | "y"'))
