"""The request fields of tool use and reasoning: ``tools``, ``tool_choice``, assistant ``tool_calls``, tool
results, ``reasoning_content``, ``chat_template_kwargs`` (OpenAI) and ``tool_use``/``tool_result``/``thinking``
blocks (Anthropic), checked and turned into the OpenAI-shaped messages the ``render_prompt`` hook renders.

``tool_choice`` values that force a call (``required``, a named function; Anthropic's ``any``/``tool``) become
``"required"`` or ``"function:NAME"``: the reply is then constrained to one well-formed call in the family's
syntax (:mod:`colibri.call_grammar`).
"""

from __future__ import annotations

import json
from typing import Any

from .errors import bad_request
from .validation import _json_type, check_text



def _object(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise bad_request(f"'{where}' must be an object, not {_json_type(value)}", param=where, code="invalid_type")
    return value


def _name(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise bad_request(f"'{where}' must be a non-empty string", param=where, code="invalid_type")
    check_text(value, where)
    return value


def _plain_json(value: Any, where: str) -> Any:
    """A JSON value as it arrived, every string in it (keys too) checked for text no tokenizer takes (NUL, lone
    surrogates): templates write some of them into the prompt as they are."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            check_text(item, where)
        elif isinstance(item, dict):
            stack += list(item.keys()) + list(item.values())
        elif isinstance(item, list):
            stack += item
    return value


def _objects(value: Any, where: str) -> list[tuple[str, dict[str, Any]]]:
    """An array of objects, each with the path that names it in an error."""
    if not isinstance(value, list):
        raise bad_request(f"'{where}' must be an array, not {_json_type(value)}", param=where, code="invalid_type")
    return [(f"{where}[{i}]", _object(item, f"{where}[{i}]")) for i, item in enumerate(value)]


def _function(source: dict[str, Any], where: str, schema_key: str) -> dict[str, Any]:
    """A tool's function in OpenAI's shape, from an OpenAI ``function`` or an Anthropic tool."""
    entry: dict[str, Any] = {"name": _name(source.get("name"), f"{where}.name")}
    if source.get("description") is not None:
        entry["description"] = text_field(source["description"], f"{where}.description")
    if source.get(schema_key) is not None or schema_key == "input_schema":
        entry["parameters"] = _plain_json(_object(source.get(schema_key), f"{where}.{schema_key}"),
                                          f"{where}.{schema_key}")
    return {"type": "function", "function": entry}


def openai_tools(data: dict[str, Any], field: str = "tools") -> list[dict[str, Any]] | None:
    """``tools``: function tools only, each with a name and (optionally) a JSON-schema ``parameters`` object."""
    tools = data.get(field)
    if tools is None:
        return None
    out = []
    for where, tool in _objects(tools, field):
        if tool.get("type") != "function":
            raise bad_request(f"'{where}.type' is {tool.get('type')!r}; only 'function' tools are supported",
                              param=f"{where}.type", code="invalid_value")
        out.append(_function(_object(tool.get("function"), f"{where}.function"), f"{where}.function", "parameters"))
    return out or None


def text_field(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise bad_request(f"'{where}' must be a string, not {_json_type(value)}", param=where, code="invalid_type")
    check_text(value, where)
    return value


def openai_tool_choice(data: dict[str, Any], tools: list[dict[str, Any]] | None) -> str:
    choice = data.get("tool_choice")
    if choice is None or choice in ("auto", "none"):
        return choice or "auto"
    if choice == "required":
        return _forced("required", tools, "tool_choice")
    if isinstance(choice, dict):
        function = _object(choice.get("function"), "tool_choice.function")
        return _forced("function:" + _name(function.get("name"), "tool_choice.function.name"), tools,
                       "tool_choice.function.name")
    raise bad_request(f"'tool_choice' is {choice!r}; use 'auto', 'none', 'required' or "
                      f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}", param="tool_choice",
                      code="invalid_value")


def _forced(choice: str, tools: list[dict[str, Any]] | None, where: str) -> str:
    """A forcing choice, checked against the listed tools."""
    names = [t["function"]["name"] for t in tools or []]
    if not names:
        raise bad_request(f"'{where}' forces a tool call but 'tools' is empty", param=where, code="invalid_value")
    if choice.startswith("function:") and choice[len("function:"):] not in names:
        raise bad_request(f"'{where}' names {choice[len('function:'):]!r}, which is not in 'tools' "
                          f"({', '.join(names)})", param=where, code="invalid_value")
    return choice


def openai_tool_calls(value: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls``, ``arguments`` parsed from its JSON text into an object (templates
    iterate over it, as vLLM passes it)."""
    calls = []
    for i, (at, call) in enumerate(_objects(value, where)):
        function = _object(call.get("function"), f"{at}.function")
        raw = function.get("arguments", "{}")
        arguments = raw
        if isinstance(raw, str):
            try:
                arguments = json.loads(raw) if raw.strip() else {}
            except ValueError:
                arguments = None
        if not isinstance(arguments, dict):
            raise bad_request(f"'{at}.function.arguments' must be a JSON object (as text)",
                              param=f"{at}.function.arguments", code="invalid_value")
        call_id = call.get("id")
        calls.append({"id": _name(call_id, f"{at}.id") if call_id is not None else f"call_{i}",
                      "type": "function",
                      "function": {"name": _name(function.get("name"), f"{at}.function.name"),
                                   "arguments": _plain_json(arguments, f"{at}.function.arguments")}})
    return calls


def template_kwargs(data: dict[str, Any], thinking_switch: str | None) -> dict[str, Any]:
    """``chat_template_kwargs``: variables for the template (vLLM's field), e.g. ``{"enable_thinking": false}``."""
    value = data.get("chat_template_kwargs")
    if value is None:
        return {}
    value = _object(value, "chat_template_kwargs")
    for key, item in value.items():
        if item is not None and not isinstance(item, (str, int, float, bool, list, dict)):
            raise bad_request(f"'chat_template_kwargs.{key}' must be a JSON value",
                              param=f"chat_template_kwargs.{key}", code="invalid_type")
    return _plain_json(dict(value), "chat_template_kwargs")


def effort_kwargs(effort: Any, where: str, thinking_switch: str | None, effort_variable: bool) -> dict[str, Any]:
    """``reasoning_effort`` as template variables: the template's own ``reasoning_effort`` when it has levels;
    ``"none"`` turns a plain thinking switch off; anything else cannot be honoured and is refused."""
    if not isinstance(effort, str):
        raise bad_request(f"'{where}' must be a string", param=where, code="invalid_type")
    check_text(effort, where)
    if effort_variable:
        return {"reasoning_effort": effort}
    if effort == "none" and thinking_switch is not None:
        return {thinking_switch: False}
    hint = " ('none' turns thinking off)" if thinking_switch else ""
    raise bad_request(f"'{where}' is {effort!r}: this model's chat template has no reasoning-effort levels{hint}; "
                      f"remove it or use chat_template_kwargs", param=where, code="unsupported_parameter")


# ---- Anthropic ---------------------------------------------------------------------------------------------------

def anthropic_tools(data: dict[str, Any]) -> list[dict[str, Any]] | None:
    tools = data.get("tools")
    if tools is None:
        return None
    out = []
    for where, tool in _objects(tools, "tools"):
        if tool.get("type") not in (None, "custom"):
            raise bad_request(f"'{where}.type' is {tool.get('type')!r}; only client tools (a name and an "
                              f"input_schema) are supported", param=f"{where}.type")
        out.append(_function(tool, where, "input_schema"))
    return out or None


def anthropic_tool_choice(data: dict[str, Any], tools: list[dict[str, Any]] | None) -> str:
    choice = data.get("tool_choice")
    if choice is None:
        return "auto"
    kind = _object(choice, "tool_choice").get("type")
    if kind in ("auto", "none"):
        return kind
    if kind == "any":
        return _forced("required", tools, "tool_choice")
    if kind == "tool":
        return _forced("function:" + _name(choice.get("name"), "tool_choice.name"), tools, "tool_choice.name")
    raise bad_request(f"'tool_choice.type' is {kind!r}; use 'auto', 'any', 'tool' or 'none'",
                      param="tool_choice.type")


def anthropic_thinking(data: dict[str, Any], thinking_switch: str | None, max_tokens: int | None = None
                       ) -> dict[str, Any]:
    """``thinking``: enabled or disabled sets the template's thinking switch; a template without one refuses.

    The budget is checked as Anthropic checks it (at least 1024, below ``max_tokens``); reasoning and answer
    together stop at ``max_tokens``, so the budget is never exceeded by more than the answer's share."""
    value = data.get("thinking")
    if value is None:
        return {}
    kind = _object(value, "thinking").get("type")
    if kind not in ("enabled", "disabled"):
        raise bad_request(f"'thinking.type' is {kind!r}; use 'enabled' or 'disabled'", param="thinking.type")
    if kind == "enabled":
        budget = value.get("budget_tokens")
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1024:
            raise bad_request("'thinking.budget_tokens' must be an integer of at least 1024",
                              param="thinking.budget_tokens")
        if max_tokens is not None and budget >= max_tokens:
            raise bad_request(f"'thinking.budget_tokens' ({budget}) must be less than 'max_tokens' ({max_tokens})",
                              param="thinking.budget_tokens")
    if thinking_switch is None:
        raise bad_request("'thinking' cannot be honoured: this model's chat template has no thinking switch "
                          "(enable_thinking or thinking); remove it", param="thinking")
    return {thinking_switch: kind == "enabled"}


def anthropic_message(message: dict[str, Any], where: str, tools_supported: bool) -> list[dict[str, Any]]:
    """One Anthropic message as OpenAI-shaped messages: a user turn's ``tool_result`` blocks become ``tool``
    messages (before its text), an assistant turn's ``tool_use`` blocks its ``tool_calls`` and its ``thinking``
    blocks its ``reasoning_content``."""
    role, content = message.get("role"), message.get("content")
    if isinstance(content, str):
        check_text(content, f"{where}.content")
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise bad_request(f"'{where}.content' must be a string or an array of content blocks, not "
                          f"{_json_type(content)}", param=f"{where}.content")
    texts, reasoning, calls, results = [], [], [], []
    allowed = {"user": ("text", "tool_result"), "assistant": ("text", "tool_use", "thinking")}[str(role)]
    for i, block in enumerate(content):
        at = f"{where}.content[{i}]"
        block = _object(block, at)
        kind = block.get("type")
        if kind not in allowed or (kind in ("tool_use", "tool_result") and not tools_supported):
            why = "this model's family has no tool-use support" if kind in ("tool_use", "tool_result") and \
                not tools_supported else f"a {role} message may hold {', '.join(allowed)} blocks"
            raise bad_request(f"'{at}.type' is {kind!r}; {why}", param=f"{at}.type")
        if kind == "text":
            texts.append(text_field(block.get("text"), f"{at}.text"))
        elif kind == "thinking":
            reasoning.append(text_field(block.get("thinking"), f"{at}.thinking"))
        elif kind == "tool_use":
            calls.append({"id": _name(block.get("id"), f"{at}.id"), "type": "function",
                          "function": {"name": _name(block.get("name"), f"{at}.name"),
                                       "arguments": _plain_json(_object(block.get("input"), f"{at}.input"),
                                                                f"{at}.input")}})
        else:
            results.append({"role": "tool", "tool_call_id": _name(block.get("tool_use_id"), f"{at}.tool_use_id"),
                            "content": _resulttext_field(block.get("content"), f"{at}.content")})
    out: list[dict[str, Any]] = list(results)
    if role == "assistant":
        reply: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
        if reasoning:
            reply["reasoning_content"] = "".join(reasoning)
        if calls:
            reply["tool_calls"] = calls
        out.append(reply)
    elif texts or not results:
        out.append({"role": "user", "content": "".join(texts)})
    return out


def _resulttext_field(value: Any, where: str) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        check_text(value, where)
        return value
    if not isinstance(value, list):
        raise bad_request(f"'{where}' must be a string or an array of text blocks", param=where)
    pieces = []
    for i, block in enumerate(value):
        block = _object(block, f"{where}[{i}]")
        if block.get("type") != "text":
            raise bad_request(f"'{where}[{i}].type' is {block.get('type')!r}; only text blocks are supported",
                              param=f"{where}[{i}].type")
        pieces.append(text_field(block.get("text"), f"{where}[{i}].text"))
    return "".join(pieces)
