"""One generation: queue for a slot, submit to the engine, turn its events into text deltas.

The route layers (OpenAI, Anthropic) only format what this yields. The order of a run is:

1. ``await run.start()`` — take a slot (may wait in the queue), submit, and wait for the engine's ``accept``.
   Any refusal up to here (queue full, prompt too long, engine down) raises :class:`APIError` *before* a
   response is committed, so a client always gets a clean status code for it.
2. ``async for item in run.stream()`` — :class:`Delta` text, :class:`KeepAlive` during long prefills, and one
   final :class:`Finished` (or :class:`Failed` if the engine died mid-way).
3. ``run.close()`` in a ``finally`` — if the client left early, cancel the sequence in the engine. The slot is
   released by the pump thread only when the engine confirms (its ``done``), or dies.

A hang-up is certain to cancel: the run registers its cancel with the request's :class:`~.hangup.HangUpWatch`,
which calls it the moment ``http.disconnect`` arrives, whatever the run is awaiting. A client that leaves while
queued, while its prompt is tokenized or while the engine loads is dropped before it reaches the engine.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..constraints import ConstraintError
from ..detok import IncrementalDetokenizer
from ..engine import EngineRequestError
from ..errors import ColibriError, EngineError
from .access_log import note
from .engine_host import EngineHost
from .errors import APIError, bad_request
from .hangup import HangUpWatch
from .metrics import Metrics
from . import logprobs, structured
from .observe import Profile
from .prompt_bound import PromptBound
from .scheduler import Lease, SlotScheduler
from .textgen import StopMatcher
from .validation import GenerationSpec

KEEPALIVE_S = 10.0


def hung_up_error() -> APIError:
    # nobody reads this answer; the status only labels the request in the access log and the metrics
    return APIError(499, "client closed the connection", code="client_disconnected")


class Codec(Protocol):
    """Tokenizer and chat template of the served model (the same code ``coli chat`` renders with)."""

    @property
    def stop_ids(self) -> Sequence[int]: ...

    @property
    def bound(self) -> PromptBound: ...

    def render_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                    template_kwargs: Mapping[str, Any] | None = None, continue_final: bool = False) -> str: ...

    def encode(self, text: str, add_special_tokens: bool) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


@dataclass
class Delta:
    text: str
    logprobs: list[dict[str, Any]] = field(default_factory=list)   # OpenAI chat entries of the tokens it ends


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
    profile: Profile = field(default_factory=Profile)                     # the last sequences (GET /profile)


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
    def __init__(self, services: Services, spec: GenerationSpec, route: str, hangup: HangUpWatch):
        self.s = services
        self.spec = spec
        self.route = route
        self.hangup = hangup
        self.prompt_ids: list[int] = []
        self._text = ""                       # the prompt text, between measure() and prepare()
        self.prompt_tail = ""                 # its end: whether it opened a reasoning block
        self.max_tokens = 0
        self.accept: dict[str, Any] = {}
        self._lease: Lease | None = None
        self._request: Any = None
        self._engine: Any = None
        self._events: asyncio.Queue = asyncio.Queue()
        self._finished = False
        self._aborted = False
        self._closed = False
        self._next: asyncio.Future | None = None   # the pending read of the next engine event
        self._started_at = time.monotonic()
        self._grammar: str | None = None            # constrained decoding (response_format, a forced tool call)
        self._constraint: Any = None
        self.prompt_logprobs: list[dict[str, Any]] = []   # echo with logprobs: one entry per prompt token
        self.token_logprobs: list[dict[str, Any]] = []    # logprobs: one entry per generated token
        self._logprobs_taken = 0

    # ---- before commit ---------------------------------------------------------------------------------------

    def measure(self) -> None:
        """Before queueing: render the prompt text and refuse, by its length alone, one that cannot fit the context.

        Nothing is tokenized here (that costs far more memory than the text), so a huge prompt costs its bytes."""
        spec, codec = self.spec, self.s.codec
        if spec.prompt_ids is not None:
            if len(spec.prompt_ids) >= self.s.ctx:
                raise self._too_long(f"{len(spec.prompt_ids)} tokens")
            self._compile_grammar()
            return
        try:
            self._text = spec.prompt_text if spec.prompt_text is not None else self._render(codec)
        except ColibriError as exc:   # e.g. the template refuses the roles' order, or there is no template
            # a renderer that names the request option it cannot honour (``option``) gets it as the param
            raise bad_request(exc.one_line(), param=getattr(exc, "option", None) or self._prompt_param(),
                              code="invalid_prompt") from None
        self.prompt_tail = self._text[-256:]
        self._compile_grammar()
        size = len(self._text.encode("utf-8"))
        at_least = codec.bound.min_tokens(size)
        if at_least >= self.s.ctx:
            raise self._too_long(f"{size} bytes, so at least {at_least} tokens (no token of this model covers more "
                                 f"than {codec.bound.bytes_per_token} bytes)")

    def _compile_grammar(self) -> None:
        spec = self.spec
        try:
            self._grammar = structured.grammar_for(spec, self.s.codec, self.prompt_tail)
        except ConstraintError as exc:
            raise bad_request(exc.one_line(), param="response_format" if spec.response_format else "tool_choice",
                              code="invalid_grammar") from None

    def _render(self, codec: Codec) -> str:
        spec = self.spec
        if spec.continue_final:
            return codec.render_chat(spec.messages or [], tools=spec.tools, template_kwargs=spec.template_kwargs,
                                     continue_final=True)
        if spec.tools is None and not spec.template_kwargs:
            return codec.render_chat(spec.messages or [])
        return codec.render_chat(spec.messages or [], tools=spec.tools, template_kwargs=spec.template_kwargs)

    def prepare(self) -> None:
        """Under admission (a slot is held): tokenize and size the request; 400 when the prompt leaves no room."""
        spec, codec = self.spec, self.s.codec
        if spec.prompt_ids is not None:
            self.prompt_ids = list(spec.prompt_ids)
        else:
            # a completion's text gets the tokenizer's own BOS and the like; a rendered chat already holds its own
            self.prompt_ids = codec.encode(self._text, add_special_tokens=spec.prompt_text is not None)
            self._text = ""
        vocab = getattr(codec, "vocab_size", 0)
        if vocab and any(t >= vocab for t in self.prompt_ids):
            raise bad_request(f"'prompt' holds a token id past the vocabulary ({vocab})", param="prompt",
                              code="invalid_value")
        if vocab and any(t >= vocab for t in spec.logit_bias):
            raise bad_request(f"'logit_bias' holds a token id past the vocabulary ({vocab})", param="logit_bias",
                              code="invalid_value")
        if not self.prompt_ids:
            raise bad_request("the prompt is empty after tokenization", param=self._prompt_param())
        room = self.s.ctx - len(self.prompt_ids)
        if room < 1:
            raise self._too_long(f"{len(self.prompt_ids)} tokens")
        # Over-large limits are clamped to what fits, never refused (a client's "max" is a ceiling, not a demand).
        self.max_tokens = room if spec.max_tokens is None else min(spec.max_tokens, room)

    def _prompt_param(self) -> str:
        return "messages" if self.spec.messages else "prompt"

    def _too_long(self, size: str) -> APIError:
        return APIError(400, f"the prompt is {size}; this server's context is {self.s.ctx} tokens (prompt plus "
                             f"completion), so there is no room to generate. Shorten the messages",
                        param=self._prompt_param(), code="context_length_exceeded")

    async def start(self) -> None:
        self.hangup.on_hang_up(self.abort)   # from here on a hang-up cancels whatever is running
        try:
            await self._start()
        except BaseException:
            self.hangup.stop()
            raise

    async def _start(self) -> None:
        await asyncio.to_thread(self.measure)   # rendering a large prompt must not stall other streams
        if self.hangup.hung_up:
            raise self._gone_before_submit()
        self._lease = await self._unless_hung_up(
            self.s.scheduler.acquire(conversation_key(self.spec), self.spec.cache_slot), undo=Lease.release)
        try:
            # Tokenized under admission: at most one prompt per slot is in the tokenizer at any time. The thread
            # cannot be interrupted, so a hang-up meanwhile is acted on once it returns.
            await asyncio.to_thread(self.prepare)
            note(prompt_tokens=len(self.prompt_ids), completion_tokens=0)
            if self.hangup.hung_up:
                raise self._gone_before_submit()
            self._engine = await self._unless_hung_up(self.s.host.engine(self.s.queue_timeout))
            if self.hangup.hung_up:    # no await from here to the submit: a later hang-up finds the request
                raise self._gone_before_submit()
            try:
                if self._grammar is not None:
                    self._constraint = structured.start(self._grammar, self.s.codec, self._engine)
                if self.spec.echo and self.spec.logprobs is not None:
                    self._engine.reset(self._lease.slot)   # every prompt position's logits, none reused
                self._request = self._engine.submit(
                    self.prompt_ids, slot=self._lease.slot, max_tokens=self.max_tokens, **self.sampling(),
                    stop=list(self.s.codec.stop_ids), **self.processors())
                if self._constraint is not None:
                    self._engine.mask(self._request, self._constraint.mask())
            except ConstraintError as exc:
                raise bad_request(exc.one_line(), param="response_format", code="invalid_grammar") from None
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
            if self.hangup.hung_up:   # the cancel is on its way; the pump frees the slot at the engine's done
                self.close()
                raise hung_up_error()
            return
        self._finished = True
        raise self._refusal(first)

    async def _unless_hung_up(self, awaitable: Awaitable[Any], undo: Callable[[Any], None] | None = None) -> Any:
        """Await ``awaitable`` unless the client hangs up first; then cancel it, undo what it obtained anyway
        (a slot granted at the very moment of the cancel), and refuse with 499."""
        task = asyncio.ensure_future(awaitable)
        gone = asyncio.ensure_future(self.hangup.wait())
        try:
            await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            await _cancel_and_undo(task, undo)
            raise
        finally:
            gone.cancel()
        if task.done():
            return task.result()
        await _cancel_and_undo(task, undo)
        raise self._gone_before_submit()

    def _gone_before_submit(self) -> APIError:
        self._finished = self._closed = True
        self.s.metrics.rejected("client_disconnected")
        return hung_up_error()

    def sampling(self) -> dict[str, Any]:
        """The request's sampling, with what it leaves out taken from the checkpoint (as ``coli run`` does)."""
        spec, base = self.spec, self.s.default_sampling
        temperature = spec.temperature if spec.temperature is not None else float(base.get("temperature", 1.0))
        top_p = spec.top_p if spec.top_p is not None else float(base.get("top_p", 1.0))
        top_k = spec.top_k if spec.top_k is not None else int(base.get("top_k", 0))
        seed = spec.seed if spec.seed is not None else random.getrandbits(63)
        return {"temperature": temperature, "top_p": top_p, "top_k": top_k, "seed": seed & (2**63 - 1)}

    def processors(self) -> dict[str, Any]:
        """The submit's logits processors and reports (docs/protocol.md); a default leaves its field out."""
        spec, base = self.spec, self.s.default_sampling
        min_p = spec.min_p if spec.min_p is not None else base.get("min_p")
        repetition = spec.repetition_penalty if spec.repetition_penalty is not None else \
            base.get("repetition_penalty")
        out: dict[str, Any] = {
            "min_p": float(min_p) if min_p else None,
            "repetition_penalty": float(repetition) if repetition not in (None, 1, 1.0) else None,
            "presence_penalty": spec.presence_penalty or None, "frequency_penalty": spec.frequency_penalty or None,
            "logit_bias": [[t, b] for t, b in sorted(spec.logit_bias.items())] or None,
            "logprobs": spec.logprobs, "constrained": True if self._grammar is not None else None,
        }
        if spec.echo and spec.logprobs is not None:
            out["logits"] = "f32"
        return out

    def _pump(self, loop: asyncio.AbstractEventLoop, request: Any, lease: Lease) -> None:
        """Thread: move the engine's events onto the loop; release the slot once the engine is done with it."""
        put = self._events.put_nowait
        clock = self.s.metrics.token_clock(self._started_at)
        try:
            for event in request:
                if event.get("ev") == "token":
                    clock.token()
                    if self._constraint is not None:
                        structured.next_mask(self._constraint, self._engine, request, int(event["tok"]),
                                             self.s.codec.stop_ids)
                elif event.get("ev") == "logits":
                    request.logits.clear()   # turned into this prompt's log-probabilities as it arrives
                    self.prompt_logprobs += logprobs.prompt_logprobs(event, self.prompt_ids, self.spec.logprobs,
                                                                       self.s.codec)
                    continue
                elif event.get("ev") == "done":
                    event.update(self.s.profile.disk.share(event))   # the done event reports the disk-bound share
                    loop.call_soon_threadsafe(self.s.metrics.engine_done, event)
                    loop.call_soon_threadsafe(self.s.profile.record, event, self.route, lease.slot, self.spec.user)
                loop.call_soon_threadsafe(put, ("event", event))
        except EngineRequestError as exc:
            loop.call_soon_threadsafe(put, ("refused", exc))
        except EngineError as exc:
            loop.call_soon_threadsafe(put, ("died", exc))
            loop.call_soon_threadsafe(self.s.host.report_death, self._engine, exc)
        except Exception as exc:
            loop.call_soon_threadsafe(put, ("died", EngineError(f"engine event could not be read: {exc}")))
        finally:
            loop.call_soon_threadsafe(lease.release)

    def _refusal(self, item: tuple[str, Any]) -> APIError:
        kind, payload = item
        if kind == "refused":
            code = payload.code
            if code == "context_exceeded":
                return APIError(400, f"the prompt does not fit the context: {payload.message}",
                                param=self._prompt_param(), code="context_length_exceeded")
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
            item = await self._next_event(KEEPALIVE_S)
            if item is None:
                yield KeepAlive()
                continue
            kind, payload = item
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
                entries = [logprobs.token_logprob(payload, self.s.codec)] if "logprob" in payload else []
                self.token_logprobs += entries
                if text or entries:
                    yield Delta(text, entries)
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

    async def _next_event(self, timeout: float) -> tuple[str, Any] | None:
        """The next engine event, or None after ``timeout`` s of silence. The read survives a timeout (no event
        is lost), and a cancellation of the caller always propagates (unlike ``wait_for`` on Python 3.11)."""
        if self._next is None:
            self._next = asyncio.ensure_future(self._events.get())
        done, _ = await asyncio.wait({self._next}, timeout=timeout)
        if not done:
            return None
        read, self._next = self._next, None
        return read.result()

    def take_logprobs(self) -> list[dict[str, Any]]:
        """The log-probability entries of the tokens streamed since the last call (a streamed chunk carries
        those of the tokens that arrived before it)."""
        new = self.token_logprobs[self._logprobs_taken:]
        self._logprobs_taken = len(self.token_logprobs)
        return new

    def abort(self) -> None:
        """Cancel the sequence in the engine if it is still running (client gone, stop sequence seen)."""
        if self._request is not None and not self._aborted and not self._request.finished:
            self._aborted = True
            try:
                self._request.cancel()
            except EngineError:
                pass

    def close(self) -> None:
        """Called (once or more) when the consumer is finished for any reason."""
        if self._closed:
            return
        self._closed = True
        self.hangup.stop()
        if self._next is not None:
            self._next.cancel()
        if not self._finished:
            self.s.metrics.request_failed("client_disconnected")
            self.abort()


async def _cancel_and_undo(task: asyncio.Future, undo: Callable[[Any], None] | None) -> None:
    task.cancel()
    await asyncio.wait({task})
    if task.cancelled():
        return
    if task.exception() is None and undo is not None:
        undo(task.result())


async def run_to_completion(run: GenerationRun) -> tuple[str, Finished]:
    """Collect a whole completion (non-streaming); a hang-up meanwhile has already cancelled it in the engine."""
    pieces: list[str] = []

    async def consume() -> Finished | Failed:
        async for item in run.stream():
            if isinstance(item, Delta):
                pieces.append(item.text)
            elif isinstance(item, (Finished, Failed)):
                return item
        raise AssertionError("stream ended without a final item")

    task = asyncio.ensure_future(consume())
    gone = asyncio.ensure_future(run.hangup.wait())
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            task.cancel()
            raise hung_up_error()
        result = task.result()
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
        run.close()
    if isinstance(result, Failed):
        raise result.error
    return "".join(pieces), result
