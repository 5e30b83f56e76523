"""``coli start`` / ``status`` / ``logs`` / ``stop``: a real background ``coli serve`` (fake engine) on loopback."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # --import-mode=importlib adds no test dir
from fakefamily import HERE, install_engine_wrapper, make_checkpoint


@pytest.fixture(scope="module")
def trained():
    from colibri.demo_tokenizer import stdlib_texts, train_bpe

    return train_bpe(stdlib_texts(100_000), 300)


@pytest.fixture
def setup(tmp_path, trained):
    model = make_checkpoint(tmp_path / "model", trained)
    env = {k: v for k, v in os.environ.items() if k not in ("COLI_MODEL", "COLI_API_KEY")}
    env.update({"COLIBRI_LOAD_PLUGINS": "", "COLIBRI_CACHE": str(tmp_path / "cache"), "NO_COLOR": "1",
                "COLIBRI_STATE": str(tmp_path / "state"), "FAKE_ENGINE_BIN": str(install_engine_wrapper(tmp_path))})
    yield model, env
    # whatever a failed test left running: stop it through its pidfile, as a user would
    for record in (tmp_path / "state" / "servers").glob("*.json"):
        subprocess.run([sys.executable, str(HERE / "fakefamily.py"), "stop", "--name", record.stem, "--grace", "2"],
                       env=env, capture_output=True, timeout=60)


def coli(env, *args, timeout=90) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(HERE / "fakefamily.py"), *args], env=env, capture_output=True,
                          text=True, timeout=timeout)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def chat(url: str) -> dict:
    response = httpx.post(f"{url}/chat/completions", timeout=30,
                          json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert response.status_code == 200, response.text
    return response.json()


def test_start_status_logs_stop_and_a_taken_port(setup):
    model, env = setup
    port = free_port()
    started = coli(env, "start", "--model", str(model), "--port", str(port), "--kv-slots", "2", "--json")
    assert started.returncode == 0, started.stderr
    first = json.loads(started.stdout)
    assert first["url"] == f"http://127.0.0.1:{port}/v1" and first["state"] in ("running", "loading")
    assert chat(first["url"])["usage"]["completion_tokens"] == 4

    status = json.loads(coli(env, "status", "--name", "default", "--json").stdout)
    assert status["state"] == "running" and status["model"] == str(model) and status["family"] == "fakemoe"
    assert status["pid"] == first["pid"] and status["last_decode_tokens_per_s"] > 0
    text = coli(env, "status").stdout
    assert "running" in text and f"127.0.0.1:{port}" in text and "tok/s" in text

    # a second server asked for the same port moves on to the next free one
    second = coli(env, "start", "--model", str(model), "--port", str(port), "--name", "two")
    assert second.returncode == 0, second.stderr
    assert f"port {port} was taken" in second.stdout
    two = json.loads(coli(env, "status", "--name", "two", "--json").stdout)
    assert two["url"] != first["url"] and chat(two["url"])["choices"]
    listed = json.loads(coli(env, "status", "--json").stdout)["servers"]
    assert sorted(s["name"] for s in listed) == ["default", "two"]
    # the same name twice is refused
    again = coli(env, "start", "--model", str(model))
    assert again.returncode == 1 and "already running" in again.stderr and "coli stop" in again.stderr

    logs = coli(env, "logs")
    assert logs.returncode == 0 and "coli serve:" in logs.stdout and "engine ready" in logs.stdout
    follow = subprocess.Popen([sys.executable, str(HERE / "fakefamily.py"), "logs", "-f", "--name", "two"],
                              env=env, stdout=subprocess.PIPE, text=True)
    first_line = follow.stdout.readline()            # the follower has found the server before it is stopped
    stopped = coli(env, "stop", "--name", "two")
    assert stopped.returncode == 0 and "stopped" in stopped.stdout
    watchdog = threading.Timer(60, follow.kill)
    watchdog.start()
    out = first_line + follow.stdout.read()          # -f ends when the server does (read past readline's buffer)
    watchdog.cancel()
    assert follow.wait(timeout=30) == 0 and "engine ready" in out

    assert coli(env, "stop").returncode == 0
    with pytest.raises(httpx.HTTPError):
        httpx.get(first["url"].removesuffix("/v1") + "/health", timeout=2)
    assert "no background server" in coli(env, "status").stdout
    missing = coli(env, "stop")
    assert missing.returncode == 1 and "no background server named 'default'" in missing.stderr


def test_a_server_that_dies_while_starting_is_one_line(setup):
    model, env = setup
    result = coli({**env, "FAKE_ENGINE_MODE": "fatal_on_load"}, "start", "--model", str(model),
                  "--port", str(free_port()))
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 1 and len(lines) == 1, result.stderr
    assert "exited with code" in lines[0] and "coli logs" in lines[0]
    status = json.loads(coli(env, "status", "--name", "default", "--json").stdout)
    assert status["state"] == "exited"


def test_stop_never_touches_a_process_that_only_reuses_the_pid(setup, tmp_path):
    _model, env = setup
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        servers = tmp_path / "state" / "servers"
        servers.mkdir(parents=True)
        (servers / "default.json").write_text(json.dumps({
            "name": "default", "pid": bystander.pid, "pid_start": 1, "host": "127.0.0.1", "port": 9,
            "model": "m", "family": "fakemoe", "log": str(servers / "default.log"), "started": 0,
            "resident_bytes": 0, "argv": []}))
        result = coli(env, "stop")
        assert result.returncode == 0 and "was not running" in result.stdout
        assert bystander.poll() is None, "a process that merely has the recorded pid was signalled"
    finally:
        bystander.kill()
        bystander.wait()
