"""Turning what a user typed into prompt ids, and choosing sampling settings the way transformers would."""

from __future__ import annotations

import re
import secrets
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from .chat_template import read_json_file
from .errors import UsageError
from .tokenizer import TextTokenizer

MAX_TEMPERATURE = 2.0          # as the OpenAI API (and coli serve) accept
# What every command says about a checkpoint without a chat template (doctor, run, chat, serve say the same).
NO_TEMPLATE_NOTICE = ("no chat template (chat_template.jinja, chat_template.json or tokenizer_config.json "
                      "chat_template): coli run and coli chat send plain text, coli serve refuses chat requests "
                      "(use /v1/completions); add the model's chat_template.jinja to chat")
NO_TEMPLATE_FIX = "use /v1/completions with a plain prompt, or add the model's chat_template.jinja and restart"


@dataclass(frozen=True)
class Prompt:
    ids: list[int]
    mode: str                 # "chat" or "raw"
    text: str                 # what was tokenized (the rendered template in chat mode)
    notice: str = ""          # shown to the user when the mode differs from what they asked


def read_prompt_file(path: Path) -> str:
    """The prompt in ``path`` (``-``: standard input) as UTF-8 text."""
    try:
        data = sys.stdin.buffer.read() if str(path) == "-" else Path(path).read_bytes()
    except OSError as exc:
        raise UsageError(f"--prompt-file {path}: cannot read ({exc.strerror})", "check the path") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UsageError(f"--prompt-file {path}: not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start})",
                         "convert it first, e.g. iconv -f latin1 -t utf-8") from None


def thinking_switch(source: str) -> str | None:
    """The template variable that turns reasoning on: ``enable_thinking`` (Qwen3, GLM) or ``thinking`` (DeepSeek
    V3.1 and later), recognised by how the template tests it, so prose that merely says "thinking" is not taken."""
    if "enable_thinking" in source:
        return "enable_thinking"
    if re.search(r"\bthinking\s+is\s+(?:not\s+)?defined|\bif\s+(?:not\s+)?thinking\b", source):
        return "thinking"
    return None


def thinking_kwargs(tok: TextTokenizer, think: bool | None) -> dict[str, Any]:
    """The template's thinking switch set for ``--think/--no-think``, only when the template has one; asking for it
    on a template without a switch is refused rather than silently ignored."""
    if think is None:
        return {}
    switch = next((name for t in tok.templates.values() if (name := thinking_switch(t.source))), None)
    if switch is None:
        flag = "--think" if think else "--no-think"
        raise UsageError(f"{flag}: this checkpoint's chat template has no thinking switch "
                         "(enable_thinking or thinking)", "drop the flag (the model decides whether to think)")
    return {switch: think}


# Names the renderer itself passes to a template; a request's template variables may not replace them.
RESERVED_TEMPLATE_NAMES = frozenset({"messages", "tools", "documents", "add_generation_prompt", "template",
                                     "continue_final_message"})


def render_conversation(tok: TextTokenizer, messages: Any, tools: Any, options: Mapping[str, Any]) -> str:
    """A conversation rendered with the checkpoint's template, as ``apply_chat_template(messages, tools=tools,
    add_generation_prompt=..., **template_kwargs)`` renders it."""
    template_kwargs = dict(options.get("template_kwargs") or {})
    clash = sorted(RESERVED_TEMPLATE_NAMES.intersection(template_kwargs) | set(tok.special_tokens).intersection(
        template_kwargs))
    if clash:
        raise UsageError(f"template variable {clash[0]!r} cannot be set by a request",
                         "set only the template's own switches, such as enable_thinking")
    if not options.get("continue_final_message"):
        return tok.render_chat(messages, add_generation_prompt=options.get("add_generation_prompt", True),
                               template=options.get("template"), tools=tools or None, **template_kwargs)
    marked = [*messages[:-1], {**messages[-1], "content": str(messages[-1].get("content") or "") + CONTINUE_MARK}]
    rendered = tok.render_chat(marked, add_generation_prompt=False, template=options.get("template"),
                               tools=tools or None, **template_kwargs)
    return cut_at_continue_mark(rendered)


