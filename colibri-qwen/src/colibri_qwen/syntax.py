"""Qwen3 and Qwen3.5's output syntax, as their released chat templates write an assistant turn.

Reasoning is ``<think>...</think>``. A call is ``<tool_call>...</tool_call>`` holding either a JSON object
``{"name": ..., "arguments": {...}}`` (Qwen3, Qwen3-Next: the Hermes form) or the XML-like form of Qwen3-Coder
and Qwen3.5, ``<function=NAME>`` with ``<parameter=K>\\nV\\n</parameter>`` entries and ``</function>`` (strings
written as they are, anything else as JSON, so the tool's schema types a value when it can).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from colibri.call_grammar import json_value, text
from colibri.output_parser import (
    OutputSyntax, ToolCall, ToolSchemas, ToolSection, argument_value, consecutive, dump_arguments,
    json_arguments,
)

_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*)</function>", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.S)


def _xml_call(text: str, schemas: ToolSchemas) -> list[ToolCall] | None:
    match = _FUNCTION.fullmatch(text)
    if match is None:
        return None
    name, params = match.group(1).strip(), consecutive(_PARAMETER, match.group(2))
    if params is None:
        return None
    args = {}
    for param in params:
        key = param.group(1).strip()
        args[key] = argument_value(param.group(2).removeprefix("\n").removesuffix("\n"), name, key, schemas)
    return [ToolCall(name, dump_arguments(args))]


def decode_call(body: str, schemas: ToolSchemas) -> list[ToolCall] | None:
    text = body.strip()
    if text.startswith("<function="):
        return _xml_call(text, schemas)
    try:
        call = json.loads(text)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    arguments = json_arguments(arguments) if isinstance(arguments, str) else json_arguments(json.dumps(arguments))
    return None if arguments is None else [ToolCall(call["name"], arguments)]


def call_grammar(name: str, parameters: Mapping[str, Any]) -> str:
    """A forced call in the Hermes form every Qwen3 template reads back."""
    call = {"type": "object", "properties": {"name": {"const": name}, "arguments": parameters},
            "required": ["name", "arguments"], "additionalProperties": False}
    return f"{text('<tool_call>' + chr(10))} {json_value(call)} {text(chr(10) + '</tool_call>')}"


SYNTAX = OutputSyntax("<think>", "</think>", (ToolSection("<tool_call>", "</tool_call>", decode_call),),
                      call_grammar)
