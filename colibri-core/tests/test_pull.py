"""``coli pull`` / ``list`` / ``rm`` with the real ``huggingface_hub`` client against a loopback hub.

Every transfer goes to 127.0.0.1 (tests/hub_server.py). ``coli`` runs as a real process (``fakefamily.py`` is the
CLI with the test family registered), so a kill -9 is a real kill and the client sees a real socket.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # --import-mode=importlib adds no test dir
from fakefamily import HERE, make_checkpoint
from hub_server import HubRepo, HubServer

REPO = "tiny-org/fake-moe"
BIG = "model-big.bin"
BIG_BYTES = 3 * 1024 * 1024


@pytest.fixture(scope="module")
def repo_files(tmp_path_factory) -> dict[str, bytes]:
    from colibri.demo_tokenizer import stdlib_texts, train_bpe

    directory = make_checkpoint(tmp_path_factory.mktemp("repo") / "m", train_bpe(stdlib_texts(100_000), 300))
    files = {p.name: p.read_bytes() for p in directory.iterdir() if p.is_file()}
    files[BIG] = hashlib.shake_256(b"colibri").digest(BIG_BYTES)   # deterministic, incompressible
    return files


@pytest.fixture
def env(tmp_path) -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN",
                                                             "COLI_MODEL")}
    out.update({"COLIBRI_MODELS": str(tmp_path / "models"), "HF_HOME": str(tmp_path / "hf"),
                "COLIBRI_LOAD_PLUGINS": "", "COLIBRI_CACHE": str(tmp_path / "cache"), "NO_COLOR": "1"})
    return out


def coli(env: dict[str, str], *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(HERE / "fakefamily.py"), *args], env=env, capture_output=True,
                          text=True, timeout=timeout)


def one_error_line(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 1, (result.stdout, result.stderr)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.stderr
    return lines[0]


def test_pull_lists_uses_and_removes_a_model_by_name(repo_files, env, tmp_path):
    with HubServer({REPO: HubRepo(repo_files)}) as hub:
        env["HF_ENDPOINT"] = hub.url
        result = coli(env, "pull", REPO)
        assert result.returncode == 0, result.stderr
    dest = tmp_path / "models" / REPO
    for name, data in repo_files.items():
        assert (dest / name).read_bytes() == data, name
    assert not (dest / ".colibri-partial").exists()
    # piped: a line per file with its bytes and rate (on a terminal: the live bar, test_pull_progress_bar)
    assert re.search(r"fetched model-big.bin: 3.00 MiB at [0-9.]+ [KMG]iB/s \(3.00 MiB, checksum verified\)",
                     result.stderr), result.stderr
    record = json.loads((dest / ".colibri-pull.json").read_text())
    assert record["complete"] and record["repo_id"] == REPO and len(record["commit"]) == 40

    # found by name wherever --model is taken
    info = coli(env, "info", "--model", REPO, "--json")
    assert info.returncode == 0, info.stderr
    assert json.loads(info.stdout)["family"] == "fakemoe"

    listed = coli(env, "list", "--json")
    assert listed.returncode == 0, listed.stderr
    models = json.loads(listed.stdout)["models"]
    assert [m["name"] for m in models] == [REPO]
    assert models[0]["family"] == "fakemoe" and models[0]["container"] == "source F32"
    assert models[0]["size_bytes"] >= sum(len(d) for d in repo_files.values())
    text = coli(env, "list")
    assert REPO in text.stdout and "fakemoe" in text.stdout and "source F32" in text.stdout

    removed = coli(env, "rm", REPO)
    assert removed.returncode == 0, removed.stderr
    assert not dest.exists() and not dest.parent.exists()
    assert "no such model" in one_error_line(coli(env, "rm", REPO))
    assert "coli pull tiny-org/fake-moe" in one_error_line(coli(env, "info", "--model", REPO))


def test_rerun_is_up_to_date_and_offline_mode_uses_the_local_copy(repo_files, env, tmp_path):
    with HubServer({REPO: HubRepo(repo_files)}) as hub:
        env["HF_ENDPOINT"] = hub.url
        assert coli(env, "pull", REPO, "--include", "*.json").returncode == 0
        assert sorted(p.name for p in (tmp_path / "models" / REPO).iterdir() if p.is_file()) == sorted(
            [n for n in repo_files if n.endswith(".json")] + [".colibri-pull.json"])
        assert coli(env, "pull", REPO).returncode == 0
        before = len(hub.state.log)
        again = coli(env, "pull", REPO)
        assert again.returncode == 0 and "up to date" in again.stdout
        assert not hub.gets(BIG)[1:], "a complete, verified file is not fetched again"
        assert all(method != "GET" or "/api/" in path for method, path, _ in hub.state.log[before:])
    offline = coli({**env, "HF_HUB_OFFLINE": "1"}, "pull", REPO)
    assert offline.returncode == 0 and "offline" in offline.stdout
    missing = coli({**env, "HF_HUB_OFFLINE": "1"}, "pull", "tiny-org/other")
    assert "HF_HUB_OFFLINE" in one_error_line(missing)


def test_missing_repo_revision_and_gated_repo_are_one_line_errors(repo_files, env, tmp_path):
    repos = {REPO: HubRepo(repo_files), "tiny-org/gated": HubRepo(repo_files, gated=True)}
    with HubServer(repos, token="hf_secret") as hub:
        env["HF_ENDPOINT"] = hub.url
        line = one_error_line(coli(env, "pull", "tiny-org/nope"))
        assert "tiny-org/nope: no such model repository" in line and "HF_TOKEN" in line
        line = one_error_line(coli(env, "pull", f"{REPO}@v9"))
        assert "no revision 'v9'" in line
        line = one_error_line(coli(env, "pull", "tiny-org/gated"))
        assert "tiny-org/gated is gated" in line and "HF_TOKEN" in line
        assert not (tmp_path / "models" / "tiny-org" / "gated").exists()
        # the token from the usual places opens it: HF_TOKEN here, the token file of `hf auth login` likewise
        ok = coli({**env, "HF_TOKEN": "hf_secret"}, "pull", "tiny-org/gated", "--include", "config.json")
        assert ok.returncode == 0, ok.stderr
        token_file = Path(env["HF_HOME"]) / "token"
        token_file.parent.mkdir(parents=True, exist_ok=True)
        token_file.write_text("hf_secret")
        ok = coli(env, "pull", "tiny-org/gated", "--include", "tokenizer.json")
        assert ok.returncode == 0, ok.stderr


def test_bad_ref_is_a_usage_error(env):
    line = one_error_line(coli(env, "pull", "a/b/c"))
    assert "not a repo id" in line and "Org/Name" in line


def test_kill_9_mid_file_then_rerun_resumes_to_identical_bytes(repo_files, env, tmp_path):
    dest = tmp_path / "models" / REPO
    with HubServer({REPO: HubRepo(repo_files)}) as hub:
        env["HF_ENDPOINT"] = hub.url
        hub.state.bytes_per_s = 512 * 1024          # ~6 s for the big file: the kill lands mid-file
        proc = subprocess.Popen([sys.executable, str(HERE / "fakefamily.py"), "pull", REPO], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 30
            partial = None
            while time.monotonic() < deadline:
                parts = list((dest / ".colibri-partial").glob(f"{BIG}.*.part")) if dest.exists() else []
                if parts and parts[0].stat().st_size >= 256 * 1024:
                    partial = parts[0]
                    break
                time.sleep(0.02)
            assert partial is not None, "the big file never started"
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        finally:
            if proc.poll() is None:
                proc.kill()
        kept = partial.stat().st_size
        assert 0 < kept < BIG_BYTES and not (dest / BIG).exists()
        hub.state.bytes_per_s = 0
        result = coli(env, "pull", REPO)
        assert result.returncode == 0, result.stderr
        assert (dest / BIG).read_bytes() == repo_files[BIG]
        ranges = hub.gets(BIG)
        assert ranges[0] is None and ranges[-1] == f"bytes={kept}-", ranges   # asked only for the rest
        list_line = coli(env, "list")
        assert "ok" in list_line.stdout


def test_dropped_connection_is_resumed_by_the_client_and_the_checksum_is_checked(repo_files, env, tmp_path):
    with HubServer({REPO: HubRepo(repo_files)}) as hub:
        env["HF_ENDPOINT"] = hub.url
        hub.state.drops = [1024 * 1024 + 4096]
        result = coli(env, "pull", REPO, "--include", BIG)
        assert result.returncode == 0, result.stderr
        assert (tmp_path / "models" / REPO / BIG).read_bytes() == repo_files[BIG]
        assert hub.gets(BIG) == [None, f"bytes={1024 * 1024}-"]
        # a hub whose bytes do not match its own checksum: refused, nothing kept
        real = repo_files[BIG]
        hub.state.repos["tiny-org/corrupt"] = HubRepo(repo_files, served={BIG: real[:-1] + bytes([real[-1] ^ 1])})
        line = one_error_line(coli(env, "pull", "tiny-org/corrupt", "--include", BIG))
        assert "does not match the hub's checksum" in line
        assert not (tmp_path / "models" / "tiny-org" / "corrupt" / BIG).exists()


def test_a_transfer_that_keeps_breaking_is_one_line_and_a_rerun_resumes(repo_files, env, tmp_path):
    with HubServer({REPO: HubRepo(repo_files)}) as hub:
        env["HF_ENDPOINT"] = hub.url
        hub.state.drops = [1024 * 1024 + 4096] + [0] * 10   # one MiB arrives, then every retry breaks at once
        line = one_error_line(coli(env, "pull", REPO, "--include", BIG))
        assert "interrupted" in line and f"coli pull {REPO}" in line and "1048576 of 3145728 bytes kept" in line
        hub.state.drops = []
        assert coli(env, "pull", REPO, "--include", BIG).returncode == 0
        assert (tmp_path / "models" / REPO / BIG).read_bytes() == repo_files[BIG]
        assert hub.gets(BIG)[-1] == f"bytes={1024 * 1024}-"


@pytest.fixture
def tiny_disk(tmp_path):
    """A real 1 MiB filesystem (tmpfs), so the free-space check meets a real full disk."""
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1M", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", str(mount)], check=False)


def test_a_full_disk_is_refused_before_any_byte_is_written(repo_files, env, tiny_disk):
    with HubServer({REPO: HubRepo(repo_files)}) as hub:
        env["HF_ENDPOINT"] = hub.url
        line = one_error_line(coli(env, "pull", REPO, "--dir", str(tiny_disk / "m")))
        assert "needs 3." in line and "MiB more" in line and "--include" in line
        assert list(tiny_disk.iterdir()) == [] and not hub.gets(BIG)
        # what fits goes through on the same disk
        assert coli(env, "pull", REPO, "--dir", str(tiny_disk / "m"), "--include", "*.json").returncode == 0


def test_pull_progress_bar_on_a_terminal_shows_bytes_and_rate():
    import io

    from rich.console import Console

    from colibri.cli.models import RichPullReporter
    from colibri.hub import RemoteFile, RemoteRepo

    screen = io.StringIO()
    reporter = RichPullReporter(Console(file=screen, force_terminal=True, width=120, color_system=None))
    big = RemoteFile("model.safetensors", 8 << 20, "ab" * 32, None)
    reporter.start(RemoteRepo(REPO, None, "c" * 40, (big,)), 8 << 20, 2 << 20)   # 2 MiB were there already
    reporter.file(big)
    for _ in range(3):
        reporter.advance(1 << 20)
        time.sleep(0.05)
    reporter.progress.refresh()
    text = screen.getvalue()
    reporter.finish()
    assert "model.safetensors" in text and "5.2/8.4 MB" in text and re.search(r"[0-9.]+ [kMG]?B/s", text), text
