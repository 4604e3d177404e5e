"""
A vLLM goal's structured output: the grammar the server enforces, and the final check of the server's text.

A goal's json_schema or grammar becomes the EBNF the local engine enforces (logits.grammar.constraint_grammar):
the server gets the grammar text rather than the schema, because its whitespace rule is one per server while a goal
chooses compact or free whitespace, and because one conversion means one set of rules on both backends: the same
rewrite of the schema, the same keywords refused (or left to the final check with json_schema_unenforced check),
the same bounds on numbers' digits. xgrammar (and torch) load at the first constrained goal; the final check
(logits.schema, jsonschema) loads neither.
"""

import functools

from ..logits.schema import OutputCheck, check_output, output_check
from ..types import EngineConfig, GenerationRequest, GenerationResult

__all__ = ['final_check', 'output_grammar', 'structure_complete']


def output_grammar(request: GenerationRequest, config: EngineConfig) -> str:
    """Return the EBNF of a request's json_schema or grammar, as the local engine enforces it ('' if unconstrained)."""
    if not (request.json_schema or request.grammar or request.json_free_whitespace or
            request.json_schema_unenforced):
        return ''
    from ..logits.grammar import constraint_kind

    kind = constraint_kind(request.json_schema, request.grammar, request.json_free_whitespace,
                           request.json_schema_unenforced)
    return _grammar_text(kind, request.json_schema or request.grammar, request.json_free_whitespace,
                         request.json_schema_unenforced, (config.json_integer_digits, config.json_fraction_digits))


@functools.lru_cache(maxsize=64)
def _grammar_text(kind: str, text: str, json_free_whitespace: bool, unenforced: str, digits: tuple) -> str:
    from ..logits.grammar import constraint_grammar

    return str(constraint_grammar(kind, text, json_free_whitespace, unenforced, digits))


def final_check(request: GenerationRequest) -> OutputCheck | None:
    """Return the validator (and unenforced keywords) of a request's json_schema, or None without one."""
    return output_check(request.json_schema, request.json_schema_unenforced)


def structure_complete(check: OutputCheck | None, result: GenerationResult, completed: bool) -> bool:
    """
    Return a result's structure_complete: the grammar completed and, for a json_schema, the text validates.

    Tool calls are not this check's (their arguments are checked with their tools); result.warnings gets the news.
    """
    if result.finish_reason == 'tool_calls':
        return completed
    return check_output(check, result.text, completed, result.warnings)
