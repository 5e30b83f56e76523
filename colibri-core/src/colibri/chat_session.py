"""A conversation with one loaded engine: every turn re-renders the whole history with the checkpoint's template
and submits it to the same slot, so the engine's prefix reuse prefills only what is new.

That only works if re-rendering is byte-stable, which is why templates are rendered exactly as transformers does.
When the history outgrows the context, the oldest exchanges are dropped (the system message stays).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from .engine import Engine
from .errors import UsageError
from .prompt import NO_TEMPLATE_NOTICE, Sampling
from .reasoning_view import ReasoningView
from .streaming import Reply, stream_reply
from .tokenizer import TextTokenizer

SLOT = 0
MIN_REPLY_ROOM = 64        # a turn is only worth submitting if at least this many tokens can be generated


@dataclass
class TurnStats:
    prompt_tokens: int = 0
    reused_tokens: int = 0
    prefilled_tokens: int = 0
    generated_tokens: int = 0
    done: dict[str, Any] = field(default_factory=dict)


@dataclass
class ChatSession:
    engine: Engine
    tok: TextTokenizer
    sampling: Sampling
    max_tokens: int
    ctx: int
    system: str | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)   # e.g. enable_thinking (--think/--no-think)
    messages: list[dict[str, str]] = field(default_factory=list)
    turns: list[TurnStats] = field(default_factory=list)
    dropped_messages: int = 0
    max_ctx: int | None = None          # the most the model's context holds, for hints
    parser: Callable[[], Any] | None = None   # the family's parse_output: a reply's reasoning is shown apart
    transcript: Path | None = None      # where the conversation is kept after each turn (coli chat --resume)

    def __post_init__(self) -> None:
        self.reset_history()

    @property
    def uses_template(self) -> bool:
        return self.tok.has_chat_template

    @property
    def notice(self) -> str:
        return "" if self.uses_template else NO_TEMPLATE_NOTICE

    def reset_history(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def reset(self) -> None:
        """A new conversation: forget the history and the slot's cached prefix."""
        self.reset_history()
        self.turns.clear()
        self.engine.reset(SLOT)

    def _encode(self, messages: list[dict[str, str]]) -> list[int]:
        if self.uses_template:
            return self.tok.encode_chat(messages, add_generation_prompt=True, **self.template_kwargs)
        # Plain text: the turns one after another, so the model simply continues the transcript.
        return self.tok.encode("".join(m["content"] + "\n" for m in messages))

    def prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """The history rendered and tokenized, with the oldest exchanges dropped until a reply fits."""
        room = min(self.max_tokens, MIN_REPLY_ROOM)
        ids = self._encode(messages)
        first = 1 if messages and messages[0]["role"] == "system" else 0
        while len(ids) + room > self.ctx and len(messages) - first > 1:
            # Drop the oldest message after the system prompt (and its reply, to keep roles alternating).
            drop = 2 if len(messages) - first > 2 else 1
            del messages[first:first + drop]
            self.dropped_messages += drop
            ids = self._encode(messages)
        if len(ids) + 1 > self.ctx:
            larger = self.max_ctx is None or self.ctx < self.max_ctx
            raise UsageError(f"the message is {len(ids)} tokens with the template; --ctx {self.ctx} cannot hold it",
                             "send a shorter message" + (f" or restart with a larger --ctx (at most {self.max_ctx})"
                                                         if larger and self.max_ctx else
                                                         " or restart with a larger --ctx" if larger else
                                                         f" ({self.ctx} is the model's maximum context)"))
        return ids

    def turn(self, text: str, write: Callable[[str], None]) -> Reply:
        """Send one user message; the assistant's reply is streamed through ``write`` and kept in the history."""
        candidate = [*self.messages, {"role": "user", "content": text}]
        ids = self.prompt_ids(candidate)
        budget = max(1, min(self.max_tokens, self.ctx - len(ids)))
        view = ReasoningView(self.parser() if self.parser is not None and self.uses_template else None,
                             self.tok.decode(ids[-64:], skip_special_tokens=False), write)
        reply = stream_reply(self.engine, self.tok, ids, write=view.feed, slot=SLOT, max_tokens=budget,
                             stop=self.tok.stop_ids, **self.sampling.as_request())
        view.finish()
        candidate.append({"role": "assistant", "content": reply.text})
        self.messages = candidate
        if self.transcript is not None:
            save_transcript(self.transcript, self.messages)
        s = reply.stats
        self.turns.append(TurnStats(prompt_tokens=len(ids), reused_tokens=int(reply.accept.get("reused_tokens", 0)),
                                    prefilled_tokens=int(s.get("prefilled_tokens", len(ids))),
                                    generated_tokens=int(s.get("generated_tokens", len(reply.tokens))), done=s))
        return reply

    def totals(self) -> TurnStats:
        return sum_turns(self.turns)


def sum_turns(turns: list[TurnStats]) -> TurnStats:
    """The conversation's totals (``/stats``), for a local or an attached chat."""
    total = TurnStats()
    for t in turns:
        total.prompt_tokens += t.prompt_tokens
        total.reused_tokens += t.reused_tokens
        total.prefilled_tokens += t.prefilled_tokens
        total.generated_tokens += t.generated_tokens
    return total


def save_transcript(path: Path, messages: list[dict[str, str]]) -> None:
    """The conversation so far, atomically (a crash mid-write keeps the previous turn's)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.tmp.{os.getpid()}")
        tmp.write_text(json.dumps({"messages": messages}, ensure_ascii=False) + "\n")
        os.replace(tmp, path)
    except OSError:
        pass   # only --resume needs it, and it says so when the file is missing


def load_transcript(path: Path) -> list[dict[str, str]] | None:
    """The messages :func:`save_transcript` kept, or None when there are none (or the file is not one)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    messages = data.get("messages") if isinstance(data, dict) else None
    if not isinstance(messages, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages):
        return None
    return [{"role": m["role"], "content": m["content"]} for m in messages] or None
