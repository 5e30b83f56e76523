"""Turning request bodies into a :class:`GenerationSpec`, refusing anything we would not honour.

Every refusal is a 400 that names the offending field (``param``), in the path notation OpenAI uses
(``messages[1].content``). Fields that would change the result and that we cannot honour (``n > 1``,
``suffix``, audio, ...) are refused rather than silently ignored; fields that only label a request (``user``,
``metadata``, ``store``) are accepted.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

from ..prompt import MAX_TEMPERATURE
from .errors import bad_request
from .sampling_fields import chat_logprobs, completion_logprobs, response_format, sampler_fields

MAX_STOP_SEQUENCES = 16
MAX_PROMPT_BATCH = 64
_SURROGATE = re.compile("[\ud800-\udfff]")
CHAT_ROLES = ("system", "developer", "user", "assistant")


@dataclass
class GenerationSpec:
    """One generation request, whichever API it came from."""

    model: str
    messages: list[dict[str, Any]] | None = None   # chat, OpenAI-shaped: role, flattened content, tool_calls, ...
    system: str | None = None                      # Anthropic's top-level system prompt
    prompt_text: str | None = None                 # /v1/completions with a string prompt
    prompt_ids: list[int] | None = None            # /v1/completions with token ids
    max_tokens: int | None = None                  # None = up to the context
    temperature: float | None = None               # None: the checkpoint's default (as coli run uses)
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    user: str | None = None
    cache_slot: int | None = None
    tools: list[dict[str, Any]] | None = None      # OpenAI-shaped function tools, for the template and the parser
    tool_choice: str = "auto"                      # "auto", "none", "required" or "function:NAME"
    parallel_tool_calls: bool = True               # False: only the first call of a reply is returned
    template_kwargs: dict[str, Any] = field(default_factory=dict)   # the template's own variables (thinking)
    continue_final: bool = False                   # the last message is an assistant prefill the reply continues
    min_p: float | None = None                     # None: the checkpoint's default, else off
    repetition_penalty: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: int | None = None                    # None: none; else top log-probabilities per token (0-20)
    echo: bool = False                             # completions: the prompt (and its log-probabilities) first
    response_format: dict[str, Any] | None = None  # json_object / json_schema: constrained decoding
    prompt_batch: list[Any] | None = None          # completions: more than one prompt (strings or id lists)


def parse_json_body(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object, or a 400 saying what is wrong with it."""
    if not raw.strip():
        raise bad_request("request body is empty; send a JSON object", code="invalid_json")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise bad_request(f"request body is not UTF-8 (byte {exc.start})", code="invalid_json") from None
    try:
        data = json.loads(text, parse_constant=_refuse_constant)
    except json.JSONDecodeError as exc:
        raise bad_request(f"request body is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}",
                          code="invalid_json") from None
    except ValueError as exc:
        raise bad_request(f"request body is not valid JSON: {exc}", code="invalid_json") from None
    except RecursionError:
        raise bad_request("request body is nested too deeply", code="invalid_json") from None
    if not isinstance(data, dict):
        raise bad_request(f"request body must be a JSON object, not {_json_type(data)}", code="invalid_json")
    return data


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


class _Fields:
    """Typed access to a request object; each accessor raises a 400 naming the field."""

    def __init__(self, data: dict[str, Any]):
        self.data = data

    def present(self, name: str) -> bool:
        return self.data.get(name) is not None

    def string(self, name: str, default: str | None = None, required: bool = False) -> str | None:
        value = self.data.get(name)
        if value is None:
            if required:
                raise bad_request(f"'{name}' is required", param=name, code="missing_required_parameter")
            return default
        if not isinstance(value, str):
            raise bad_request(f"'{name}' must be a string, not {_json_type(value)}", param=name,
                              code="invalid_type")
        check_text(value, name)
        return value

    def boolean(self, name: str, default: bool = False) -> bool:
        value = self.data.get(name)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise bad_request(f"'{name}' must be a boolean, not {_json_type(value)}", param=name,
                              code="invalid_type")
        return value

    def integer(self, name: str, low: int | None = None, high: int | None = None) -> int | None:
        value = self.data.get(name)
        if value is None:
            return None
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad_request(f"'{name}' must be an integer, not {_json_type(value)}", param=name,
                              code="invalid_type")
        if (low is not None and value < low) or (high is not None and value > high):
            raise bad_request(f"'{name}' is {value}; it must be {_range_text(low, high)}", param=name,
                              code="invalid_value")
        return value

    def number(self, name: str, default: float | None, low: float, high: float) -> float | None:
        value = self.data.get(name)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise bad_request(f"'{name}' must be a number, not {_json_type(value)}", param=name,
                              code="invalid_type")
        if not low <= value <= high:
            raise bad_request(f"'{name}' is {value}; it must be between {low:g} and {high:g}", param=name,
                              code="invalid_value")
        return float(value)


