"""Bad input at the command line, through the installed ``coli`` script with the real OLMoE engine: each case
ends in ONE clear ``error:`` line on stderr, no traceback, a non-zero exit, and never a hang (every run is bounded
by a timeout)."""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("colibri_olmoe")

from colibri.builder import build_family
from colibri.testing.tiny import tiny_model

TIMEOUT = 180


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    build_family("olmoe")      # the shared build cache, so no case below pays for (or races) a compile
    return tiny_model("olmoe", tmp_path_factory.mktemp("bad-input"), seed=3).path


def argv(*args: str) -> list[str]:
    script = shutil.which("coli", path=os.path.dirname(sys.executable)) or shutil.which("coli")
    head = [script] if script else [sys.executable, "-c", "from colibri.cli import main; main()"]
    return [*head, *args]


def environment(**extra: str) -> dict[str, str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "COLIBRI_LOAD_PLUGINS": "olmoe", "NO_COLOR": "1"}
    env.pop("COLI_DEBUG", None)
    env.pop("COLIBRI_DEBUG", None)
    return {**env, **extra}


def coli(*args: str, stdin: str = "", **env: str) -> subprocess.CompletedProcess:
    """The installed ``coli`` with ``args``, ``stdin`` as its standard input (never the test runner's)."""
    return subprocess.run(argv(*args), input=stdin, capture_output=True, text=True, timeout=TIMEOUT,
                          env=environment(**env), check=False)


def one_error_line(stderr: str, returncode: int) -> str:
    assert returncode != 0
    assert "Traceback" not in stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    assert lines[0].startswith("error: ")
    return lines[0]


def test_truncated_shard(model_dir, tmp_path):
    broken = tmp_path / "truncated"
    shutil.copytree(model_dir, broken)
    shard = broken / "model.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    result = coli("run", "hello", "--model", str(broken), "--raw", "--max-tokens", "4")
    line = one_error_line(result.stderr, result.returncode)
    assert "model.safetensors" in line and ("truncated" in line or "past the end" in line)


def test_corrupted_shard_header(model_dir, tmp_path):
    broken = tmp_path / "garbled"
    shutil.copytree(model_dir, broken)
    shard = broken / "model.safetensors"
    data = bytearray(shard.read_bytes())
    size = struct.unpack("<Q", data[:8])[0]
    data[8:8 + size] = b"{" + b"x" * (size - 1)
    shard.write_bytes(bytes(data))
    result = coli("run", "hello", "--model", str(broken), "--raw", "--max-tokens", "4")
    line = one_error_line(result.stderr, result.returncode)
    assert "model.safetensors" in line and "header" in line


def test_prompt_past_the_context(model_dir):
    result = coli("run", "a b c " * 200, "--model", str(model_dir), "--raw", "--ctx", "64")
    line = one_error_line(result.stderr, result.returncode)
    assert "--ctx 64" in line and "tokens" in line


def test_non_utf8_prompt_file(model_dir, tmp_path):
    prompt = tmp_path / "latin1.txt"
    prompt.write_bytes("café crème".encode("latin-1"))
    result = coli("run", "--prompt-file", str(prompt), "--model", str(model_dir), "--raw")
    line = one_error_line(result.stderr, result.returncode)
    assert str(prompt) in line and "UTF-8" in line


def test_unbuilt_engine_without_a_compiler(model_dir, tmp_path):
    cache = tmp_path / "empty-cache"
    cache.mkdir()
    result = coli("run", "hello", "--model", str(model_dir), "--raw", "--max-tokens", "4",
                  COLIBRI_CC="/nonexistent", COLIBRI_CACHE=str(cache))
    line = one_error_line(result.stderr, result.returncode)
    assert "COLIBRI_CC=/nonexistent" in line and "compiler" in line and "install" in line


def children_of(pid: int) -> list[int]:
    """Direct children of ``pid``, from /proc (field 4 of /proc/N/stat is the parent id)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[1]) == pid:
            found.append(int(entry.name))
    return found


def test_engine_killed_mid_generation(model_dir):
    proc = subprocess.Popen(argv("run", "hello world", "--model", str(model_dir), "--raw", "--temp", "0",
                                 "--max-tokens", "4000", "--ctx", "4096", "--threads", "1"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=environment())
    try:
        deadline = time.monotonic() + TIMEOUT
        streamed = b""
        while not streamed:           # the first streamed text: the engine is generating
            assert time.monotonic() < deadline, "no text streamed"
            assert proc.poll() is None, proc.stderr.read().decode()
            ready, _, _ = select.select([proc.stdout], [], [], 0.5)
            if ready:
                streamed = os.read(proc.stdout.fileno(), 4096)
        engines = children_of(proc.pid)
        assert len(engines) == 1, engines
        os.kill(engines[0], signal.SIGKILL)
        rest, stderr = proc.communicate(timeout=TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    line = one_error_line(stderr.decode(), proc.returncode)
    assert "SIGKILL" in line or "killed" in line, line
    assert len(streamed + rest) < 4000 * 8, "the run should have been cut short"


def test_json_mode_errors_are_one_line_too(model_dir):
    # --json is what scripts read: the error must still be one stderr line, with nothing half-written on stdout.
    result = coli("run", "a b c " * 200, "--model", str(model_dir), "--raw", "--ctx", "64", "--json")
    one_error_line(result.stderr, result.returncode)
    assert result.stdout == "" or json.loads(result.stdout)
