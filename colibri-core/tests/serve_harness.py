"""Running ``coli serve``'s app for tests: a tiny real tokenizer, the protocol fake engine, uvicorn on
127.0.0.1 in a thread. All traffic stays on the loopback interface."""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import uvicorn

from colibri.engine import Engine
from colibri.server import ServerConfig, create_app
from colibri.server.codec import TokenizerCodec
from colibri.server.connections import uvicorn_server

FAKE = Path(__file__).with_name("serve_fake_engine.py")
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def build_tokenizer_dir(directory: Path) -> Path:
    from colibri.demo_tokenizer import stdlib_texts, train_bpe, write_tokenizer_files

    tok = train_bpe(stdlib_texts(max_bytes=300_000), vocab_size=512)
    write_tokenizer_files(directory, tok, chat_template=CHAT_TEMPLATE)
    return directory


def tokenizer_dir_fixture(name: str):
    """A module-scoped ``model_dir`` fixture: the tiny tokenizer checkpoint in a fresh directory ``name``."""
    import pytest

    @pytest.fixture(scope="module")
    def model_dir(tmp_path_factory):
        return build_tokenizer_dir(tmp_path_factory.mktemp(name) / "tiny-chat")

    return model_dir


def wait_until(predicate, timeout: float, what: str) -> None:
    """Poll ``predicate`` every 10 ms for at most ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def raw_request(base: str, path: str, body: dict) -> bytes:
    """The bytes of a JSON POST to ``base`` + ``path``, for tests that need exact control of a socket."""
    import json

    payload = json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nhost: {base.removeprefix('http://')}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(payload)}\r\n\r\n").encode() + payload


def connect(base: str):
    import socket

    host, port = base.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def read_at_least(sock, n: int) -> bytes:
    """At least ``n`` bytes from ``sock``, or what it sent before closing."""
    got = b""
    while len(got) < n:
        chunk = sock.recv(65536)
        if not chunk:
            break
        got += chunk
    return got


def fake_argv(model_dir: Path, ctx: int, slots: int, vocab: int, eos_every: int = 0) -> list[str]:
    return [sys.executable, str(FAKE), "--model", str(model_dir), "--ctx", str(ctx), "--slots", str(slots),
            "--cap", "0", "--threads", "1", "--set", f"vocab={vocab}", "--set", "first_text_id=4",
            "--set", f"eos_every={eos_every}"]


@dataclass
class RunningServer:
    base: str
    app: object
    server: uvicorn.Server
    thread: threading.Thread
    codec: TokenizerCodec
    argv: list[str]
    engines: list = field(default_factory=list)

    @property
    def url(self) -> str:
        return self.base

    def engine_pid(self) -> int:
        engine = self.app.state.host._engine
        assert engine is not None, "no engine running"
        return engine.proc.pid

    def wait_healthy(self, timeout: float = 180.0) -> None:   # the first use builds the engine (slow on a busy machine)
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.base + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise AssertionError("server never became healthy")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def start_server(model_dir: Path, *, ctx: int = 256, slots: int = 1, max_queue: int = 8,
                 queue_timeout: float = 30.0, api_key: str | None = None, eos_every: int = 0,
                 env: dict[str, str] | None = None, max_body: int = 1024 * 1024,
                 cors: tuple[str, ...] = (), wait: bool = True, factory=None, on_fatal=None,
                 codec: TokenizerCodec | None = None, **settings) -> RunningServer:
    """``settings``: any other :class:`ServerConfig` field (allowed_hosts, header_timeout, ...)."""
    codec = codec or TokenizerCodec.from_model_dir(model_dir)
    argv = fake_argv(model_dir, ctx, slots, codec.vocab_size, eos_every)
    engines: list = []

    def start_engine():
        engine = Engine(argv, env=env or {}, ready_timeout=30)
        engines.append(engine)
        return engine

    config = ServerConfig(model_id=model_dir.name, ctx=ctx, kv_slots=slots, max_queue=max_queue,
                          queue_timeout=queue_timeout, api_key=api_key, max_body=max_body, cors_origins=cors,
                          created=int(time.time()), **settings)
    app = create_app(config, factory or start_engine, codec, on_fatal=on_fatal)
    server = uvicorn_server(app, config, host="127.0.0.1", port=0, log_level="warning", timeout_graceful_shutdown=5)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not (server.started and server.servers):
        if time.monotonic() > deadline or not thread.is_alive():
            raise AssertionError("uvicorn did not start")
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    running = RunningServer(f"http://127.0.0.1:{port}", app, server, thread, codec, argv, engines)
    if wait:
        running.wait_healthy()
    return running


def reference_text(server: RunningServer, prompt_ids: list[int], max_tokens: int, temperature: float = 0.0,
                   seed: int = 0) -> tuple[str, list[int]]:
    """What a fresh engine alone generates for these prompt ids (no server in between)."""
    from colibri.detok import IncrementalDetokenizer

    with Engine(server.argv, ready_timeout=30) as engine:
        result = engine.generate(prompt_ids, max_tokens=max_tokens, temperature=temperature, seed=seed,
                                 stop=list(server.codec.stop_ids))
    detok = IncrementalDetokenizer(server.codec.decode, skip_ids=server.codec.stop_ids)
    text = "".join(detok.push(t) for t in result.tokens) + detok.flush()
    return text, result.tokens


def run_coro(coro):
    return asyncio.new_event_loop().run_until_complete(coro)


os.environ.setdefault("HF_HUB_OFFLINE", "1")
