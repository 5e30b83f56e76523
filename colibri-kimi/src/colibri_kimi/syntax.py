"""Kimi K2's output syntax, as its released chat template writes an assistant turn.

Reasoning (K2-Thinking) is ``<think>...</think>``. Calls stand in one section
``<|tool_calls_section_begin|>...<|tool_calls_section_end|>``, each
``<|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{json}<|tool_call_end|>``. The
``functions.NAME:IDX`` text is the call's id: the template writes it back in the tool result's header, so it is
returned as the call id unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from colibri.call_grammar import json_value, text
from colibri.output_parser import OutputSyntax, ToolCall, ToolSection, json_arguments, repeated

ARGUMENT = "<|tool_call_argument_begin|>"


def _one(piece: str) -> ToolCall | None:
    call_id, sep, arguments = piece.partition(ARGUMENT)
    call_id = call_id.strip()
    name = call_id.removeprefix("functions.").rpartition(":")[0]
    decoded = json_arguments(arguments) if sep else None
    return ToolCall(name, decoded, call_id) if name and decoded is not None else None


CALLS = repeated("<|tool_call_begin|>", "<|tool_call_end|>", _one)
SECTION = ToolSection("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", CALLS)


def call_grammar(name: str, parameters: Mapping[str, Any]) -> str:
    """A forced call: one section holding one call, id ``functions.NAME:0``."""
    head = SECTION.open + "<|tool_call_begin|>" + f"functions.{name}:0" + ARGUMENT
    return f"{text(head)} {json_value(parameters)} {text('<|tool_call_end|>' + SECTION.close)}"


SYNTAX = OutputSyntax("<think>", "</think>", (SECTION,), call_grammar)
