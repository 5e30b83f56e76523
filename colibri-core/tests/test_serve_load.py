"""coli serve under load and faults: a full queue, a queue timeout, kill -9 of the engine, client hang-ups,
slow prefills, loading. Every loop is bounded; all traffic goes to 127.0.0.1."""

from __future__ import annotations

import sys
from pathlib import Path

import concurrent.futures
import os
import signal
import threading
import time

import anthropic
import httpx
import openai
import pytest

from colibri.engine import Engine
from colibri.errors import EngineError

sys.path.insert(0, str(Path(__file__).parent))  # the harness beside this file (importlib mode)
from serve_harness import build_tokenizer_dir, reference_text, start_server, wait_until


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tokenizer_dir(tmp_path_factory.mktemp("serve-load") / "tiny-chat")


def metric(server, name: str) -> float:
    for line in httpx.get(server.base + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split(" ")[1])
    return 0.0


def rss_bytes() -> int:
    """This process's resident set (the server runs in a thread here), from /proc."""
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_32_clients_2_slots_queue_8(model_dir):
    server = start_server(model_dir, ctx=128, slots=2, max_queue=8, queue_timeout=60,
                          env={"SERVE_FAKE_TOKEN_DELAY": "0.03"})
    try:
        prompts = [f"client number {i} asks" for i in range(32)]
        with Engine(server.argv, ready_timeout=30) as engine:
            expected = {}
            for p in prompts:
                ids = server.codec.chat_ids([{"role": "user", "content": p}])
                tokens = engine.generate(ids, max_tokens=12, stop=list(server.codec.stop_ids)).tokens
                expected[p] = server.codec.decode([t for t in tokens if t not in server.codec.stop_ids])
        barrier = threading.Barrier(32)
        client = httpx.Client(timeout=60, limits=httpx.Limits(max_connections=64))

        def one(i: int):
            body = {"model": "m", "messages": [{"role": "user", "content": prompts[i]}], "max_tokens": 12,
                    "temperature": 0, "stream": i % 2 == 1}
            barrier.wait()
            if not body["stream"]:
                r = client.post(server.base + "/v1/chat/completions", json=body)
                text = r.json()["choices"][0]["message"]["content"] if r.status_code == 200 else None
                return i, r.status_code, r.headers.get("retry-after"), text
            with client.stream("POST", server.base + "/v1/chat/completions", json=body) as r:
                if r.status_code != 200:
                    r.read()
                    return i, r.status_code, r.headers.get("retry-after"), None
                import json
                text = ""
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        choices = json.loads(line[6:])["choices"]
                        text += choices[0]["delta"].get("content") or "" if choices else ""
                return i, 200, None, text

        rss_before = rss_bytes()
        started = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(32) as pool:
            results = list(pool.map(one, range(32), timeout=120))
        elapsed = time.monotonic() - started
        ok = [r for r in results if r[1] == 200]
        refused = [r for r in results if r[1] == 429]
        assert len(ok) + len(refused) == 32, [r[1] for r in results]
        assert len(ok) >= 10 and refused, (len(ok), len(refused))
        for i, _, _, text in ok:
            assert text == expected[prompts[i]], i
        for _, _, retry_after, _ in refused:
            assert retry_after is not None and int(retry_after) >= 1
        assert elapsed < 60
        wait_until(lambda: metric(server, "colibri_slots_busy") == 0, 10, "slots to drain")
        assert metric(server, "colibri_queue_depth") == 0
        assert metric(server, 'colibri_rejected_total{reason="queue_full"}') == len(refused)
        # Bounded memory: the server (in this process) holds no per-request state once the burst is over. 32 short
        # requests need kilobytes; a leak of buffers or of queued bodies per request would show as megabytes.
        assert rss_bytes() - rss_before < 64 * 1024 * 1024
    finally:
        server.stop()


def test_queue_timeout_is_429(model_dir):
    server = start_server(model_dir, ctx=128, slots=1, max_queue=4, queue_timeout=0.5,
                          env={"SERVE_FAKE_TOKEN_DELAY": "0.05"})
    try:
        body = {"model": "m", "messages": [{"role": "user", "content": "long"}], "max_tokens": 60, "temperature": 0}
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            long = pool.submit(httpx.post, server.base + "/v1/chat/completions", json=body, timeout=30)
            wait_until(lambda: metric(server, "colibri_slots_busy") == 1, 10, "the slot to be taken")
            started = time.monotonic()
            r = httpx.post(server.base + "/v1/chat/completions", json={**body, "max_tokens": 2}, timeout=30)
            assert r.status_code == 429 and r.json()["error"]["code"] == "queue_timeout"
            assert 0.4 < time.monotonic() - started < 5
            assert long.result().status_code == 200
    finally:
        server.stop()


