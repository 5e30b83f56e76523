"""Slow and idle clients cannot exhaust coli serve: header and body deadlines, connection caps (total and per client
address), and one log line instead of a flood when descriptors run out. Raw sockets on 127.0.0.x only."""

from __future__ import annotations

import sys
from pathlib import Path

import asyncio
import errno
import json
import logging
import socket
import threading
import time

import httpx

sys.path.insert(0, str(Path(__file__).parent))  # the harness beside this file (importlib mode)
from serve_harness import start_server, tokenizer_dir_fixture

from colibri.server.connections import RateLimitedLog, install_fd_exhaustion_log

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}
DEADLINE = 0.5


model_dir = tokenizer_dir_fixture("serve-conn")


def port_of(server) -> int:
    return int(server.base.rsplit(":", 1)[1])


def connect(server, source: str = "127.0.0.1") -> socket.socket:
    sock = socket.socket()
    sock.settimeout(10)
    sock.bind((source, 0))
    sock.connect(("127.0.0.1", port_of(server)))
    return sock


def read_until_closed(sock: socket.socket) -> bytes:
    got = b""
    try:
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                return got
            got += chunk
    except ConnectionResetError:
        return got


def test_slowloris_and_idle_connections_close_at_the_header_deadline_while_others_are_served(model_dir):
    server = start_server(model_dir, ctx=128, slots=1, header_timeout=DEADLINE, body_timeout=DEADLINE)
    results: dict[str, tuple[float, bytes]] = {}

    def slowloris(name: str, dribble: bytes) -> None:
        sock = connect(server)
        opened = time.monotonic()
        try:
            for byte in dribble:
                try:
                    sock.send(bytes([byte]))
                except OSError:
                    break
                time.sleep(0.05)
                sock.setblocking(False)
                try:
                    if sock.recv(65536, socket.MSG_PEEK) == b"":
                        break
                except BlockingIOError:
                    pass
                except OSError:
                    break
                finally:
                    sock.setblocking(True)
            answer = read_until_closed(sock)
            results[name] = (time.monotonic() - opened, answer)
        finally:
            sock.close()

    headers = b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n" * 20
    threads = [threading.Thread(target=slowloris, args=(f"loris{i}", headers)) for i in range(4)]
    threads.append(threading.Thread(target=slowloris, args=("idle", b"")))
    try:
        for t in threads:
            t.start()
        served = [httpx.post(server.base + "/v1/chat/completions", json=CHAT, timeout=10).status_code
                  for _ in range(3)]
        assert served == [200, 200, 200]
        for t in threads:
            t.join(timeout=20)
        for name, (elapsed, answer) in results.items():
            assert DEADLINE * 0.8 < elapsed < DEADLINE + 1.5, (name, elapsed)
            if name == "idle":
                assert answer == b""
            else:
                assert answer.startswith(b"HTTP/1.1 408") and b"request_timeout" in answer, answer[:80]
        assert len(results) == 5
        # after a response on a kept-alive connection the next request's headers have the deadline too
        sock = connect(server)
        body = json.dumps(CHAT).encode()
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n%s" % (len(body), body))
        first = sock.recv(65536)
        assert first.startswith(b"HTTP/1.1 200")
        sock.sendall(b"GET /v1/mod")
        started = time.monotonic()
        rest = read_until_closed(sock)
        assert time.monotonic() - started < DEADLINE + 1.5 and b"408" in rest
        sock.close()
    finally:
        server.stop()


def test_a_body_that_does_not_arrive_in_time_is_408(model_dir):
    server = start_server(model_dir, ctx=128, slots=1, header_timeout=5, body_timeout=DEADLINE)
    try:
        for path in ("/v1/chat/completions", "/v1/messages"):
            sock = connect(server)
            sock.sendall(f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
                         f"content-length: 1000\r\n\r\n{{\"model\": ".encode())
            started = time.monotonic()
            answer = read_until_closed(sock)
            sock.close()
            assert DEADLINE * 0.8 < time.monotonic() - started < DEADLINE + 1.5
            assert answer.startswith(b"HTTP/1.1 408") and b"--body-timeout" in answer, answer[:200]
        assert httpx.post(server.base + "/v1/chat/completions", json=CHAT, timeout=10).status_code == 200
    finally:
        server.stop()


def assert_refused(sock: socket.socket) -> None:
    answer = read_until_closed(sock)
    sock.close()
    assert answer.startswith(b"HTTP/1.1 503") and b"too_many_connections" in answer, answer[:80]


