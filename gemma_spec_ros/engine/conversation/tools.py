"""
Tools a planner offers the model, and the model's calls in Gemma 4's own syntax.

    <|tool_call>call:pick{object:<|"|>red cup<|"|>,count:2,gentle:true}<tool_call|>

Values are written as Gemma 4's chat template writes them (its `format_argument`): a string between two quote
tokens, its text literal (no escapes, so it can never hold the quote token); true, false, null; numbers as JSON
writes them; objects with bare keys; arrays. No whitespace anywhere.

`call_grammar` turns the tools' JSON Schemas into an EBNF grammar (xgrammar's syntax) of one call body, so that a
constrained call always names a tool and always carries arguments valid under its schema. Whatever the grammar
cannot enforce exactly is refused when the tools arrive (`parse_tools`), never silently loosened: a call the
planner cannot run is worse than an error up front. The grammar may be narrower than the schema (never wider):

- object keys come in the schema's property order, and only declared properties are allowed: additionalProperties
  counts as false wherever `properties` is given (the model must only use parameters the tool declares);
- an enum or const is written exactly as `format_value` writes its values (1.0 stays 1.0, not 1);
- an integer is written without fraction or exponent;
- oneOf is enforced as anyOf: keep its alternatives disjoint (a value matching two of them would be invalid).

Pure Python: the request rules and both backends read it; the token masks live in logits.
"""

import json
from dataclasses import dataclass, field

import jsonschema

from .syntax import (  # noqa: F401 (the syntax's names, for the callers of tools)
    CALL_PREFIX,
    KEY_PATTERN,
    NAME_PATTERN,
    QUOTE_CHAR,
    call_arguments,
    format_call,
    format_value,
    json_type,
    parse_call,
    read_json,
    schema_path,
    tool_result,
)
from .tool_grammar import call_grammar, check_enforceable  # noqa: F401

AUTO, NONE, REQUIRED = 'auto', 'none', 'required'
TOOL_CHOICES = (AUTO, NONE, REQUIRED)   # or a tool's name
_TOOL_FIELDS = ('name', 'description', 'parameters', 'strict')   # strict: OpenAI's flag; always enforced here
_WRAPPER_FIELDS = ('type', 'function')


def _no_parameters() -> dict:
    """Return the parameters of a tool that takes none: an empty object."""
    return {'type': 'object', 'properties': {}}


@dataclass(frozen=True)
class ToolSpec:
    """
    A tool the model may call: its name, what it does, and a JSON Schema of its arguments (an object).

    parameters is left out of the hash (a dict); treat it as read-only.
    """

    name: str
    description: str = ''
    parameters: dict = field(default_factory=_no_parameters, hash=False)


# --- the planner's tools ---------------------------------------------------------------------------------------


def parse_tools(text: str) -> tuple[ToolSpec, ...]:
    """
    Read a request's tools (JSON text of a list); '' is no tools. ValueError names the field at fault.

    A tool is {name, description, parameters} or OpenAI's {"type": "function", "function": {...}}.

    Each tool's schema is checked (jsonschema) and compiled to its grammar here, so that a schema the tool-call
    grammar cannot enforce is refused with the request, not when the model calls the tool.
    """
    if not isinstance(text, str):
        raise ValueError('tools must be a string (JSON text of a list), got {}'.format(type(text).__name__))
    if not text.strip():
        return ()
    items = read_json(text, 'tools')
    if not isinstance(items, list):
        raise ValueError('tools must be a JSON list of tools, got {}'.format(json_type(items)))
    tools: list[ToolSpec] = []
    seen: dict[str, int] = {}
    for index, item in enumerate(items):
        tool = _parse_tool(item, 'tools[{}]'.format(index))
        if tool.name in seen:
            raise ValueError('tools[{}].name: duplicate name "{}" (also tools[{}])'.format(
                index, tool.name, seen[tool.name]))
        seen[tool.name] = index
        check_enforceable(tool, 'tools[{}]'.format(index))  # refuses what it cannot do
        tools.append(tool)
    return tuple(tools)


