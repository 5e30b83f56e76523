"""``coli chat --attach``: the terminal chat driving a running ``coli serve`` over its streaming API.

The server renders the prompt with the same code ``coli chat`` uses and keeps the conversation on one KV slot (its
``user`` field is a per-chat id), so a follow-up turn prefills only what is new, as it does locally. The history
lives here: each turn sends every message again, and a turn the server's context cannot hold drops the oldest
exchange and is sent again, as the local chat does. Reasoning (``reasoning_content``) is shown apart and, as the
templates expect, not sent back. A turn's figures come from the server's ``GET /profile`` record of it.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

import httpx

from .chat_session import TurnStats, sum_turns
from .errors import ColibriError, UsageError
from .server.config import DEFAULT_HOST, DEFAULT_PORT

DEFAULT_URL = f"http://{DEFAULT_HOST}:{DEFAULT_PORT}"
PROBE_TIMEOUT_S = 2.0
REPLY_TIMEOUT_S = 600.0          # between two events of a reply (the server sends keep-alives every 10 s)
PROFILE_WAIT_S = 2.0             # a cancelled turn's record lands once the engine confirms the cancel


class ServerReplyError(ColibriError):
    """The server refused or failed a turn (an HTTP error, or an error event in the stream)."""

    def __init__(self, message: str, code: str = "", hint: str | None = None):
        super().__init__(message, hint)
        self.code = code


def server_url(url: str | None) -> str:
    """``--attach``'s value as a base URL: the default server, a scheme added, ``/v1`` and slashes dropped."""
    text = (url or DEFAULT_URL).strip()
    if "://" not in text:
        text = "http://" + text
    text = text.rstrip("/")
    return text[:-3].rstrip("/") if text.endswith("/v1") else text


def probe(url: str) -> dict[str, Any] | None:
    """The server's ``/health`` answer (ready or still loading), or None when no colibri server answers there."""
    try:
        response = httpx.get(url + "/health", timeout=PROBE_TIMEOUT_S)
        body = response.json()
    except (httpx.HTTPError, ValueError):
        return None
    return body if isinstance(body, dict) and "status" in body else None


@dataclass
class RemoteReply:
    text: str = ""
    reasoning: str = ""
    interrupted: bool = False
    stats: dict[str, Any] = field(default_factory=dict)     # the server's profile record of the turn
    accept: dict[str, Any] = field(default_factory=dict)    # reused_tokens, as the local chat's accept


