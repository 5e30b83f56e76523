"""One generation: queue for a slot, submit to the engine, turn its events into text deltas.

The route layers (OpenAI, Anthropic) only format what this yields. The order of a run is:

1. ``await run.start()`` — take a slot (may wait in the queue), submit, and wait for the engine's ``accept``.
   Any refusal up to here (queue full, prompt too long, engine down) raises :class:`APIError` *before* a
   response is committed, so a client always gets a clean status code for it.
2. ``async for item in run.stream()`` — :class:`Delta` text, :class:`KeepAlive` during long prefills, and one
   final :class:`Finished` (or :class:`Failed` if the engine died mid-way).
3. ``run.abort()`` in a ``finally`` — if the client left early, cancel the sequence in the engine. The slot is
   released by the pump thread only when the engine confirms (its ``done``), or dies.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..detok import IncrementalDetokenizer
from ..engine import EngineRequestError
from ..errors import ColibriError, EngineError
from .access_log import note
from .engine_host import EngineHost
from .errors import APIError, bad_request
from .metrics import Metrics
from .scheduler import Lease, SlotScheduler
from .textgen import StopMatcher
from .validation import GenerationSpec

KEEPALIVE_S = 10.0
DISCONNECT_POLL_S = 0.5


class Codec(Protocol):
    """Tokenizer and chat template of the served model (the same code ``coli chat`` renders with)."""

    stop_ids: Sequence[int]

    def chat_ids(self, messages: list[dict[str, str]]) -> list[int]: ...

    def text_ids(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


@dataclass
class Delta:
    text: str


@dataclass
class KeepAlive:
    pass


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass
class Finished:
    reason: str                      # "stop" (stop token or sequence), "length"
    stop_sequence: str | None
    usage: Usage
    stats: dict[str, Any] = field(default_factory=dict)


@dataclass
class Failed:
    error: APIError


@dataclass
class Services:
    """What every run needs; built once by the app."""

    host: EngineHost
    scheduler: SlotScheduler
    codec: Codec
    metrics: Metrics
    ctx: int
    queue_timeout: float
    default_sampling: Mapping[str, float] = field(default_factory=dict)   # the checkpoint's generation_config


def conversation_key(spec: GenerationSpec) -> str | None:
    """Which conversation a request continues: the client's ``user``, else a hash of its opening messages.

    A follow-up turn repeats the opening messages verbatim, so it hashes to the same key and lands on the slot
    whose KV cache already holds them.
    """
    if spec.user:
        return "user:" + spec.user
    if spec.messages:
        opening = []
        for message in spec.messages:
            opening.append(message)
            if message["role"] == "user":
                break
        material = json.dumps(opening, sort_keys=True)
    elif spec.prompt_text:
        material = spec.prompt_text[:512]
    elif spec.prompt_ids:
        material = json.dumps(spec.prompt_ids[:128])
    else:
        return None
    return "hash:" + hashlib.sha256(material.encode()).hexdigest()[:24]


class GenerationRun:
    def __init__(self, services: Services, spec: GenerationSpec, route: str):
        self.s = services
        self.spec = spec
        self.route = route
        self.prompt_ids: list[int] = []
        self.max_tokens = 0
        self.accept: dict[str, Any] = {}
        self._lease: Lease | None = None
        self._request: Any = None
        self._engine: Any = None
        self._events: asyncio.Queue = asyncio.Queue()
        self._finished = False
        self._aborted = False
        self._started_at = time.monotonic()

    # ---- before commit ---------------------------------------------------------------------------------------

    def prepare(self) -> None:
        """Tokenize and size the request; raises 400 when the prompt alone does not fit the context."""
        spec, codec = self.spec, self.s.codec
        try:
            if spec.prompt_ids is not None:
                self.prompt_ids = list(spec.prompt_ids)
            elif spec.prompt_text is not None:
                self.prompt_ids = codec.text_ids(spec.prompt_text)
            else:
                self.prompt_ids = codec.chat_ids(spec.messages or [])
        except ColibriError as exc:   # e.g. the template refuses the roles' order, or there is no template
            raise bad_request(exc.one_line(), param="messages" if spec.messages else "prompt",
                              code="invalid_prompt") from None
        vocab = getattr(codec, "vocab_size", 0)
        if vocab and any(t >= vocab for t in self.prompt_ids):
            raise bad_request(f"'prompt' holds a token id past the vocabulary ({vocab})", param="prompt",
                              code="invalid_value")
        if not self.prompt_ids:
            raise bad_request("the prompt is empty after tokenization", param="messages" if spec.messages else
                              "prompt")
        room = self.s.ctx - len(self.prompt_ids)
        if room < 1:
            raise APIError(400, f"the prompt is {len(self.prompt_ids)} tokens; this server's context is "
                                f"{self.s.ctx} tokens (prompt plus completion), so there is no room to generate. "
                                f"Shorten the messages", param="messages" if spec.messages else "prompt",
                           code="context_length_exceeded")
        # Over-large limits are clamped to what fits, never refused (a client's "max" is a ceiling, not a demand).
        self.max_tokens = room if spec.max_tokens is None else min(spec.max_tokens, room)

    async def start(self) -> None:
        await asyncio.to_thread(self.prepare)   # tokenizing a large prompt must not stall other streams
        note(prompt_tokens=len(self.prompt_ids), completion_tokens=0)
        self._lease = await self.s.scheduler.acquire(conversation_key(self.spec), self.spec.cache_slot)
        try:
            self._engine = await self.s.host.engine(self.s.queue_timeout)
            try:
                self._request = self._engine.submit(
                    self.prompt_ids, slot=self._lease.slot, max_tokens=self.max_tokens, **self.sampling(),
                    stop=list(self.s.codec.stop_ids))
            except EngineError as exc:
                self.s.host.report_death(self._engine, exc)
                raise APIError(503, f"engine unavailable: {exc.one_line()}", code="engine_unavailable",
                               headers={"Retry-After": "2"}) from None
        except BaseException:
            self._lease.release()
            raise
        self.s.metrics.request_started()
        threading.Thread(target=self._pump, args=(asyncio.get_running_loop(), self._request, self._lease),
                         name=f"pump-{self._request.id}", daemon=True).start()
        try:
            first = await self._events.get()
        except asyncio.CancelledError:
            self.abort()
            raise
        if first[0] == "event" and first[1].get("ev") == "accept":
            self.accept = first[1]
            return
        self._finished = True
        raise self._refusal(first)

    def sampling(self) -> dict[str, Any]:
        """The request's sampling, with what it leaves out taken from the checkpoint (as ``coli run`` does)."""
        spec, base = self.spec, self.s.default_sampling
        temperature = spec.temperature if spec.temperature is not None else float(base.get("temperature", 1.0))
        top_p = spec.top_p if spec.top_p is not None else float(base.get("top_p", 1.0))
        top_k = spec.top_k if spec.top_k is not None else int(base.get("top_k", 0))
        seed = spec.seed if spec.seed is not None else random.getrandbits(63)
        return {"temperature": temperature, "top_p": top_p, "top_k": top_k, "seed": seed & (2**63 - 1)}

    def _pump(self, loop: asyncio.AbstractEventLoop, request: Any, lease: Lease) -> None:
        """Thread: move the engine's events onto the loop; release the slot once the engine is done with it."""
        put = self._events.put_nowait
        clock = self.s.metrics.token_clock(self._started_at)
        try:
            for event in request:
                if event.get("ev") == "token":
                    clock.token()
                elif event.get("ev") == "done":
                    loop.call_soon_threadsafe(self.s.metrics.engine_done, event)
                loop.call_soon_threadsafe(put, ("event", event))
        except EngineRequestError as exc:
            loop.call_soon_threadsafe(put, ("refused", exc))
        except EngineError as exc:
            loop.call_soon_threadsafe(put, ("died", exc))
            loop.call_soon_threadsafe(self.s.host.report_death, self._engine, exc)
        except Exception as exc:  # noqa: BLE001 - a broken event must end this request, not leak the slot
            loop.call_soon_threadsafe(put, ("died", EngineError(f"engine event could not be read: {exc}")))
        finally:
            loop.call_soon_threadsafe(lease.release)

    def _refusal(self, item: tuple[str, Any]) -> APIError:
        kind, payload = item
        if kind == "refused":
            code = payload.code
            if code == "context_exceeded":
                return APIError(400, f"the prompt does not fit the context: {payload.message}",
                                param="messages" if self.spec.messages else "prompt", code="context_length_exceeded")
            if code == "bad_request":
                return APIError(400, payload.message, code="invalid_request")
            if code == "busy":
                return APIError(429, "engine busy; retry later", code="engine_busy", headers={"Retry-After": "1"})
            return APIError(500, f"engine error: {payload.message}", code="engine_error")
        if kind == "died":
            return APIError(503, f"the engine died while serving this request: {payload.one_line()}; it is being "
                                 f"restarted, retry shortly", code="engine_died", headers={"Retry-After": "5"})
        return APIError(500, f"engine sent {payload.get('ev')!r} before accepting the request", code="engine_error")

    # ---- after commit ----------------------------------------------------------------------------------------

    async def stream(self) -> AsyncIterator[Delta | KeepAlive | Finished | Failed]:
        stop_ids = set(self.s.codec.stop_ids)
        # stop tokens end the turn; their text (an end-of-turn marker) is never shown
        decoder = IncrementalDetokenizer(self.s.codec.decode, skip_ids=tuple(stop_ids))
        stops = StopMatcher(self.spec.stop)
        generated = 0
        reused = int(self.accept.get("reused_tokens", 0) or 0)
        while True:
            try:
                kind, payload = await asyncio.wait_for(self._events.get(), timeout=KEEPALIVE_S)
            except asyncio.TimeoutError:
                yield KeepAlive()
                continue
            if kind != "event":
                self._finished = True
                error = self._refusal((kind, payload))
                self.s.metrics.request_failed(error.code or "error")
                yield Failed(error)
                return
            ev = payload.get("ev")
            if ev == "keepalive":
                yield KeepAlive()
            elif ev == "token":
                generated += 1
                note(completion_tokens=generated)
                text = stops.feed(decoder.push(int(payload["tok"])))
                if text:
                    yield Delta(text)
                if stops.matched is not None:
                    self.abort()
                    self._finished = True
                    usage = Usage(len(self.prompt_ids), generated, reused)
                    self.s.metrics.request_finished(time.monotonic() - self._started_at)
                    yield Finished("stop", stops.matched, usage)
                    return
            elif ev == "done":
                self._finished = True
                tail = stops.feed(decoder.flush())
                tail += stops.flush()
                if tail:
                    yield Delta(tail)
                prompt_tokens = int(payload.get("prompt_tokens", len(self.prompt_ids)))
                prefilled = int(payload.get("prefilled_tokens", prompt_tokens - reused))
                usage = Usage(prompt_tokens, int(payload.get("generated_tokens", generated)),
                              max(0, prompt_tokens - prefilled))
                note(prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens)
                self.s.metrics.request_finished(time.monotonic() - self._started_at)
                reason = "length" if payload.get("reason") == "length" else "stop"
                if stops.matched is not None:
                    yield Finished("stop", stops.matched, usage, payload)
                else:
                    yield Finished(reason, None, usage, payload)
                return

    def abort(self) -> None:
        """Cancel the sequence in the engine if it is still running (client gone, stop sequence seen)."""
        if self._request is not None and not self._aborted and not self._request.finished:
            self._aborted = True
            try:
                self._request.cancel()
            except EngineError:
                pass

    def close(self) -> None:
        """Called when the consumer is finished for any reason."""
        if not self._finished:
            self.s.metrics.request_failed("client_disconnected")
            self.abort()


async def run_to_completion(run: GenerationRun, disconnected: Callable[[], Any]) -> tuple[str, Finished]:
    """Collect a whole completion (non-streaming), cancelling it if the client hangs up meanwhile."""
    pieces: list[str] = []

    async def consume() -> Finished | Failed:
        async for item in run.stream():
            if isinstance(item, Delta):
                pieces.append(item.text)
            elif isinstance(item, (Finished, Failed)):
                return item
        raise AssertionError("stream ended without a final item")

    task = asyncio.ensure_future(consume())
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if not task.done() and await disconnected():
                task.cancel()
                raise APIError(499, "client closed the connection", code="client_disconnected")
        result = task.result()
    finally:
        run.close()
    if isinstance(result, Failed):
        raise result.error
    return "".join(pieces), result
