"""DeepSeek V4's prompt format, which its release writes as a Python encoder (``encoding/encoding_dsv4.py`` in
the model repositories) instead of a chat template. Written here from the format that encoder describes:

- The prompt is BOS, then each message. A system message is its text; with tools, two newlines and the tools
  section follow it (tools come in the request, not in a message, so they join the first system message, one
  with empty text being added when there is none).
- A user message is ``<｜User｜>`` and its text. A run of tool results and user text becomes one user turn:
  its blocks joined by two newlines, each result as ``<tool_result>TEXT</tool_result>``, in the order of the
  calls of the assistant turn that made them.
- After the last message of a run of user turns comes ``<｜Assistant｜>``, then ``<think>`` when the reply is to
  think, else ``</think>``.
- An assistant message is, in thinking mode, its reasoning and ``</think>`` (dropped, with the reasoning, in
  turns before the last user turn unless the conversation has tools), then its text, then its calls
  (two newlines and a ``<｜DSML｜tool_calls>`` block), then ``<｜end▁of▁sentence｜>``.
- In thinking mode, ``reasoning_effort="max"`` puts a fixed instruction before the first message; ``"high"``
  changes nothing.

``template_kwargs`` carries ``thinking`` (default off, as V3.1's templates default), ``reasoning_effort`` and the
encoder's ``drop_thinking`` (default on). ``continue_final_message`` leaves the final assistant message open (no
end of sentence), which the model continues.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from colibri.errors import UsageError

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK, END_THINK = "<think>", "</think>"
DSML = "｜DSML｜"
EFFORTS = ("high", "max")
OPTIONS = ("thinking", "reasoning_effort", "drop_thinking")

# The texts the model was trained with, verbatim: they are part of the format, like a template's literals.
TOOLS_SECTION = f"""## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a \
"<{DSML}tool_calls>" block like the following:

<{DSML}tool_calls>
<{DSML}invoke name="$TOOL_NAME">
<{DSML}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{DSML}parameter>
...
</{DSML}invoke>
<{DSML}invoke name="$TOOL_NAME2">
...
</{DSML}invoke>
</{DSML}tool_calls>

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, \
arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by {THINK}), you MUST output your complete reasoning inside \
{THINK}...{END_THINK} BEFORE any tool calls or final response.

Otherwise, output directly after {END_THINK} with tool calls or final response.

### Available Tool Schemas

{{schemas}}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""

EFFORT_MAX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root "
    "cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial "
    "scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered "
    "alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n"
)


class OptionError(UsageError):
    """A request option the format cannot honour; ``option`` names it (the server's 400 ``param``)."""

    def __init__(self, option: str, message: str, hint: str):
        super().__init__(message, hint)
        self.option = option


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def tools_section(tools: Sequence[Mapping[str, Any]]) -> str:
    schemas = "\n".join(_json(tool["function"]) for tool in tools)
    return TOOLS_SECTION.replace("{schemas}", schemas)


def _calls_block(calls: Sequence[Mapping[str, Any]]) -> str:
    invokes = []
    for call in calls:
        function = call["function"]
        arguments = function.get("arguments") or {}
        if isinstance(arguments, str):
            arguments = json.loads(arguments) if arguments.strip() else {}
        params = [f'<{DSML}parameter name="{key}" string="{"true" if isinstance(value, str) else "false"}">'
                  f'{value if isinstance(value, str) else _json(value)}</{DSML}parameter>'
                  for key, value in arguments.items()]
        invokes.append(f'<{DSML}invoke name="{function["name"]}">\n' + "\n".join(params) + f"\n</{DSML}invoke>")
    return f"\n\n<{DSML}tool_calls>\n" + "\n".join(invokes) + f"\n</{DSML}tool_calls>"


