"""The engine process client: start an engine, speak docs/protocol.md with it, and explain its death.

One reader thread parses stdout and routes each event to the queue of the request whose ``id`` it echoes (events
without an id go to a control queue); a second keeps the tail of stderr. Writes are serialised by a lock, so several
threads may drive requests on different slots of one engine at once (``coli serve`` does).

If the process exits, every pending request and every later call gets an :class:`EngineError` that names why: the
exit code or signal (SIGKILL while loading is almost always the OOM killer), the engine's ``fatal`` message, and the
tail of its stderr. Nothing waits forever: ``ready`` has a timeout and death wakes every waiter.
"""

from __future__ import annotations

import base64
import collections
import contextlib
import io
import itertools
import json
import os
import queue
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Iterator, Mapping, Sequence

import numpy as np

from .errors import EngineError

STDOUT_READ_BYTES = 1 << 20
DEFAULT_READY_TIMEOUT = float(os.environ.get("COLIBRI_READY_TIMEOUT", "900"))
STDERR_TAIL_LINES = 40
STDERR_LINES_IN_ERROR = 3
SHUTDOWN_GRACE_S = 5.0


class EngineRequestError(EngineError):
    """The engine refused or failed one request (an ``error`` event); the engine itself lives on."""

    def __init__(self, code: str, message: str, hint: str | None = None):
        super().__init__(f"engine refused the request ({code}): {message}", hint)
        self.code = code



def logits_row(event: Mapping[str, Any]) -> np.ndarray:
    """A ``logits`` event's values as float32: the base64 little-endian ``f32`` field, or the ``values`` list."""
    if "f32" in event:
        return np.frombuffer(base64.b64decode(event["f32"]), dtype="<f4")
    return np.asarray(event["values"], dtype=np.float32)

@dataclass
class Death:
    """Sentinel put on every queue when the engine is gone."""

    error: EngineError


@dataclass
class Result:
    tokens: list[int]
    logits: list[list[float]]
    stats: dict[str, Any]
    accept: dict[str, Any] = field(default_factory=dict)
    scores: list[list[float]] = field(default_factory=list)   # a decide's option logits, one list per mark


class Request:
    """One submitted sequence. Iterate it for its events (dicts, as the protocol defines them) until ``done``.

    Iteration raises :class:`EngineRequestError` on an ``error`` event and :class:`EngineError` if the engine dies.
    ``tokens``, ``logits``, ``accept`` and ``stats`` (the ``done`` event) fill in as events are consumed.
    """

    def __init__(self, engine: "Engine", rid: int, slot: int, kv_plan: Any = None):
        self.engine = engine
        self.kv_plan = kv_plan                 # kv_store.KVPlan of a submit that saves its slot
        self.id = rid
        self.slot = slot
        self.tokens: list[int] = []
        self.logits: list[list[float]] = []
        self.accept: dict[str, Any] = {}
        self.stats: dict[str, Any] = {}
        self.scores: list[list[float]] = []
        self.finished = False
        self._queue: "queue.Queue[dict | Death]" = queue.Queue()

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return self.events()

    def events(self, timeout: float | None = None) -> Iterator[dict[str, Any]]:
        """Yield events until ``done``; ``timeout`` bounds the wait for each one (None: until death or done)."""
        while not self.finished:
            item = self._next_item(timeout)
            if isinstance(item, Death):
                self.finished = True
                raise item.error
            ev = item.get("ev")
            if ev == "token":
                self.tokens.append(int(item["tok"]))
            elif ev == "logits":
                self.logits.append(logits_row(item).tolist() if "f32" in item else [float(v) for v in item["values"]])
            elif ev == "accept":
                self.accept = item
                if self.kv_plan is not None and self.engine.kv_store is not None and "kv_warning" in item:
                    self.engine.kv_store.warn(str(item["kv_warning"]))
            elif ev == "decision":
                self.scores = [[float("nan") if v is None else float(v) for v in row] for row in item["scores"]]
            elif ev == "done":
                self.stats = item
                self.finished = True
                if self.kv_plan is not None and self.engine.kv_store is not None:
                    self.engine.kv_store.settle(self.kv_plan, item)
            elif ev == "error":
                self.finished = True
                raise EngineRequestError(str(item.get("code", "internal")), str(item.get("message", "")))
            yield item

    def _next_item(self, timeout: float | None) -> "dict[str, Any] | Death":
        """The next event the engine sent for this request, or the engine's death."""
        try:
            return self._queue.get(timeout=timeout)
        except queue.Empty:
            raise EngineError(f"engine sent nothing for request {self.id} in {timeout:g} s",
                              "the engine may be stuck; see its stderr") from None

    def cancel(self) -> None:
        """Ask the engine to stop; its ``done`` (reason ``cancelled``) still arrives through iteration."""
        if not self.finished:
            self.engine._send({"op": "cancel", "id": self.id}, quiet=True)

    def wait(self, timeout: float | None = None) -> Result:
        for _ in self.events(timeout):
            pass
        return Result(self.tokens, self.logits, self.stats, self.accept, self.scores)