def _range_text(low: int | None, high: int | None) -> str:
    if low is not None and high is not None:
        return f"between {low} and {high}"
    return f">= {low}" if low is not None else f"<= {high}"


def check_text(value: str, param: str) -> None:
    """Refuse NUL bytes (no tokenizer maps them to anything a user meant, and C code downstream may stop at them)
    and lone surrogates (JSON can spell ``\\ud800``, but it is no character and has no UTF-8 to tokenize)."""
    if "\x00" in value:
        raise bad_request(f"'{param}' contains a NUL byte (\\u0000); remove it", param=param,
                          code="invalid_value")
    lone = _SURROGATE.search(value)
    if lone is not None:
        raise bad_request(f"'{param}' contains a lone surrogate (\\u{ord(lone.group()):04x}) at character "
                          f"{lone.start()}; send valid Unicode (pair the surrogates, or use the character itself)",
                          param=param, code="invalid_value")


def _refuse_if_set(fields: _Fields, name: str, why: str, allowed: tuple[Any, ...] = ()) -> None:
    value = fields.data.get(name)
    if value is None or value in allowed or (isinstance(value, (list, dict)) and not value):
        return
    raise bad_request(f"'{name}' is not supported by this server ({why}); remove it", param=name,
                      code="unsupported_parameter")


def _stop_list(fields: _Fields, name: str, allow_string: bool) -> list[str]:
    value = fields.data.get(name)
    if value is None:
        return []
    if isinstance(value, str) and allow_string:
        value = [value]
    if not isinstance(value, list):
        kind = "a string or an array of strings" if allow_string else "an array of strings"
        raise bad_request(f"'{name}' must be {kind}, not {_json_type(value)}", param=name, code="invalid_type")
    if len(value) > MAX_STOP_SEQUENCES:
        raise bad_request(f"'{name}' has {len(value)} entries; at most {MAX_STOP_SEQUENCES} are allowed",
                          param=name, code="invalid_value")
    stops = []
    for i, item in enumerate(value):
        where = f"{name}[{i}]"
        if not isinstance(item, str):
            raise bad_request(f"'{where}' must be a string, not {_json_type(item)}", param=where,
                              code="invalid_type")
        if not item:
            raise bad_request(f"'{where}' is empty; a stop sequence needs at least one character", param=where,
                              code="invalid_value")
        check_text(item, where)
        stops.append(item)
    return stops


def _text_content(value: Any, where: str, part_types: tuple[str, ...]) -> str:
    """Flatten a message's content (a string or a list of text parts) to one string."""
    if isinstance(value, str):
        check_text(value, where)
        return value
    if not isinstance(value, list):
        raise bad_request(f"'{where}' must be a string or an array of text parts, not {_json_type(value)}",
                          param=where, code="invalid_type")
    pieces = []
    for i, part in enumerate(value):
        at = f"{where}[{i}]"
        if not isinstance(part, dict):
            raise bad_request(f"'{at}' must be an object, not {_json_type(part)}", param=at, code="invalid_type")
        kind = part.get("type")
        if kind not in part_types:
            raise bad_request(f"'{at}.type' is {kind!r}; only text parts are supported", param=f"{at}.type",
                              code="unsupported_content")
        text = part.get("text")
        if not isinstance(text, str):
            raise bad_request(f"'{at}.text' must be a string, not {_json_type(text)}", param=f"{at}.text",
                              code="invalid_type")
        check_text(text, f"{at}.text")
        pieces.append(text)
    return "".join(pieces)


