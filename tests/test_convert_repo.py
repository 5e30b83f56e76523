"""``coli convert --repo`` on the loopback hub: a tiny FP8 OLMoE converted while it downloads, shard by shard.

The disk is sampled while the converter runs: the source shards present at once plus the container stay below the
release plus one shard (converting after a download holds both whole). A kill -9 at any point and a rerun give
the container an ordinary local ``coli convert`` writes, byte for byte.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "colibri-core" / "tests"))
from hub_server import HubRepo, HubServer  # noqa: E402

REPO = "tiny-org/olmoe-fp8"
ARGS = ("--experts", "int4", "--dense", "bf16")


def shard_by_layer(src: Path, dst: Path, parts: int) -> Path:
    """``src``'s single model.safetensors as ``parts`` shards cut in layer order, with an index (as releases are)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(src / "model.safetensors"))
    dst.mkdir(parents=True)
    for side in src.iterdir():
        if side.is_file() and side.name != "model.safetensors":
            (dst / side.name).write_bytes(side.read_bytes())

    def layer(name: str) -> int:
        m = re.search(r"\.layers\.(\d+)\.", name)
        return int(m.group(1)) if m else -1
    names = sorted(tensors, key=lambda n: (layer(n), n))
    weight_map = {}
    for i in range(parts):
        chunk = names[i * len(names) // parts:(i + 1) * len(names) // parts]
        file = f"model-{i + 1:05d}-of-{parts:05d}.safetensors"
        save_file({n: tensors[n] for n in chunk}, str(dst / file), metadata={"format": "pt"})
        weight_map.update({n: file for n in chunk})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return dst


def tree(path: Path) -> dict[str, str]:
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


def disk_bytes(*paths: Path) -> int:
    total = 0
    for path in paths:
        for p in path.rglob("*") if path.exists() else ():
            try:
                total += p.stat().st_blocks * 512 if p.is_file() else 0
            except OSError:
                pass
    return total


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    from colibri.convert.run import convert
    from colibri.model import resolve_model
    from colibri.testing.fp8 import write_fp8_checkpoint
    from colibri.testing.tiny import tiny_model

    root = tmp_path_factory.mktemp("fp8repo")
    built = tiny_model("olmoe", root, intermediate_size=64, num_experts=16, num_layers=4)
    fp8 = write_fp8_checkpoint(built.path, root / "fp8")
    sharded = shard_by_layer(fp8, root / "sharded", parts=4)
    expected = convert(resolve_model(sharded), root / "expected", experts="int4", dense="bf16")
    assert expected.shards > 4
    files = {p.name: p.read_bytes() for p in sharded.iterdir() if p.is_file()}
    return files, tree(root / "expected")


@pytest.fixture
def env(tmp_path):
    out = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN")}
    out.update({"COLIBRI_CACHE": str(tmp_path / "cache"), "HF_HOME": str(tmp_path / "hf"), "NO_COLOR": "1"})
    return out


def coli(env, *args):
    return [sys.executable, "-c", "from colibri.cli import main; main()", *args]


def test_convert_repo_streams_shard_by_shard_within_source_plus_one_shard(release, env, tmp_path):
    files, expected = release
    shards = [len(d) for n, d in files.items() if n.endswith(".safetensors")]
    out = tmp_path / "out"
    peak = [0]
    with HubServer({REPO: HubRepo(files)}) as hub:
        env["HF_ENDPOINT"] = hub.url
        hub.state.bytes_per_s = 2 * 1024 * 1024
        proc = subprocess.Popen(coli(env, "convert", "--repo", REPO, "--out", str(out), *ARGS), env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        done = threading.Event()

        def sample() -> None:
            while not done.is_set():
                peak[0] = max(peak[0], disk_bytes(tmp_path / "cache" / "convert-sources", out))
                time.sleep(0.002)
        sampler = threading.Thread(target=sample)
        sampler.start()
        try:
            stdout, stderr = proc.communicate(timeout=300)
        finally:
            done.set()
            sampler.join()
    assert proc.returncode == 0, stderr
    assert tree(out) == expected
    assert peak[0] < sum(shards) + max(shards), (peak[0], sum(shards), max(shards))
    assert "source shards on disk at most" in stdout
    assert not (tmp_path / "cache" / "convert-sources").exists() or not any(
        (tmp_path / "cache" / "convert-sources").rglob("*.safetensors"))


def test_kill_9_during_convert_repo_then_rerun_is_byte_identical(release, env, tmp_path):
    files, expected = release
    out = tmp_path / "out"
    with HubServer({REPO: HubRepo(files)}) as hub:
        env["HF_ENDPOINT"] = hub.url
        hub.state.bytes_per_s = 256 * 1024          # slow enough for the kill to land mid-run
        proc = subprocess.Popen(coli(env, "convert", "--repo", REPO, "--out", str(out), *ARGS), env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                if list((out / ".colibri-convert").glob("*.receipt.json")):
                    break                            # one output shard finished, others not yet
                time.sleep(0.01)
            else:
                pytest.fail("the conversion never finished a shard")
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        finally:
            if proc.poll() is None:
                proc.kill()
        assert not (out / "config.json").exists()
        hub.state.bytes_per_s = 0
        rerun = subprocess.run(coli(env, "convert", "--repo", REPO, "--out", str(out), *ARGS), env=env,
                               capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    assert tree(out) == expected