@dataclass
class AttachedSession:
    url: str
    api_key: str | None
    sampling: dict[str, Any]                 # temperature, top_p, top_k, seed: only those the user gave
    max_tokens: int
    system: str | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    messages: list[dict[str, str]] = field(default_factory=list)
    turns: list[TurnStats] = field(default_factory=list)
    dropped_messages: int = 0
    ctx: int | None = None
    conversation: str = ""
    _last_seq: int = 0                       # the newest /profile record already taken for a turn

    def __post_init__(self) -> None:
        self.client = httpx.Client(base_url=self.url, headers=self._headers(), timeout=httpx.Timeout(
            REPLY_TIMEOUT_S, connect=PROBE_TIMEOUT_S))
        self.reset()
        profile = self._get("/profile?n=1")
        self.ctx = profile.get("ctx") if profile else None
        self.model = profile.get("model", "") if profile else ""

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def close(self) -> None:
        self.client.close()

    def reset(self) -> None:
        """A new conversation: a new id (so a new slot owner on the server) and no history."""
        self.messages = [{"role": "system", "content": self.system}] if self.system else []
        self.turns.clear()
        self.conversation = "coli-chat-" + uuid.uuid4().hex[:16]

    def totals(self) -> TurnStats:
        return sum_turns(self.turns)

    # ---- one turn --------------------------------------------------------------------------------------------

    def turn(self, text: str, write: Callable[[str], None],
             think: Callable[[str], None] | None = None) -> RemoteReply:
        """Send one user message; the reply streams through ``write`` (its reasoning through ``think``)."""
        candidate = [*self.messages, {"role": "user", "content": text}]
        first = 1 if candidate[0]["role"] == "system" else 0
        while True:
            try:
                reply = self._stream(candidate, write, think or write)
                break
            except ServerReplyError as exc:
                if exc.code != "context_length_exceeded" or len(candidate) - first <= 1:
                    raise
                drop = 2 if len(candidate) - first > 2 else 1    # the oldest exchange, keeping roles alternating
                del candidate[first:first + drop]
                self.dropped_messages += drop
        candidate.append({"role": "assistant", "content": reply.text})
        self.messages = candidate
        s = reply.stats
        self.turns.append(TurnStats(prompt_tokens=int(s.get("prompt_tokens", 0)),
                                    reused_tokens=int(reply.accept.get("reused_tokens", 0)),
                                    prefilled_tokens=int(s.get("prefilled_tokens", 0)),
                                    generated_tokens=int(s.get("generated_tokens", 0)), done=s))
        return reply

    def _body(self, messages: list[dict[str, str]]) -> dict[str, Any]:
        body: dict[str, Any] = {"model": "colibri", "messages": messages, "stream": True, "user": self.conversation,
                                "max_tokens": self.max_tokens, "stream_options": {"include_usage": True},
                                **self.sampling}
        if self.template_kwargs:
            body["chat_template_kwargs"] = self.template_kwargs
        return body

    def _stream(self, messages: list[dict[str, str]], write: Callable[[str], None],
                think: Callable[[str], None]) -> RemoteReply:
        reply = RemoteReply()
        usage: dict[str, Any] = {}
        try:
            with self.client.stream("POST", "/v1/chat/completions", json=self._body(messages)) as response:
                if response.status_code != 200:
                    response.read()
                    raise self._refusal(response)
                try:
                    for data in _event_data(response):
                        chunk = json.loads(data)
                        if "error" in chunk:
                            error = chunk["error"] or {}
                            raise ServerReplyError(f"the server failed the reply: {error.get('message', '')}",
                                                   str(error.get("code") or ""))
                        usage = chunk.get("usage") or usage
                        for choice in chunk.get("choices") or []:
                            delta = choice.get("delta") or {}
                            if delta.get("reasoning_content"):
                                reply.reasoning += delta["reasoning_content"]
                                think(delta["reasoning_content"])
                            if delta.get("content"):
                                reply.text += delta["content"]
                                write(delta["content"])
                except KeyboardInterrupt:
                    reply.interrupted = True      # leaving the block closes the connection: the server cancels
        except httpx.HTTPError as exc:
            raise ColibriError(f"lost the server at {self.url}: {exc}",
                               "is it still running? (coli status, or the terminal running coli serve)") from None
        reply.stats = self._turn_record(wait=reply.interrupted) or _from_usage(usage, reply.interrupted)
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        reply.accept = {"reused_tokens": int(cached if cached is not None else reply.stats.get("cached_tokens", 0))}
        return reply

    def _refusal(self, response: httpx.Response) -> ServerReplyError:
        try:
            error = response.json().get("error") or {}
        except ValueError:
            error = {}
        message, code = str(error.get("message") or response.reason_phrase), str(error.get("code") or "")
        if response.status_code == 401:
            return ServerReplyError(f"{self.url} refused the API key: {message}", code,
                                    "pass --api-key KEY or set COLIBRI_API_KEY to the server's key")
        return ServerReplyError(f"the server refused the turn ({response.status_code}): {message}", code)

    # ---- figures ---------------------------------------------------------------------------------------------

    def _get(self, path: str) -> dict[str, Any] | None:
        try:
            response = self.client.get(path, timeout=PROBE_TIMEOUT_S * 5)
        except httpx.HTTPError:
            return None
        if response.status_code == 401:
            raise UsageError(f"{self.url} needs its API key", "pass --api-key KEY or set COLIBRI_API_KEY")
        return response.json() if response.status_code == 200 else None

    def _turn_record(self, wait: bool) -> dict[str, Any] | None:
        """The server's /profile record of this conversation's newest turn (None if it kept none)."""
        deadline = time.monotonic() + (PROFILE_WAIT_S if wait else 0.0)
        while True:
            profile = self._get("/profile?n=64") or {}
            mine = [r for r in profile.get("requests", [])
                    if r.get("user") == self.conversation and int(r.get("seq", 0)) > self._last_seq]
            if mine:
                self._last_seq = int(mine[-1]["seq"])
                return mine[-1]
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def engine_stats(self) -> dict[str, Any] | None:
        """The engine's counters (``GET /experts``), for ``/stats``."""
        return self._get("/experts")


def _from_usage(usage: dict[str, Any], interrupted: bool) -> dict[str, Any]:
    prompt = int(usage.get("prompt_tokens", 0))
    cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
    return {"prompt_tokens": prompt, "prefilled_tokens": prompt - cached,
            "generated_tokens": int(usage.get("completion_tokens", 0)),
            **({"reason": "cancelled"} if interrupted else {})}


def _event_data(response: httpx.Response):
    """The ``data:`` payloads of a server-sent event stream, until ``[DONE]`` (comments are keep-alives)."""
    for line in response.iter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        yield data