def _parse_tool(item, field_name: str) -> ToolSpec:
    if not isinstance(item, dict):
        raise ValueError('{} must be an object (a tool), got {}'.format(field_name, json_type(item)))
    if 'function' in item or 'type' in item:   # OpenAI's wrapper
        _check_fields(item, _WRAPPER_FIELDS, field_name)
        if item.get('type') != 'function':
            raise ValueError('{}.type must be "function", got {}'.format(field_name, json.dumps(item.get('type'))))
        item = item.get('function')
        if not isinstance(item, dict):
            raise ValueError('{}.function must be an object (the tool), got {}'.format(field_name, json_type(item)))
    _check_fields(item, _TOOL_FIELDS, field_name)
    name = item.get('name')
    if name is None:
        raise ValueError('{}.name: missing (every tool needs a name)'.format(field_name))
    if not isinstance(name, str):
        raise ValueError('{}.name must be a string, got {}'.format(field_name, json_type(name)))
    if not NAME_PATTERN.fullmatch(name):
        raise ValueError('{}.name: "{}" is not a tool name (a letter or _, then letters, digits, _ . -)'.format(
            field_name, name))
    if name in TOOL_CHOICES:
        raise ValueError('{}.name: "{}" is reserved (a tool_choice value)'.format(field_name, name))
    description = item.get('description', '')
    if not isinstance(description, str):
        raise ValueError('{}.description must be a string, got {}'.format(field_name, json_type(description)))
    parameters = item.get('parameters')
    if parameters is None or parameters == {}:
        parameters = _no_parameters()
    _check_parameters(parameters, '{}.parameters'.format(field_name))
    return ToolSpec(name, description, parameters)


def _check_fields(item: dict, known: tuple[str, ...], field_name: str) -> None:
    """Refuse unknown fields: a misspelt one ('parameter') would silently give a tool without arguments."""
    for key in item:
        if key not in known:
            raise ValueError('{}: unknown field "{}" (known: {})'.format(field_name, key, ', '.join(known)))


def _check_parameters(parameters, field_name: str) -> None:
    if not isinstance(parameters, dict):
        raise ValueError('{} must be a JSON Schema of an object, got {}'.format(field_name, json_type(parameters)))
    try:
        jsonschema.validators.validator_for(parameters).check_schema(parameters)
    except jsonschema.SchemaError as exc:
        raise ValueError('{}: {} at {}'.format(field_name, exc.message, schema_path(exc.absolute_path))) from exc
    if not (parameters.get('type') == 'object' or ('type' not in parameters and 'properties' in parameters)):
        raise ValueError('{} must be the schema of an object (type "object" or properties): the arguments of a call '
                         'are an object'.format(field_name))


def check_tool_choice(choice: str, tools: tuple[ToolSpec, ...]) -> str:
    """
    Return the tool choice to use: 'auto', 'none', 'required' or a tool's name; ValueError 'tool_choice: ...'.

    '' is 'auto' with tools and 'none' without; 'auto' without tools is 'none' too (there is nothing to call).
    """
    if not isinstance(choice, str):
        raise ValueError('tool_choice must be a string, got {}'.format(type(choice).__name__))
    names = [tool.name for tool in tools]
    if choice in ('', AUTO):
        return AUTO if tools else NONE
    if choice == NONE:
        return NONE
    if not tools:
        what = '"required"' if choice == REQUIRED else 'a tool ("{}")'.format(choice)
        raise ValueError('tool_choice: {} needs tools, and the request has none'.format(what))
    if choice == REQUIRED or choice in names:
        return choice
    raise ValueError('tool_choice: no tool is named "{}" (tools: {}); use {} or a tool\'s name'.format(
        choice, ', '.join(names), ', '.join(TOOL_CHOICES)))


def check_history_call(call, field_name: str) -> None:
    """Check an earlier assistant turn's call ({name, arguments[, id]}); ValueError names the field."""
    if not isinstance(call, dict) or not isinstance(call.get('name'), str):
        raise ValueError('{} needs a string "name" and "arguments" (JSON object text), got {!r}'.format(
            field_name, call))
    if not NAME_PATTERN.fullmatch(call['name']):
        raise ValueError('{}.name: {!r} is not a tool name (letters, digits, _ . -, not first a digit)'.format(
            field_name, call['name']))
    call_arguments(call.get('arguments', ''), field_name + '.arguments')


def validate_arguments(tool: ToolSpec, arguments: dict) -> None:
    """ValueError naming the tool and the path when arguments are not valid under the tool's parameters."""
    validator = jsonschema.validators.validator_for(tool.parameters)(tool.parameters)
    error = jsonschema.exceptions.best_match(validator.iter_errors(arguments))
    if error is not None:
        raise ValueError('call of {}: arguments: {} at {}'.format(tool.name, error.message,
                                                                 schema_path(error.absolute_path)))

