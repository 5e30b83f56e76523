"""The grammar of a forced tool call (``tool_choice: required`` or a named function), in the family's own syntax.

A family's :class:`~colibri.output_parser.OutputSyntax` may carry ``call_grammar(name, parameters)``: the llguidance
Lark expression of one call of that function, in the syntax its parser reads back. It builds it from the pieces
here: literal text, an embedded JSON schema (compact, no free whitespace) and, for syntaxes that write arguments
as key/value pairs, :func:`key_value_arguments`. Core joins one alternative per allowed function; the reply is
exactly one call, then the end of the turn.

A reply that would start inside an open reasoning block (the prompt opened it) closes it at once: an untrained or
undecided model might otherwise think until ``max_tokens`` and never call anything.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

MAX_TEXT_ARGUMENT = 64   # characters of a bare-text argument whose schema sets no maxLength


def text(literal: str) -> str:
    """A Lark string literal (JSON's escapes are Lark's)."""
    return json.dumps(literal, ensure_ascii=False)


def json_value(schema: Mapping[str, Any]) -> str:
    """An embedded JSON value of ``schema``, written compactly."""
    return "%json " + json.dumps({"x-guidance": {"whitespace_flexible": False}, **schema}, ensure_ascii=False)


def arguments_schema(parameters: Mapping[str, Any] | None) -> dict[str, Any]:
    """A tool's ``parameters`` as the schema of its arguments object: only the declared properties unless the
    schema itself allows others (a forced call names what the tool takes, nothing invented)."""
    schema = dict(parameters or {"type": "object"})
    schema.setdefault("type", "object")
    schema.setdefault("additionalProperties", False)
    return schema


def key_value_arguments(parameters: Mapping[str, Any] | None, pair: Callable[[str, str], str]) -> str:
    """Arguments written one pair at a time (GLM's ``<arg_key>``/``<arg_value>``): ``pair(key, value)`` gives a
    pair's expression from the key's literal and the value's expression. Required properties come first, in the
    schema's order, then each optional one may follow; a string value is bare text without ``<``, anything else
    JSON of its schema."""
    props = dict((parameters or {}).get("properties") or {})
    required = [k for k in (parameters or {}).get("required") or [] if k in props]
    parts = []
    for key in required + [k for k in props if k not in required]:
        schema = props[key] if isinstance(props[key], Mapping) else {}
        if schema.get("type") == "string" and "enum" not in schema:
            value = "/[^<]{0,%d}/" % int(schema.get("maxLength", MAX_TEXT_ARGUMENT))
        else:
            value = json_value(schema)
        expr = pair(key, value)
        parts.append(expr if key in required else f"({expr})?")
    return " ".join(parts)


def forced_call_grammar(call_grammar: Callable[[str, Mapping[str, Any]], str], tools: Sequence[Mapping[str, Any]],
                        only: str | None, close_reasoning: str | None) -> str:
    """The Lark grammar of a reply that is one call to one of ``tools`` (``only``: that function alone)."""
    alternatives = []
    for tool in tools:
        function = tool.get("function", {})
        if only is not None and function.get("name") != only:
            continue
        alternatives.append(call_grammar(function["name"], arguments_schema(function.get("parameters"))))
    lead = f"{text(close_reasoning)} " if close_reasoning else ""
    rules = [f"start: {lead}call", "call: " + " | ".join(f"c{i}" for i in range(len(alternatives)))]
    rules += [f"c{i}: {body}" for i, body in enumerate(alternatives)]
    return "\n".join(rules) + "\n"