def _common_sampling(fields: _Fields, spec: GenerationSpec, kv_slots: int) -> None:
    spec.temperature = fields.number("temperature", None, 0.0, MAX_TEMPERATURE)
    spec.top_p = fields.number("top_p", None, 0.0, 1.0)
    if spec.top_p == 0.0:
        raise bad_request("'top_p' is 0; it must be greater than 0 (use temperature 0 for greedy)",
                          param="top_p", code="invalid_value")
    spec.top_k = fields.integer("top_k", low=0)
    spec.seed = fields.integer("seed", low=-(2**63), high=2**64 - 1)
    spec.stream = fields.boolean("stream")
    slot = fields.integer("cache_slot", low=0, high=kv_slots - 1)
    spec.cache_slot = slot


def _openai_common(fields: _Fields, spec: GenerationSpec, kv_slots: int) -> None:
    _common_sampling(fields, spec, kv_slots)
    n = fields.integer("n", low=1)
    if n is not None and n != 1:
        raise bad_request(f"'n' is {n}; this server returns one choice per request (n = 1)", param="n",
                          code="unsupported_parameter")
    spec.stop = _stop_list(fields, "stop", allow_string=True)
    spec.user = fields.string("user")
    options = fields.data.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise bad_request(f"'stream_options' must be an object, not {_json_type(options)}",
                              param="stream_options", code="invalid_type")
        if not spec.stream:
            raise bad_request("'stream_options' is only allowed when 'stream' is true", param="stream_options",
                              code="invalid_value")
        include = options.get("include_usage")
        if include is not None and not isinstance(include, bool):
            raise bad_request("'stream_options.include_usage' must be a boolean",
                              param="stream_options.include_usage", code="invalid_type")
        spec.include_usage = bool(include)
    sampler_fields(fields, spec)


def _chat_message(message: Any, where: str, tools_supported: bool) -> dict[str, Any]:
    """One chat message, OpenAI-shaped, as the render_prompt hook takes it."""
    from . import tool_fields

    if not isinstance(message, dict):
        raise bad_request(f"'{where}' must be an object, not {_json_type(message)}", param=where,
                          code="invalid_type")
    role = message.get("role")
    roles = CHAT_ROLES + (("tool",) if tools_supported else ())
    if role not in roles:
        detail = "tool messages need tool support, which this model's family lacks" if role == "tool" else \
            f"it must be one of {', '.join(roles)}"
        raise bad_request(f"'{where}.role' is {role!r}; {detail}", param=f"{where}.role", code="invalid_value")
    entry: dict[str, Any] = {"role": "system" if role == "developer" else role}
    if message.get("tool_calls"):
        if not tools_supported or role != "assistant":
            why = "only assistant messages carry tool calls" if tools_supported else \
                "it needs tool support, which this model's family lacks"
            raise bad_request(f"'{where}.tool_calls': {why}", param=f"{where}.tool_calls",
                              code="unsupported_parameter")
        entry["tool_calls"] = tool_fields.openai_tool_calls(message["tool_calls"], f"{where}.tool_calls")
    content = message.get("content")
    if content is None and role == "assistant":
        content = ""
    entry["content"] = _text_content(content, f"{where}.content", ("text",))
    for name in ("reasoning_content", "reasoning"):
        if role == "assistant" and message.get(name) is not None:
            entry["reasoning_content"] = tool_fields.text_field(message[name], f"{where}.{name}")
            break
    if role == "tool":
        if message.get("tool_call_id") is None:
            raise bad_request(f"'{where}.tool_call_id' is required for a tool message",
                              param=f"{where}.tool_call_id", code="missing_required_parameter")
        entry["tool_call_id"] = tool_fields.text_field(message["tool_call_id"], f"{where}.tool_call_id")
    return entry


