"""GLM-4.5 and later's output syntax, as its released chat template writes an assistant turn.

Reasoning is ``<think>...</think>``. A call is ``<tool_call>NAME`` followed by ``<arg_key>K</arg_key>`` /
``<arg_value>V</arg_value>`` pairs and ``</tool_call>`` (GLM-4.5/4.6 put a newline after the name and after each
tag; GLM-4.7 and 5 none: both parse). The template writes a string value as it is and anything else as JSON, so
a value is typed by the tool's schema when it names the argument's type.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from colibri.call_grammar import key_value_arguments, text
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


def call_grammar(name: str, parameters: Mapping[str, Any]) -> str:
    """A forced call in GLM-4.5's layout (a newline after the name and after each pair)."""
    def pair(key: str, value: str) -> str:
        return f"{text('<arg_key>' + key + '</arg_key>' + chr(10) + '<arg_value>')} {value} " \
               f"{text('</arg_value>' + chr(10))}"

    args = key_value_arguments(parameters, pair)
    return f"{text('<tool_call>' + name + chr(10))} {args} {text('</tool_call>')}"


SYNTAX = OutputSyntax("<think>", "</think>", (ToolSection("<tool_call>", "</tool_call>", decode_call),),
                      call_grammar)
