"""GLM-4.5 and later's output syntax, as its released chat template writes an assistant turn.

Reasoning is ``<think>...</think>``. A call is ``<tool_call>NAME`` followed by ``<arg_key>K</arg_key>`` /
``<arg_value>V</arg_value>`` pairs and ``</tool_call>`` (GLM-4.5/4.6 put a newline after the name and after each
tag; GLM-4.7 and 5 none: both parse). The template writes a string value as it is and anything else as JSON, so
a value is typed by the tool's schema when it names the argument's type.
"""

from __future__ import annotations

from colibri.output_parser import (
    OutputSyntax, ToolCall, ToolSchemas, ToolSection, argument_value, dump_arguments, pairs,
)


def decode_call(body: str, schemas: ToolSchemas) -> list[ToolCall] | None:
    name, sep, rest = body.partition("<arg_key>")
    name = name.strip()
    if not name or "<" in name:
        return None
    found = pairs(sep + rest, "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")
    if found is None:
        return None
    args = {key: argument_value(value, name, key, schemas) for key, value in found}
    return [ToolCall(name, dump_arguments(args))]


SYNTAX = OutputSyntax("<think>", "</think>", (ToolSection("<tool_call>", "</tool_call>", decode_call),))
