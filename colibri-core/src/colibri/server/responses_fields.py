"""The Responses API's request (``POST /v1/responses``) as a :class:`GenerationSpec`.

Its ``input`` items become the OpenAI-shaped chat messages every other route renders: message items keep their
role, ``function_call`` items become the preceding assistant turn's ``tool_calls``, ``function_call_output`` items
``tool`` messages, and ``reasoning`` items the next assistant turn's ``reasoning_content``. Each message then goes
through the chat route's own checks, so both APIs refuse the same things with the same words (``param`` names
the ``input`` item). Nothing is stored: ``previous_response_id`` and the other server-side state are refused.
"""

from __future__ import annotations

from typing import Any

from . import tool_fields
from .errors import bad_request
from .validation import (
    GenerationSpec, _chat_message, _common_sampling, _Fields, _json_type, _refuse_if_set, _text_content,
)

MESSAGE_ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text", "text")
# fields that need state kept between requests or services the server does not run
STATEFUL = ("previous_response_id", "conversation", "prompt", "background")


def parse_responses(data: dict[str, Any], default_model: str, kv_slots: int, tools_supported: bool,
                    thinking_switch: str | None, effort_variable: bool) -> GenerationSpec:
    fields = _Fields(data)
    spec = GenerationSpec(model=fields.string("model") or default_model)
    for name in STATEFUL:
        _refuse_if_set(fields, name, "this server stores no responses, conversations or prompts; send the whole "
                       "conversation as 'input'", allowed=(False,))
    messages: list[dict[str, Any]] = []
    instructions = data.get("instructions")
    if instructions is not None:
        messages.append({"role": "system", "content": tool_fields.text_field(instructions, "instructions")})
    messages += _input_messages(data.get("input"))
    spec.messages = [_chat_message(m, where, tools_supported) for m, where in
                     ((m, m.pop("_where", "input")) for m in messages)]
    _common_sampling(fields, spec, kv_slots)
    spec.max_tokens = fields.integer("max_output_tokens", low=1)
    spec.user = fields.string("safety_identifier") or fields.string("user")
    _refuse_if_set(fields, "top_logprobs", "the engine does not return log-probabilities", allowed=(0,))
    _refuse_if_set(fields, "max_tool_calls", "tool calls are not limited by count")
    include = data.get("include")
    if include:
        raise bad_request(f"'include' {include!r} cannot be honoured (no encrypted reasoning, logprobs or tool "
                          f"outputs to add); remove it", param="include", code="unsupported_parameter")
    truncation = data.get("truncation")
    if truncation not in (None, "disabled"):
        raise bad_request("'truncation' must be 'disabled': a conversation that does not fit the context is "
                          "refused, never cut", param="truncation", code="unsupported_parameter")
    _text_options(data.get("text"))
    if tools_supported:
        spec.tools = tool_fields.openai_tools({"tools": _tools(data.get("tools"))})
        spec.tool_choice = _tool_choice(data.get("tool_choice"), spec.tools)
    else:
        _refuse_if_set(fields, "tools", "this model's family has no tool-call support")
        _refuse_if_set(fields, "tool_choice", "this model's family has no tool-call support", allowed=("none",))
    spec.parallel_tool_calls = fields.boolean("parallel_tool_calls", True)
    spec.template_kwargs = tool_fields.template_kwargs(data, thinking_switch)
    effort = (_object_or_none(data.get("reasoning"), "reasoning") or {}).get("effort")
    if effort is not None:
        spec.template_kwargs.update(tool_fields.effort_kwargs(effort, "reasoning.effort", thinking_switch,
                                                              effort_variable))
    return spec


