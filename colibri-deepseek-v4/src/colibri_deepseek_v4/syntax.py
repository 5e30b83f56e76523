"""DeepSeek V3 / V3.1 / V3.2's output syntax, as their released chat templates write an assistant turn.

Reasoning is ``<think>...</think>`` (V3.1's thinking mode opens it in the prompt, so the reply starts inside).
Calls stand in one section ``<｜tool▁calls▁begin｜>...<｜tool▁calls▁end｜>``, each
``<｜tool▁call▁begin｜>A<｜tool▁sep｜>B<｜tool▁call▁end｜>``: V3.1 and later write the name as ``A`` and the JSON
arguments as ``B``; V3 wrote ``function`` as ``A``, and as ``B`` the name, a newline and the JSON arguments
in a json code fence.
"""

from __future__ import annotations

from colibri.output_parser import OutputSyntax, ToolCall, ToolSection, json_arguments, repeated

SEP = "<｜tool▁sep｜>"


def _one(piece: str) -> ToolCall | None:
    head, sep, tail = piece.partition(SEP)
    if not sep:
        return None
    name, arguments = head.strip(), tail
    if name == "function":      # V3: the name leads the arguments, which sit in a json code fence
        name, _, fenced = tail.partition("\n")
        name, arguments = name.strip(), fenced.strip().removeprefix("```json").removesuffix("```")
    arguments = json_arguments(arguments)
    return ToolCall(name, arguments) if name and arguments is not None else None


CALLS = repeated("<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", _one)
SYNTAX = OutputSyntax("<think>", "</think>", (ToolSection("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", CALLS),))