def parse_chat(data: dict[str, Any], default_model: str, kv_slots: int, tools_supported: bool = False,
               thinking_switch: str | None = None, effort_variable: bool = False) -> GenerationSpec:
    """``POST /v1/chat/completions``."""
    fields = _Fields(data)
    spec = GenerationSpec(model=fields.string("model") or default_model)
    messages = data.get("messages")
    if messages is None:
        raise bad_request("'messages' is required", param="messages", code="missing_required_parameter")
    if not isinstance(messages, list):
        raise bad_request(f"'messages' must be an array, not {_json_type(messages)}", param="messages",
                          code="invalid_type")
    if not messages:
        raise bad_request("'messages' is empty; send at least one message", param="messages",
                          code="invalid_value")
    spec.messages = []
    for i, message in enumerate(messages):
        spec.messages.append(_chat_message(message, f"messages[{i}]", tools_supported))
    _openai_common(fields, spec, kv_slots)
    chat_logprobs(fields, spec)
    limit = fields.integer("max_completion_tokens", low=1)
    if limit is None:
        limit = fields.integer("max_tokens", low=1)
    spec.max_tokens = limit
    from . import tool_fields

    if not tools_supported:
        _refuse_if_set(fields, "tools", "this model's family has no tool-call support")
        _refuse_if_set(fields, "functions", "this model's family has no tool-call support")
        _refuse_if_set(fields, "tool_choice", "this model's family has no tool-call support", allowed=("none",))
    else:
        _refuse_if_set(fields, "functions", "the deprecated form of 'tools'; send 'tools'")
        spec.tools = tool_fields.openai_tools(data)
        spec.tool_choice = tool_fields.openai_tool_choice(data, spec.tools)
    spec.parallel_tool_calls = fields.boolean("parallel_tool_calls", True)
    spec.template_kwargs = tool_fields.template_kwargs(data, thinking_switch)
    if data.get("reasoning_effort") is not None:
        spec.template_kwargs.update(tool_fields.effort_kwargs(data["reasoning_effort"], "reasoning_effort",
                                                              thinking_switch, effort_variable))
    spec.response_format = response_format(data.get("response_format"))
    if spec.response_format is not None and spec.tool_choice not in ("auto", "none") and spec.tools:
        raise bad_request("'response_format' and a forced 'tool_choice' both constrain the reply; send one",
                          param="response_format", code="invalid_value")
    _refuse_if_set(fields, "audio", "the model produces text only")
    modalities = data.get("modalities")
    if modalities is not None and modalities != ["text"]:
        raise bad_request("'modalities' must be [\"text\"]", param="modalities", code="unsupported_parameter")
    return spec


def parse_completion(data: dict[str, Any], default_model: str, kv_slots: int) -> GenerationSpec:
    """``POST /v1/completions`` (legacy text completions)."""
    fields = _Fields(data)
    spec = GenerationSpec(model=fields.string("model") or default_model)
    prompt = data.get("prompt")
    if prompt is None:
        raise bad_request("'prompt' is required", param="prompt", code="missing_required_parameter")
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) > MAX_PROMPT_BATCH:
            raise bad_request(f"'prompt' holds {len(prompt)} prompts; at most {MAX_PROMPT_BATCH} are allowed",
                              param="prompt", code="invalid_value")
        items = [_one_prompt(p, f"prompt[{i}]") for i, p in enumerate(prompt)]
    else:
        items = [_one_prompt(prompt, "prompt")]
    spec.prompt_text, spec.prompt_ids = items[0]
    if len(items) > 1:
        spec.prompt_batch = items
    _openai_common(fields, spec, kv_slots)
    spec.max_tokens = fields.integer("max_tokens", low=1)
    if spec.max_tokens is None and "max_tokens" not in data:
        spec.max_tokens = 16  # OpenAI's documented default for this endpoint
    completion_logprobs(fields, spec)
    _refuse_if_set(fields, "suffix", "the engine does not fill in the middle")
    best_of = fields.integer("best_of", low=1)
    if best_of is not None and best_of != 1:
        raise bad_request(f"'best_of' is {best_of}; only 1 is supported", param="best_of",
                          code="unsupported_parameter")
    return spec