def _object_or_none(value: Any, where: str) -> dict[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise bad_request(f"'{where}' must be an object, not {_json_type(value)}", param=where, code="invalid_type")
    return value


def _text_options(value: Any) -> None:
    text = _object_or_none(value, "text") or {}
    fmt = _object_or_none(text.get("format"), "text.format")
    if fmt is not None and fmt.get("type") != "text":
        raise bad_request("'text.format' other than {\"type\": \"text\"} is not supported on this route; remove it",
                          param="text.format", code="unsupported_parameter")
    if text.get("verbosity") not in (None, "medium"):
        raise bad_request("'text.verbosity' cannot be honoured (the model has no verbosity control); remove it",
                          param="text.verbosity", code="unsupported_parameter")


def _input_messages(value: Any) -> list[dict[str, Any]]:
    """``input`` (a string, or a list of items) as chat messages, each remembering the item it came from."""
    if value is None:
        raise bad_request("'input' is required", param="input", code="missing_required_parameter")
    if isinstance(value, str):
        return [{"role": "user", "content": value, "_where": "input"}]
    if not isinstance(value, list) or not value:
        raise bad_request("'input' must be a string or a non-empty array of items", param="input",
                          code="invalid_type" if not isinstance(value, list) else "invalid_value")
    out: list[dict[str, Any]] = []
    reasoning: list[str] = []    # reasoning items wait for the assistant turn they belong to

    def assistant_turn(where: str) -> dict[str, Any]:
        last = out[-1] if out else None
        if last is not None and last["role"] == "assistant" and not reasoning:
            return last
        turn: dict[str, Any] = {"role": "assistant", "content": "", "_where": where}
        if reasoning:
            turn["reasoning_content"] = "".join(reasoning)
            reasoning.clear()
        out.append(turn)
        return turn

    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"'{where}' must be an object, not {_json_type(item)}", param=where,
                              code="invalid_type")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in MESSAGE_ROLES:
                raise bad_request(f"'{where}.role' is {role!r}; it must be one of {', '.join(MESSAGE_ROLES)}",
                                  param=f"{where}.role", code="invalid_value")
            content = _text_content(item.get("content"), f"{where}.content", TEXT_PARTS)
            if role == "assistant":
                turn = assistant_turn(where)
                if turn.get("tool_calls"):      # text after calls starts a new turn
                    turn = {"role": "assistant", "content": "", "_where": where}
                    out.append(turn)
                turn["content"] += content
            else:
                out.append({"role": role, "content": content, "_where": where})
        elif kind == "function_call":
            turn = assistant_turn(where)
            turn.setdefault("tool_calls", []).append({
                "id": tool_fields.text_field(item.get("call_id"), f"{where}.call_id"), "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}})
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _text_content(output, f"{where}.output", TEXT_PARTS)
            out.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": text, "_where": where})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            reasoning.append(_text_content(parts, f"{where}.content", ("reasoning_text", "summary_text")))
        else:
            raise bad_request(f"'{where}.type' is {kind!r}; this server takes message, function_call, "
                              f"function_call_output and reasoning items", param=f"{where}.type",
                              code="invalid_value")
    return out


def _tools(value: Any) -> list[dict[str, Any]] | None:
    """Responses tools (``{"type": "function", "name", "description", "parameters", "strict"}``) in the chat
    shape; hosted tools (web search, file search, ...) are refused."""
    if value is None:
        return None
    if not isinstance(value, list):
        raise bad_request(f"'tools' must be an array, not {_json_type(value)}", param="tools", code="invalid_type")
    out = []
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else _json_type(tool)
            raise bad_request(f"'{where}.type' is {kind!r}; only 'function' tools are supported (no hosted tools)",
                              param=f"{where}.type", code="invalid_value")
        function = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(value: Any, tools: list[dict[str, Any]] | None) -> str:
    """The Responses API's ``tool_choice``: a named function is ``{"type": "function", "name": ...}`` there."""
    if isinstance(value, dict) and value.get("type") == "function":
        return tool_fields.openai_tool_choice({"tool_choice": {"type": "function",
                                                              "function": {"name": value.get("name")}}}, tools)
    if isinstance(value, dict) and value.get("type") == "allowed_tools":
        raise bad_request("'tool_choice' of type 'allowed_tools' is not supported; send 'auto', 'none', 'required' "
                          "or {\"type\": \"function\", \"name\": ...}", param="tool_choice",
                          code="unsupported_parameter")
    return tool_fields.openai_tool_choice({"tool_choice": value}, tools)