def test_connection_caps_total_and_per_client_address(model_dir):
    server = start_server(model_dir, ctx=128, slots=1, header_timeout=30, max_connections=5,
                          max_connections_per_client=3)
    held: list[socket.socket] = []
    try:
        held += [connect(server, "127.0.0.2") for _ in range(3)]
        time.sleep(0.1)
        assert_refused(connect(server, "127.0.0.2"))      # a fourth from the same address
        # another address still gets in, up to the total
        assert httpx.post(server.base + "/v1/chat/completions", json=CHAT, timeout=10).status_code == 200
        held += [connect(server, "127.0.0.3") for _ in range(2)]
        time.sleep(0.1)
        assert_refused(connect(server, "127.0.0.4"))      # the sixth connection in all
        try:
            status = httpx.post(server.base + "/v1/chat/completions", json=CHAT, timeout=10).status_code
        except httpx.TransportError:
            status = 503   # the refusal raced the request's upload: the connection was closed under it
        assert status == 503
        for sock in held:
            sock.close()
        held.clear()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                if httpx.post(server.base + "/v1/chat/completions", json=CHAT, timeout=10).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        else:
            raise AssertionError("the server never took connections again")
    finally:
        for sock in held:
            sock.close()
        server.stop()


def test_descriptor_exhaustion_is_one_line_per_interval_not_a_flood(caplog):
    async def scenario():
        loop = asyncio.get_running_loop()
        install_fd_exhaustion_log(loop)
        for _ in range(500):
            loop.call_exception_handler({"message": "socket.accept() out of system resource",
                                         "exception": OSError(errno.EMFILE, "Too many open files")})

    with caplog.at_level(logging.WARNING, logger="colibri.server"):
        asyncio.run(scenario())
    lines = [r for r in caplog.records if "file descriptors" in r.getMessage()]
    assert len(lines) == 1 and "ulimit -n" in lines[0].getMessage() and "--max-connections" in lines[0].getMessage()
    assert not [r for r in caplog.records if r.name == "asyncio"]

    now = [0.0]
    seen: list[int] = []
    limited = RateLimitedLog(30.0, seen.append, clock=lambda: now[0])
    for step in range(100):
        now[0] = step * 1.0
        limited.hit()
    assert seen == [1, 30, 30, 30]   # the first at once, then one summary per 30 s counting what it folded


SERVE_UNDER_A_LIMIT = """
import json, resource, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
from serve_harness import start_server
server = start_server(Path(sys.argv[2]), ctx=128, slots=1, **json.loads(sys.argv[3]))
print(server.base, flush=True)
sys.stdin.read()
server.stop()
"""


def serve_with_256_descriptors(model_dir, settings: dict):
    import subprocess

    proc = subprocess.Popen([sys.executable, "-c", SERVE_UNDER_A_LIMIT, str(Path(__file__).parent), str(model_dir),
                             json.dumps(settings)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    base = proc.stdout.readline().decode().strip()
    assert base.startswith("http://"), proc.stderr.read().decode()[-2000:]
    return proc, base


def idle_sockets(base: str, count: int, source: str) -> list[socket.socket]:
    port = int(base.rsplit(":", 1)[1])
    held = []
    for _ in range(count):
        sock = socket.socket()
        sock.bind((source, 0))
        sock.connect(("127.0.0.1", port))
        held.append(sock)
    return held


def finish(proc) -> str:
    proc.stdin.close()
    try:
        proc.wait(timeout=30)
    except Exception:
        proc.kill()
        proc.wait()
    return proc.stderr.read().decode(errors="replace")


def test_300_idle_sockets_under_a_256_descriptor_limit_do_not_stop_service(model_dir):
    proc, base = serve_with_256_descriptors(model_dir, {"header_timeout": 30})
    held = []
    try:
        held = idle_sockets(base, 300, "127.0.0.2")     # one address: the per-client cap refuses past 64
        started = time.monotonic()
        r = httpx.post(base + "/v1/chat/completions", json=CHAT, timeout=10)
        assert r.status_code == 200 and time.monotonic() - started < 5
    finally:
        for sock in held:
            sock.close()
        log = finish(proc)
    assert "Too many open files" not in log and "out of system resource" not in log, log[-2000:]


def test_running_out_of_descriptors_is_logged_once_and_service_resumes(model_dir):
    # caps set past the descriptor limit on purpose, so accept() itself fails
    proc, base = serve_with_256_descriptors(model_dir, {"header_timeout": 1.0, "max_connections": 10_000,
                                                        "max_connections_per_client": 10_000})
    held = []
    try:
        held = idle_sockets(base, 300, "127.0.0.2")
        time.sleep(1.5)     # the server retries accept() once a second meanwhile
        for sock in held:
            sock.close()
        held = []
        deadline = time.monotonic() + 10
        while True:
            try:
                if httpx.post(base + "/v1/chat/completions", json=CHAT, timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "service did not resume"
            time.sleep(0.05)
    finally:
        for sock in held:
            sock.close()
        log = finish(proc)
    warnings = [line for line in log.splitlines() if "out of file descriptors" in line]
    # one line, whatever the number of failed accept()s (asyncio retries every second, from up to a backlog of
    # pending retries)
    assert len(warnings) == 1, log[-3000:]
    assert "Traceback" not in log and len(log.splitlines()) < 20, log[-3000:]