def _turns(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None
           ) -> list[dict[str, Any]]:
    """The messages as the format's turns: tools on the first system message, user text and tool results of one
    stretch merged into one user turn (results in their calls' order)."""
    turns: list[dict[str, Any]] = []
    call_order: dict[str, int] = {}    # call id -> its place in the last assistant turn's calls
    for message in messages:
        role = message.get("role")
        if role == "assistant":
            turns.append(dict(message))
            if message.get("tool_calls"):
                call_order = {str(c["id"]): i for i, c in enumerate(message["tool_calls"]) if c.get("id")}
        elif role in ("user", "tool"):
            if role == "tool":
                block = {"result": str(message.get("content") or ""),
                         "order": call_order.get(str(message.get("tool_call_id")), 0)}
            else:
                block = {"text": str(message.get("content") or "")}
            if turns and turns[-1]["role"] == "user":
                turns[-1]["blocks"].append(block)
            else:
                turns.append({"role": "user", "blocks": [block]})
        elif role == "system":
            turns.append({"role": "system", "content": str(message.get("content") or "")})
        else:
            raise UsageError(f"DeepSeek V4's format has no {role!r} messages", "use system, user, assistant, tool")
    for turn in turns:
        if turn["role"] == "user":
            results = iter(sorted((b for b in turn["blocks"] if "result" in b), key=lambda b: b["order"]))
            turn["blocks"] = [next(results) if "result" in b else b for b in turn["blocks"]]
    if tools:
        if not turns or turns[0]["role"] != "system":
            turns.insert(0, {"role": "system", "content": ""})
        turns[0]["tools"] = tools
    return turns


def _options(options: Mapping[str, Any]) -> tuple[bool, str | None, bool]:
    variables = dict(options.get("template_kwargs") or {})
    unknown = sorted(set(variables) - set(OPTIONS))
    if unknown:
        raise OptionError(f"chat_template_kwargs.{unknown[0]}",
                          f"DeepSeek V4's encoder has no option {unknown[0]!r}",
                          f"use {', '.join(OPTIONS)}")
    effort = variables.get("reasoning_effort")
    if effort is not None and effort not in EFFORTS:
        raise OptionError("reasoning_effort", f"reasoning_effort {effort!r}: DeepSeek V4 has the levels "
                          f"{' and '.join(EFFORTS)}", "use one of them, or leave it out")
    return bool(variables.get("thinking", False)), effort, bool(variables.get("drop_thinking", True))


def render(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None,
           options: Mapping[str, Any]) -> str:
    """The prompt text of a conversation in DeepSeek V4's format."""
    thinking, effort, drop = _options(options)
    turns = _turns(messages, tools)
    if not turns:
        raise UsageError("cannot render an empty conversation", "pass at least one message")
    drop = drop and not tools
    continue_final = bool(options.get("continue_final_message"))
    if continue_final and turns[-1]["role"] != "assistant":
        raise UsageError("continue_final_message needs a final assistant message", "end with the prefill")
    last_user = max((i for i, t in enumerate(turns) if t["role"] == "user"), default=-1)
    prompt = BOS
    for i, turn in enumerate(turns):
        if i == 0 and thinking and effort == "max":
            prompt += EFFORT_MAX
        role = turn["role"]
        if role == "system":
            prompt += turn["content"]
            if turn.get("tools"):
                prompt += "\n\n" + tools_section(turn["tools"])
        elif role == "user":
            prompt += USER + "\n\n".join(f"<tool_result>{b['result']}</tool_result>" if "result" in b else b["text"]
                                         for b in turn["blocks"])
        else:
            if thinking and (not drop or i > last_user):
                prompt += str(turn.get("reasoning_content") or "") + END_THINK
            prompt += str(turn.get("content") or "")
            if turn.get("tool_calls"):
                prompt += _calls_block(turn["tool_calls"])
            if not (continue_final and i == len(turns) - 1):
                prompt += EOS
        following = turns[i + 1]["role"] if i + 1 < len(turns) else None
        if role == "user" and following in (None, "assistant"):
            prompt += ASSISTANT + (THINK if thinking and (not drop or i >= last_user) else END_THINK)
    return prompt