def test_engine_killed_mid_stream(model_dir):
    server = start_server(model_dir, ctx=128, slots=2, env={"SERVE_FAKE_TOKEN_DELAY": "0.05",
                                                          "SERVE_FAKE_LOAD_DELAY": "1.0"})
    try:
        oai = openai.OpenAI(base_url=server.base + "/v1", api_key="x", max_retries=0, timeout=30)
        claude = anthropic.Anthropic(base_url=server.base, api_key="x", max_retries=0, timeout=30)
        messages = [{"role": "user", "content": "tell me a long story"}]
        stream = oai.chat.completions.create(model="m", messages=messages, max_tokens=100, temperature=0, stream=True)
        anthropic_stream = claude.messages.create(model="m", max_tokens=100, messages=messages, stream=True)
        received = 0
        with pytest.raises(openai.APIError) as err:
            for _chunk in stream:
                received += 1
                if received == 3:
                    os.kill(server.engine_pid(), signal.SIGKILL)
        assert "engine" in str(err.value.message)
        with pytest.raises(anthropic.APIStatusError):
            for _ in anthropic_stream:
                pass
        status = httpx.get(server.base + "/health", timeout=10)
        assert status.status_code == 503 and status.json()["status"] == "restarting"
        assert "SIGKILL" in status.json()["detail"]
        server.wait_healthy(timeout=30)
        ids = server.codec.chat_ids(messages)
        reply = oai.chat.completions.create(model="m", messages=messages, max_tokens=10, temperature=0)
        assert reply.choices[0].message.content == reference_text(server, ids, 10)[0]
        assert metric(server, "colibri_engine_restarts") == 1
        # an idle engine's death is noticed too, and a request sent meanwhile waits for the restart
        os.kill(server.engine_pid(), signal.SIGKILL)
        wait_until(lambda: httpx.get(server.base + "/health", timeout=10).status_code == 503, 10, "503")
        reply = oai.chat.completions.create(model="m", messages=messages, max_tokens=10, temperature=0)
        assert reply.choices[0].message.content == reference_text(server, ids, 10)[0]
    finally:
        server.stop()


def test_client_disconnect_mid_stream_frees_the_slot(model_dir):
    server = start_server(model_dir, ctx=256, slots=1, max_queue=4, env={"SERVE_FAKE_TOKEN_DELAY": "0.05"})
    try:
        body = {"model": "m", "messages": [{"role": "user", "content": "go on"}], "max_tokens": 200,
                "temperature": 0, "stream": True}
        with httpx.Client(timeout=30) as client:
            with client.stream("POST", server.base + "/v1/chat/completions", json=body) as r:
                lines = r.iter_lines()
                got = [next(lines) for _ in range(6)]
                assert any(line.startswith("data: ") for line in got)
        # 200 tokens would take 10 s; the slot must be back (engine-confirmed) well before that
        started = time.monotonic()
        r = httpx.post(server.base + "/v1/chat/completions", timeout=30,
                       json={**body, "stream": False, "max_tokens": 3})
        assert r.status_code == 200 and time.monotonic() - started < 5
        assert metric(server, 'colibri_generations_failed_total{reason="client_disconnected"}') == 1
        assert metric(server, "colibri_generated_tokens_total") < 60
        # a non-streaming client that gives up is cancelled too
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.base + "/v1/chat/completions", json={**body, "stream": False}, timeout=0.5)
        wait_until(lambda: metric(server, "colibri_slots_busy") == 0, 5, "the abandoned slot to free")
        assert metric(server, 'colibri_generations_failed_total{reason="client_disconnected"}') == 2
    finally:
        server.stop()


def test_keepalive_during_a_slow_prefill_and_headers_after_accept(model_dir):
    server = start_server(model_dir, ctx=256, slots=1, env={"SERVE_FAKE_PREFILL_DELAY": "0.05"})
    try:
        import colibri.server.generation as generation

        body = {"model": "m", "messages": [{"role": "user", "content": "a rather long prompt " * 4}],
                "max_tokens": 3, "temperature": 0, "stream": True}
        with httpx.stream("POST", server.base + "/v1/chat/completions", json=body, timeout=30) as r:
            assert r.status_code == 200
            lines = [line for line in r.iter_lines() if line]
        keepalives = [i for i, line in enumerate(lines) if line.startswith(":")]
        first_content = next(i for i, line in enumerate(lines) if '"content":"' in line and '"content":""' not in line)
        assert keepalives and keepalives[0] < first_content
        assert lines[-1] == "data: [DONE]"
        anth = {k: v for k, v in body.items()}
        with httpx.stream("POST", server.base + "/v1/messages", json=anth, timeout=30) as r:
            events = [line for line in r.iter_lines() if line.startswith("event: ")]
        assert events.count("event: ping") > 1
        assert generation.KEEPALIVE_S > 0
    finally:
        server.stop()


def test_health_is_503_while_loading_and_requests_wait(model_dir):
    server = start_server(model_dir, ctx=128, slots=1, env={"SERVE_FAKE_LOAD_DELAY": "2"}, wait=False)
    try:
        r = httpx.get(server.base + "/health", timeout=10)
        assert r.status_code == 503 and r.json()["status"] == "loading"
        reply = httpx.post(server.base + "/v1/chat/completions", timeout=30,
                           json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert reply.status_code == 200
        assert httpx.get(server.base + "/health", timeout=10).status_code == 200
    finally:
        server.stop()


def test_a_failed_first_load_is_fatal(model_dir):
    reasons = []

    def broken():
        raise EngineError("engine colibri-fake failed while loading: tensor model.norm.weight missing")

    server = start_server(model_dir, factory=broken, on_fatal=reasons.append, wait=False)
    try:
        wait_until(lambda: reasons, 10, "on_fatal")
        assert "model.norm.weight" in reasons[0]
        r = httpx.get(server.base + "/health", timeout=10)
        assert r.status_code == 503 and r.json()["status"] == "failed"
        r = httpx.post(server.base + "/v1/chat/completions", timeout=10,
                       json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 503 and "model.norm.weight" in r.json()["error"]["message"]
    finally:
        server.stop()
