"""DeepSeek V3 / V3.1 / V3.2's output syntax, as their released chat templates write an assistant turn.

Reasoning is ``<think>...</think>`` (V3.1's thinking mode opens it in the prompt, so the reply starts inside).
Calls stand in one section ``<｜tool▁calls▁begin｜>...<｜tool▁calls▁end｜>``, each
``<｜tool▁call▁begin｜>A<｜tool▁sep｜>B<｜tool▁call▁end｜>``: V3.1 and later write the name as ``A`` and the JSON
arguments as ``B``; V3 wrote ``function`` as ``A``, and as ``B`` the name, a newline and the JSON arguments
in a json code fence.

V3.2 and V4 write calls in DSML instead: ``<｜DSML｜function_calls>`` (V3.2) or ``<｜DSML｜tool_calls>`` (V4)
around ``<｜DSML｜invoke name="NAME">`` entries, each holding
``<｜DSML｜parameter name="K" string="true|false">V</｜DSML｜parameter>`` (``string="true"``: ``V`` is the text
itself; ``"false"``: ``V`` is JSON).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from colibri.call_grammar import json_value, text
from colibri.output_parser import (
    OutputSyntax, ToolCall, ToolSchemas, ToolSection, consecutive, dump_arguments, json_arguments, repeated,
)

SEP = "<｜tool▁sep｜>"


def _one(piece: str) -> ToolCall | None:
    head, sep, tail = piece.partition(SEP)
    if not sep:
        return None
    name, arguments = head.strip(), tail
    if name == "function":      # V3: the name leads the arguments, which sit in a json code fence
        name, _, fenced = tail.partition("\n")
        name, arguments = name.strip(), fenced.strip().removeprefix("```json").removesuffix("```")
    decoded = json_arguments(arguments)
    return ToolCall(name, decoded) if name and decoded is not None else None


_INVOKE = re.compile(r'<｜DSML｜invoke name="([^"]+)">(.*?)</｜DSML｜invoke>', re.S)
_PARAMETER = re.compile(r'<｜DSML｜parameter name="([^"]+)" string="(true|false)">(.*?)</｜DSML｜parameter>', re.S)


def _dsml_calls(body: str, schemas: ToolSchemas) -> list[ToolCall] | None:
    calls = []
    for invoke in consecutive(_INVOKE, body) or ():
        params = consecutive(_PARAMETER, invoke.group(2))
        if params is None:
            return None
        args = {}
        for param in params:
            key, is_text, raw = param.groups()
            try:
                args[key] = raw if is_text == "true" else json.loads(raw)
            except ValueError:
                return None
        calls.append(ToolCall(invoke.group(1), dump_arguments(args)))
    return calls or None


CALLS = repeated("<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", _one)


def call_grammar(name: str, parameters: Mapping[str, Any]) -> str:
    """A forced call in V3.1's form (name, separator, JSON arguments), which every release's parser reads."""
    head = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>" + name + SEP
    return f"{text(head)} {json_value(parameters)} {text('<｜tool▁call▁end｜><｜tool▁calls▁end｜>')}"
SYNTAX = OutputSyntax("<think>", "</think>", (
    ToolSection("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", CALLS),
    ToolSection("<｜DSML｜function_calls>", "</｜DSML｜function_calls>", _dsml_calls),
    ToolSection("<｜DSML｜tool_calls>", "</｜DSML｜tool_calls>", _dsml_calls),
), call_grammar)
