"""``coli setup --yes`` on a fresh machine state: the loopback hub, a catalog pointing at it, a running server."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # --import-mode=importlib adds no test dir
from fakefamily import HERE, install_engine_wrapper, make_checkpoint
from hub_server import HubRepo, HubServer

REPO = "tiny-org/fake-moe"


@pytest.fixture
def world(tmp_path):
    from colibri.demo_tokenizer import stdlib_texts, train_bpe

    source = make_checkpoint(tmp_path / "release", train_bpe(stdlib_texts(100_000), 300))
    files = {p.name: p.read_bytes() for p in source.iterdir() if p.is_file()}
    catalog = tmp_path / "catalog.json"
    catalog.write_text(json.dumps({"models": [
        {"repo": REPO, "family": "fakemoe", "parameters": "tiny"},
        {"repo": "tiny-org/not-there", "family": "fakemoe", "parameters": "huge"},
    ]}))
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN",
                                                             "COLI_MODEL", "COLI_API_KEY")}
    env.update({"COLIBRI_LOAD_PLUGINS": "", "NO_COLOR": "1", "COLIBRI_CACHE": str(tmp_path / "cache"),
                "COLIBRI_MODELS": str(tmp_path / "models"), "COLIBRI_STATE": str(tmp_path / "state"),
                "COLIBRI_CONFIG": str(tmp_path / "config"), "COLIBRI_CATALOG": str(catalog),
                "HF_HOME": str(tmp_path / "hf"), "FAKE_ENGINE_BIN": str(install_engine_wrapper(tmp_path))})
    with HubServer({REPO: HubRepo(files)}) as hub:
        env["HF_ENDPOINT"] = hub.url
        yield env, files, tmp_path
    for record in (tmp_path / "state" / "servers").glob("*.json"):
        subprocess.run([sys.executable, str(HERE / "fakefamily.py"), "stop", "--name", record.stem, "--grace", "2"],
                       env=env, capture_output=True, timeout=60)


def coli(env, *args, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(HERE / "fakefamily.py"), *args], env=env, capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_setup_yes_ends_with_a_served_model_and_is_idempotent(world):
    env, files, tmp_path = world
    port = free_port()
    done = coli(env, "setup", "--yes", "--json", "--disk-bw", "2", "--port", str(port))
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    machine = report["machine"]
    assert machine["cores"] >= 1 and machine["ram_bytes"] > 0 and machine["disk_free_bytes"] > 0
    by_repo = {c["entry"]["repo"]: c for c in report["candidates"]}
    assert by_repo[REPO]["fits"] and by_repo[REPO]["expert_bytes"] > 0 and by_repo[REPO]["tokens_per_s"] > 0
    assert not by_repo["tiny-org/not-there"]["fits"] and "no such model repository" in (
        by_repo["tiny-org/not-there"]["problem"])
    assert report["chosen"] == REPO
    model_dir = tmp_path / "models" / REPO
    assert report["model"] == str(model_dir) and (model_dir / "config.json").read_bytes() == files["config.json"]
    config = json.loads((tmp_path / "config" / "setup.json").read_text())
    assert config["repo"] == REPO and config["model"] == str(model_dir)
    url = report["server"]["url"]
    assert url == f"http://127.0.0.1:{port}/v1" and report["server"]["state"] == "running"
    answer = httpx.post(f"{url}/chat/completions", timeout=30,
                        json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 3

    status = json.loads(coli(env, "status", "--name", "default", "--json").stdout)
    assert status["state"] == "running" and status["model"] == str(model_dir)
    assert "engine ready" in coli(env, "logs").stdout

    again = coli(env, "setup", "--yes", "--json", "--disk-bw", "2", "--port", str(port))
    assert again.returncode == 0, again.stderr
    second = json.loads(again.stdout)
    assert second["server"]["pid"] == status["pid"] and "already running" in second["server"]["note"]

    # a second server on the taken port moves on
    other = coli(env, "start", "--model", REPO, "--port", str(port), "--name", "two")
    assert other.returncode == 0 and f"port {port} was taken" in other.stdout
    assert coli(env, "stop", "--name", "two").returncode == 0
    stopped = coli(env, "stop")
    assert stopped.returncode == 0 and "stopped" in stopped.stdout


def test_setup_without_yes_and_without_a_terminal_asks_for_yes(world):
    env, _files, _tmp = world
    result = coli(env, "setup", "--disk-bw", "2", "--no-start")
    assert result.returncode == 1 and "pass --yes" in result.stderr
    assert "tiny-org/fake-moe" in result.stdout and "fits" in result.stdout


def test_setup_when_nothing_fits_names_the_smallest_ram(world):
    env, _files, _tmp = world
    result = coli(env, "setup", "--yes", "--disk-bw", "2", "--ram", "0.01", "--no-start")
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 1 and len(lines) == 1, result.stderr
    assert "no catalog model fits" in lines[0] and "tiny-org/fake-moe, needs" in lines[0]
