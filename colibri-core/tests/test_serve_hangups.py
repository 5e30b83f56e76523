"""Client hang-ups reach the engine as a cancel, whatever the timing; queued clients that leave never reach it.

Raw sockets give exact control over when a client closes: right after sending, after the response headers,
mid-stream, or a random few milliseconds in. All traffic stays on 127.0.0.1; every wait is bounded.
"""

from __future__ import annotations

import sys
from pathlib import Path

import asyncio
import random
import threading
import time

import httpx

sys.path.insert(0, str(Path(__file__).parent))  # the harness beside this file (importlib mode)
from serve_harness import (
    connect, raw_request, read_at_least, start_server, tokenizer_dir_fixture, wait_until)

from colibri.server.generation import _cancel_and_undo


model_dir = tokenizer_dir_fixture("serve-hangups")


def long_body(stream: bool, content: str) -> dict:
    # about 8 s of tokens if it ran to the end: a generation that escapes its cancel holds its slot far longer
    # than the waits below allow
    return {"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": 2000,
            "temperature": 0, "stream": stream}


def test_hang_ups_at_any_moment_always_cancel_and_free_the_slot(model_dir):
    server = start_server(model_dir, ctx=4096, slots=2, max_queue=16, queue_timeout=30,
                          env={"SERVE_FAKE_TOKEN_DELAY": "0.004"})
    scheduler = server.app.state.services.scheduler
    metrics = server.app.state.metrics
    failures: list[BaseException] = []

    def client(worker: int) -> None:
        rng = random.Random(worker)
        try:
            for i in range(25):
                path = ("/v1/chat/completions", "/v1/messages")[i % 2]
                stream = (i // 2) % 2 == 0
                body = long_body(stream, f"worker {worker} round {i}")
                sock = connect(server.base)
                try:
                    sock.sendall(raw_request(server.base, path, body))
                    moment = rng.randrange(4)
                    if moment == 1:
                        time.sleep(rng.random() * 0.02)          # queued, prefilling or just accepted
                    elif moment == 2 and stream:
                        read_at_least(sock, 1)                   # the response has started
                    elif moment == 3 and stream:
                        read_at_least(sock, rng.randrange(200, 2000))   # mid-stream, tokens arriving
                finally:
                    sock.close()
        except BaseException as exc:
            failures.append(exc)

    try:
        threads = [threading.Thread(target=client, args=(w,)) for w in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not failures, failures[0]
        # every sequence the engine started it also confirmed as over, well before any could have run its course
        wait_until(lambda: scheduler.busy == 0 and scheduler.queued == 0, 4, "every slot to be free")
        wait_until(lambda: metrics.sequences == metrics.started, 4, "the engine to confirm every sequence")
        assert metrics.started > 0
        assert metrics.generated_tokens < 100 * 500, metrics.generated_tokens
        # and the server is fine afterwards
        r = httpx.post(server.base + "/v1/chat/completions", timeout=30,
                       json={**long_body(False, "still there?"), "max_tokens": 3})
        assert r.status_code == 200
    finally:
        server.stop()


def test_queued_clients_that_hang_up_never_reach_the_engine(model_dir):
    server = start_server(model_dir, ctx=4096, slots=1, max_queue=16, queue_timeout=30,
                          env={"SERVE_FAKE_TOKEN_DELAY": "0.01"})
    scheduler = server.app.state.services.scheduler
    metrics = server.app.state.metrics
    try:
        holder = connect(server.base)
        holder.sendall(raw_request(server.base, "/v1/chat/completions", long_body(True, "hold the slot")))
        read_at_least(holder, 1)
        assert scheduler.busy == 1
        leavers = []
        for i in range(12):
            sock = connect(server.base)
            path = ("/v1/chat/completions", "/v1/messages", "/v1/completions")[i % 3]
            body = long_body(i % 2 == 0, f"leaver {i}")
            if path == "/v1/completions":
                body = {"model": "m", "prompt": f"leaver {i}", "max_tokens": 5, "stream": i % 2 == 0}
            sock.sendall(raw_request(server.base, path, body))
            leavers.append(sock)
        wait_until(lambda: scheduler.queued == 12, 10, "12 queued requests")
        for sock in leavers:
            sock.close()
        # they leave the queue at once, while the slot is still held
        wait_until(lambda: scheduler.queued == 0, 2, "the departed clients to leave the queue")
        assert scheduler.busy == 1 and metrics.started == 1
        holder.close()
        started = time.monotonic()
        r = httpx.post(server.base + "/v1/chat/completions", timeout=30,
                       json={**long_body(False, "a live one"), "max_tokens": 3})
        assert r.status_code == 200 and time.monotonic() - started < 5
        assert metrics.started == 2   # the holder and the live request; none of the twelve
        assert metrics.rejections["client_disconnected"] == 12
    finally:
        server.stop()


def test_a_slot_granted_at_the_moment_of_the_hang_up_is_handed_back():
    """The cancel of a queued acquire can lose to its grant (a task may finish despite cancel()); the run must
    then release what it obtained rather than keep it."""
    released = []

    async def scenario():
        granted = asyncio.Event()

        async def acquire_that_ignores_cancel():
            try:
                await granted.wait()
            except asyncio.CancelledError:
                pass   # what a swallowed cancellation looks like from outside: the task returns normally
            return "lease"

        task = asyncio.ensure_future(acquire_that_ignores_cancel())
        await asyncio.sleep(0)
        await _cancel_and_undo(task, released.append)

    asyncio.run(scenario())
    assert released == ["lease"]