# Prefill ("continue the final message"), as transformers' ``continue_final_message`` does it: the final message's
# text gets a mark, the conversation is rendered without a generation prompt, and the text ends where the mark
# began (trailing space the template stripped from the message stays stripped). Whatever the template closes a
# message with (an end-of-turn token) is cut with it.
CONTINUE_MARK = "COLIBRI_CONTINUE_FINAL_MESSAGE "


def cut_at_continue_mark(rendered: str) -> str:
    at = rendered.rfind(CONTINUE_MARK.strip())
    if at < 0:
        raise UsageError("the chat template drops the final assistant message's text, so it cannot be continued",
                         "end the conversation with a user message")
    if rendered[at:at + len(CONTINUE_MARK)] == CONTINUE_MARK:
        return rendered[:at]
    return rendered[:at].rstrip()


def build_prompt(tok: TextTokenizer, text: str, chat: bool | None,
                 template_kwargs: Mapping[str, Any] | None = None) -> Prompt:
    """Chat mode renders one user turn with the checkpoint's template (the default when it has one)."""
    if chat is not False and not tok.has_chat_template:
        return Prompt(tok.encode(text), "raw", text, NO_TEMPLATE_NOTICE)
    if chat is not False:
        rendered = tok.render_chat([{"role": "user", "content": text}], add_generation_prompt=True,
                                   **(template_kwargs or {}))
        return Prompt(tok.encode(rendered, add_special_tokens=False), "chat", rendered)
    return Prompt(tok.encode(text), "raw", text)


@dataclass(frozen=True)
class Sampling:
    temperature: float
    top_p: float
    top_k: int
    seed: int

    def as_request(self) -> dict[str, Any]:
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "seed": self.seed}


def checkpoint_sampling(model_dir: Path) -> Mapping[str, Any]:
    """generation_config.json's sampling settings when it asks for sampling; greedy otherwise (transformers' rule)."""
    gen = read_json_file(model_dir / "generation_config.json") or {}
    if not gen.get("do_sample"):
        return {"temperature": 0.0}
    return {k: gen[k] for k in ("temperature", "top_p", "top_k") if isinstance(gen.get(k), (int, float))}


def choose_sampling(model_dir: Path, temperature: float | None, top_p: float | None, top_k: int | None,
                    seed: int | None) -> Sampling:
    base = checkpoint_sampling(model_dir)
    temp = float(base.get("temperature", 1.0) if temperature is None else temperature)
    p = float(base.get("top_p", 1.0) if top_p is None else top_p)
    k = int(base.get("top_k", 0) if top_k is None else top_k)
    if not 0 <= temp <= MAX_TEMPERATURE:
        raise UsageError(f"--temp {temp:g}: out of range", f"pass --temp 0 (greedy) to {MAX_TEMPERATURE:g}")
    if not 0 < p <= 1:
        raise UsageError(f"--top-p {p:g}: must be in (0, 1]")
    if k < 0:
        raise UsageError(f"--top-k {k}: must be 0 (off) or more")
    return Sampling(temp, p, k, secrets.randbelow(2 ** 31) if seed is None else int(seed))


def clamp_max_tokens(max_tokens: int, prompt_len: int, ctx: int, max_ctx: int | None = None) -> tuple[int, str]:
    """Generation budget within the context; an over-large request is clamped (with a notice), never refused.

    A prompt that leaves no room is refused with a ``--ctx`` that would hold it, never one above ``max_ctx`` (the
    most the model and its engine support)."""
    if max_tokens < 1:
        raise UsageError(f"--max-tokens {max_tokens}: must be at least 1")
    room = ctx - prompt_len
    if room < 1:
        wanted = prompt_len + max_tokens
        if max_ctx is not None and prompt_len >= max_ctx:
            hint = f"shorten the prompt below {max_ctx} tokens, the most this model's context holds"
        elif max_ctx is not None and wanted > max_ctx:
            hint = f"pass --ctx {max_ctx} (the model's maximum) or a shorter prompt"
        else:
            hint = f"pass --ctx {wanted} or a shorter prompt"
        raise UsageError(f"the prompt is {prompt_len} tokens and --ctx {ctx} leaves no room to generate", hint)
    if max_tokens > room:
        return room, (f"--max-tokens {max_tokens} clamped to {room}: "
                      f"the prompt uses {prompt_len} of {ctx} context tokens")
    return max_tokens, ""