class Engine:
    """A running engine process. Use as a context manager, or call :meth:`close`."""

    def __init__(self, argv: Sequence[str], env: Mapping[str, str] | None = None,
                 ready_timeout: float = DEFAULT_READY_TIMEOUT, kv_store: Any = None):
        """``kv_store``: a :class:`colibri.kv_store.KVStore`: when the engine announces the ``kv_files`` ability,
        every submit then loads the best saved prefix and saves its slot when it ends."""
        self.argv = [str(a) for a in argv]
        self.kv_store = kv_store
        self.ready: dict[str, Any] = {}
        self._pending: dict[int, Request] = {}
        self._control: "queue.Queue[dict | Death]" = queue.Queue()
        self._lock = threading.Lock()          # guards _pending and _dead
        self._write_lock = threading.Lock()
        self._stats_lock = threading.Lock()    # one stats round-trip at a time
        self._ids = itertools.count(1)
        self._stderr_tail: collections.deque[str] = collections.deque(maxlen=STDERR_TAIL_LINES)
        self._fatal: dict[str, Any] | None = None
        self._dead: EngineError | None = None
        self._closing = False
        self._held: list[bytes] | None = None   # lines of a together() block, sent at its end
        self._loaded = False
        full_env = {**os.environ, **(env or {})}
        try:
            # A session of its own: the terminal's Ctrl-C is for the CLI (which cancels the reply), not the engine.
            # The engine still ends with us: it exits when its stdin closes.
            self.proc = subprocess.Popen(self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=subprocess.PIPE, env=full_env, bufsize=0, start_new_session=True)
        except OSError as exc:
            raise EngineError(f"cannot start engine {self.argv[0]}: {exc.strerror}",
                              "rebuild it with `coli build --force`") from None
        assert self.proc.stdin and self.proc.stdout and self.proc.stderr   # all three are pipes (PIPE above)
        self._stdin: IO[bytes] = self.proc.stdin
        self._stdout: IO[bytes] = self.proc.stdout
        self._stderr: IO[bytes] = self.proc.stderr
        self._stderr_thread = threading.Thread(target=self._read_stderr, name="engine-stderr", daemon=True)
        self._stderr_thread.start()
        self._reader = threading.Thread(target=self._read_stdout, name="engine-stdout", daemon=True)
        self._reader.start()
        try:
            self._wait_ready(ready_timeout)
        except BaseException:
            self._kill()
            raise

    # ---- lifecycle -------------------------------------------------------------------------------------------

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise EngineError(f"engine did not become ready within {timeout:g} s",
                                  f"raise COLIBRI_READY_TIMEOUT or check the engine's stderr: {self.stderr_tail(1)}")
            try:
                item = self._control.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                continue
            if isinstance(item, Death):
                raise item.error
            if item.get("ev") == "ready":
                self.ready = item
                self._loaded = True
                return
            # anything else before ready (a stray error) is ignored; a fatal arrives as death

    def close(self, timeout: float = SHUTDOWN_GRACE_S) -> None:
        """Shut the engine down (politely, then by force); pending requests end with an EngineError."""
        if self._closing:
            return
        self._closing = True
        if self.proc.poll() is None:
            self._send({"op": "shutdown"}, quiet=True)
            try:
                self._stdin.close()
            except OSError:
                pass
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self._kill()
        self._reader.join(timeout=timeout)
        self._stderr_thread.join(timeout=timeout)
        for stream in (self._stdout, self._stderr):
            try:
                stream.close()
            except OSError:
                pass

    def _kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            try:
                self.proc.wait(timeout=SHUTDOWN_GRACE_S)
            except subprocess.TimeoutExpired:
                pass

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def alive(self) -> bool:
        return self._dead is None and self.proc.poll() is None

    # ---- requests --------------------------------------------------------------------------------------------

    def submit(self, prompt: Sequence[int], *, slot: int = 0, max_tokens: int = 256, temperature: float = 0.0,
               top_p: float = 1.0, top_k: int = 0, seed: int = 0, stop: Sequence[int] = (),
               logits: bool | str = False, forced: Sequence[int] | None = None, **processors: Any) -> Request:
        """Start a sequence. ``logits``: True for prompt logits as JSON numbers, ``"f32"`` for the same values as
        base64 float32 (exact, and several times faster to send and parse: what ``coli bench quality`` uses).
        ``forced``: teacher forcing; generated token *i* is ``forced[i]``, reported as its token event.

        ``processors``: the submit's other fields as docs/protocol.md names them (``min_p``,
        ``repetition_penalty``, ``presence_penalty``, ``frequency_penalty``, ``logit_bias`` as [id, bias] pairs,
        ``logprobs``, ``constrained``, ``dist``, ``kv_load``, ``kv_save``); None values are left out."""
        rid = next(self._ids)
        plan = (self.kv_store.plan(prompt, int(self.ready.get("ctx") or 0)) if self.kv_store is not None and
                "kv_save" not in processors and "kv_files" in self.ready.get("abilities", ()) else None)
        req = Request(self, rid, slot, plan)
        msg: dict[str, Any] = {
            "op": "submit", "id": rid, "slot": int(slot), "prompt": [int(t) for t in prompt],
            "max_tokens": int(max_tokens), "temperature": float(temperature), "top_p": float(top_p),
            "top_k": int(top_k), "seed": int(seed), "stop": [int(t) for t in stop],
        }
        if logits:
            msg["logits"] = "f32" if logits == "f32" else True
        if forced is not None:
            msg["forced"] = [int(t) for t in forced]
        if plan is not None:
            msg.update(plan.fields())
        msg.update({k: v for k, v in processors.items() if v is not None})
        self._register(req)
        self._send(msg)
        return req

    def _register(self, req: Request) -> None:
        with self._lock:
            if self._dead is not None:
                raise self._dead
            self._pending[req.id] = req

    def decide(self, prompt: Sequence[int], marks: Sequence[int], options: Sequence[Sequence[int]], *,
               slot: int = 0, pin: int = 0) -> Request:
        """Start a decide (docs/protocol.md): the logits of ``options[i]`` at the token before ``marks[i]`` (a count
        of prompt tokens), in ``Request.scores``. ``pin``: the prompt tokens of the state later decides on this slot
        share (a recurrent state is checkpointed there)."""
        rid = next(self._ids)
        req = Request(self, rid, slot)
        msg: dict[str, Any] = {"op": "decide", "id": rid, "slot": int(slot), "prompt": [int(t) for t in prompt],
                               "marks": [int(m) for m in marks], "options": [[int(t) for t in o] for o in options],
                               "pin": int(pin)}
        self._register(req)
        self._send(msg)
        return req

    def generate(self, prompt: Sequence[int], **sampling: Any) -> Result:
        """Submit and wait: the generated tokens, any requested logits, and the ``done`` stats."""
        return self.submit(prompt, **sampling).wait()

    def mask(self, request: Request | int, allow: bytes) -> None:
        """The allowed tokens of a ``constrained`` sequence's next sampling step: one bit per token, 32-bit
        little-endian words (token 32 w + i is bit i of word w)."""
        rid = request.id if isinstance(request, Request) else int(request)
        self._send({"op": "mask", "id": rid, "allow": base64.b64encode(allow).decode("ascii")}, quiet=True)

    def cancel(self, request: Request | int) -> None:
        rid = request.id if isinstance(request, Request) else int(request)
        self._send({"op": "cancel", "id": rid}, quiet=True)

    def reset(self, slot: int) -> None:
        """Forget the slot's cached prefix (a new conversation)."""
        self._send({"op": "reset", "slot": int(slot)})

    def stats(self, timeout: float = 30.0) -> dict[str, Any]:
        """The engine's cumulative counters (one ``stats`` round-trip)."""
        with self._stats_lock:
            self._send({"op": "stats"})
            deadline = time.monotonic() + timeout
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise EngineError(f"engine did not answer a stats request within {timeout:g} s")
                try:
                    item = self._control.get(timeout=remaining)
                except queue.Empty:
                    continue
                if isinstance(item, Death):
                    self._control.put(item)       # later waiters must see the death too
                    raise item.error
                if item.get("ev") == "stats":
                    return item

    def stderr_tail(self, lines: int = STDERR_TAIL_LINES) -> str:
        tail = list(self._stderr_tail)[-lines:]
        return " / ".join(tail) if tail else "(no stderr)"

    # ---- plumbing --------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def together(self) -> Iterator[None]:
        """Send the requests made inside the block in one write at its end: the engine reads them at once, so
        their sequences start in the same scheduling round (and decode together, docs/protocol.md). A benchmark's
        simultaneous streams and the tests that compare them with sequential runs use it."""
        with self._write_lock:
            self._held = []
        try:
            yield
        finally:
            with self._write_lock:
                lines, self._held = self._held or [], None
            if lines:
                self._write(b"".join(lines), quiet=False)

    def _send(self, msg: dict[str, Any], quiet: bool = False) -> None:
        line = (json.dumps(msg, separators=(",", ":")) + "\n").encode()
        with self._write_lock:
            if self._held is not None:
                self._held.append(line)
                return
        self._write(line, quiet)

    def _write(self, line: bytes, quiet: bool) -> None:
        with self._write_lock:
            if self._dead is not None:
                if quiet:
                    return
                raise self._dead
            try:
                self._stdin.write(line)
                self._stdin.flush()
            except (BrokenPipeError, OSError, ValueError):
                if quiet:
                    return
                # The reader thread sees EOF and composes the real reason; wait briefly for it.
                self._reader.join(timeout=SHUTDOWN_GRACE_S)
                raise self._dead or EngineError("engine stopped reading its input", self.stderr_tail(3)) from None

    def _read_stderr(self) -> None:
        for raw in iter(self._stderr.readline, b""):
            text = raw.decode("utf-8", "replace").rstrip()
            if text:
                self._stderr_tail.append(text)

    def _read_stdout(self) -> None:
        try:
            # stdout is unbuffered (bufsize=0): readline on it would make one read() per byte, which costs more
            # than the engine's work on a logits row. A buffered reader reads what the pipe holds at once and still
            # hands over each line as soon as it is complete.
            assert self.proc.stdout is not None   # Popen(stdout=PIPE)
            reader = io.BufferedReader(self.proc.stdout, STDOUT_READ_BYTES)  # type: ignore[type-var]
            for raw in iter(reader.readline, b""):
                self._route(raw)
        except (OSError, ValueError):
            pass
        self._on_exit()

    def _route(self, raw: bytes) -> None:
        try:
            event = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError):
            self._stderr_tail.append(f"[unparsable stdout] {raw[:200]!r}")
            return
        if not isinstance(event, dict):
            return
        if event.get("ev") == "fatal":
            self._fatal = event
            return
        rid = event.get("id")
        req = None
        if rid is not None:
            with self._lock:
                # A request's last event retires it here, not when its consumer reads it: a request nobody
                # iterates to the end (a dropped HTTP client) must not stay pending forever.
                if event.get("ev") in ("done", "error"):
                    req = self._pending.pop(rid, None)
                else:
                    req = self._pending.get(rid)
        if req is not None:
            req._queue.put(event)
        elif rid is None or event.get("ev") == "stats":
            self._control.put(event)

    def _on_exit(self) -> None:
        try:
            code = self.proc.wait(timeout=SHUTDOWN_GRACE_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        self._stderr_thread.join(timeout=1.0)
        error = self._death_error(code)
        with self._lock:
            self._dead = error
            pending = list(self._pending.values())
            self._pending.clear()
        for req in pending:
            req._queue.put(Death(error))
        self._control.put(Death(error))

    def _death_error(self, code: int) -> EngineError:
        name = Path(self.argv[0]).name
        phase = "while loading" if not self._loaded else "while running"
        if self._closing and code in (0, -signal.SIGKILL, -signal.SIGTERM):
            return EngineError(f"engine {name} was closed", "start a new Engine")
        if self._fatal is not None:
            message = str(self._fatal.get("message", ""))
            what = f"failed {phase}: {self._fatal.get('code', 'fatal')}: {message}"
            # The engine also logs its fatal error on stderr: quote only the stderr lines that add something.
            others = [line for line in list(self._stderr_tail)[-STDERR_LINES_IN_ERROR:] if message not in line]
            hint = (f"engine stderr: {' / '.join(others)}" if others else
                    "coli doctor --deep checks every file and tensor of the model" if not self._loaded else None)
            return EngineError(f"engine {name} {what}", hint)
        elif code < 0:
            try:
                signame = signal.Signals(-code).name
            except ValueError:
                signame = f"signal {-code}"
            what = f"was killed by {signame} {phase}"
            if -code == signal.SIGKILL:
                what += (" (likely the OOM killer: lower --ram or use a machine with more memory)" if not self._loaded
                         else " (possibly the OOM killer: lower --ram)")
        else:
            what = f"exited with code {code} {phase}"
        return EngineError(f"engine {name} {what}",
                           f"engine stderr: {self.stderr_tail(STDERR_LINES_IN_ERROR)}")