def _one_prompt(prompt: Any, where: str) -> tuple[str | None, list[int] | None]:
    """One completion prompt: (text, None) or (None, token ids)."""
    if isinstance(prompt, str):
        check_text(prompt, where)
        if not prompt:
            raise bad_request(f"'{where}' is empty", param=where, code="invalid_value")
        return prompt, None
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if any(t < 0 for t in prompt):
            raise bad_request(f"'{where}' holds a negative token id", param=where, code="invalid_value")
        return None, list(prompt)
    raise bad_request(f"'{where}' must be a string, an array of token ids, or an array of those (a batch)",
                      param=where, code="invalid_type")


def parse_messages(data: dict[str, Any], default_model: str, kv_slots: int, tools_supported: bool = False,
                   thinking_switch: str | None = None, count_only: bool = False) -> GenerationSpec:
    """``POST /v1/messages`` (Anthropic Messages); ``count_only``: ``/v1/messages/count_tokens``, the same
    conversation fields without the generation's."""
    from . import tool_fields

    fields = _Fields(data)
    spec = GenerationSpec(model=fields.string("model") or default_model)
    limit = fields.integer("max_tokens", low=1)
    if limit is None and not count_only:
        raise bad_request("'max_tokens' is required", param="max_tokens", code="missing_required_parameter")
    spec.max_tokens = limit
    system = data.get("system")
    if system is not None:
        spec.system = _text_content(system, "system", ("text",))
    messages = data.get("messages")
    if not isinstance(messages, list) or not messages:
        what = "is required" if messages is None else (
            "is empty; send at least one message" if isinstance(messages, list)
            else f"must be an array, not {_json_type(messages)}")
        raise bad_request(f"'messages' {what}", param="messages")
    spec.messages = []
    if spec.system:
        spec.messages.append({"role": "system", "content": spec.system})
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad_request(f"'{where}' must be an object, not {_json_type(message)}", param=where)
        role = message.get("role")
        if role not in ("user", "assistant"):
            raise bad_request(f"'{where}.role' is {role!r}; it must be 'user' or 'assistant' (the system prompt "
                              f"goes in the top-level 'system' field)", param=f"{where}.role")
        spec.messages += tool_fields.anthropic_message(message, where, tools_supported)
    final = spec.messages[-1]
    if final["role"] == "assistant":
        # prefill: the reply continues this text (Anthropic's own rule: it may not end in white space)
        where = f"messages[{len(messages) - 1}]"
        if final.get("tool_calls"):
            raise bad_request(f"'{where}' is a final assistant message with tool_use blocks; a prefill continues "
                              f"text only", param=f"{where}.content")
        if final["content"] != final["content"].rstrip():
            raise bad_request(f"'{where}.content': final assistant content cannot end with trailing whitespace",
                              param=f"{where}.content")
        if final["content"]:
            spec.continue_final = True
        else:
            spec.messages.pop()
    _common_sampling(fields, spec, kv_slots)
    spec.stop = _stop_list(fields, "stop_sequences", allow_string=False)
    metadata = data.get("metadata")
    if metadata is not None:
        if not isinstance(metadata, dict):
            raise bad_request(f"'metadata' must be an object, not {_json_type(metadata)}", param="metadata")
        user = metadata.get("user_id")
        if user is not None:
            if not isinstance(user, str):
                raise bad_request("'metadata.user_id' must be a string", param="metadata.user_id")
            check_text(user, "metadata.user_id")
            spec.user = user
    if not tools_supported:
        _refuse_if_set(fields, "tools", "this model's family has no tool-use support")
        _refuse_if_set(fields, "tool_choice", "this model's family has no tool-use support")
    else:
        spec.tools = tool_fields.anthropic_tools(data)
        spec.tool_choice = tool_fields.anthropic_tool_choice(data, spec.tools)
        choice = data.get("tool_choice")
        if isinstance(choice, dict) and choice.get("disable_parallel_tool_use") is True:
            spec.parallel_tool_calls = False
    spec.template_kwargs = tool_fields.anthropic_thinking(data, thinking_switch, spec.max_tokens)
    return spec

