"""``coli serve`` on a pipeline: ``POST /v1/images/generations`` through the official openai client, the same image
for the same seed (RGB for Qwen-Image, RGBA for 2.1), SSE progress, clear 400s, an engine killed mid-generation
failing only that request, and a streaming client that leaves cancelling its generation."""

from __future__ import annotations

import base64
import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("diffusers")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
PIL = pytest.importorskip("PIL.Image")

from colibri.daemon import free_port  # noqa: E402
from colibri.testing.tiny import tiny_model  # noqa: E402

COLI = [sys.executable, "-c", "from colibri.cli import main; main()"]


def serve(tmp_path_factory, kind: str, port_base: int):
    """``coli serve`` on a tiny pipeline of ``kind``: yields (base URL, process, model dir)."""
    tiny = tiny_model(kind, tmp_path_factory.mktemp(f"tiny-{kind}-serve"))
    port = free_port("127.0.0.1", port_base + os.getpid() % 1000)
    proc = subprocess.Popen([*COLI, "serve", "--model", str(tiny.path), "--port", str(port), "--api-key", "sk-test",
                             "--threads", "1"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(proc.stderr.read().decode())
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.2)
    else:
        proc.kill()
        raise AssertionError("server did not come up")
    yield base, proc, str(tiny.path)
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from serve(tmp_path_factory, "qwen-image", 18700)


def client(base: str) -> "openai.OpenAI":
    return openai.OpenAI(base_url=f"{base}/v1", api_key="sk-test", max_retries=0)


def generate(base: str, seed: int, steps: int = 2, size: str = "32x32") -> bytes:
    result = client(base).images.generate(model="tiny", prompt="a hummingbird in the rain", n=1, size=size,
                                          response_format="b64_json", extra_body={"seed": seed, "steps": steps})
    return base64.b64decode(result.data[0].b64_json)


def test_openai_client_gets_a_png_and_the_seed_fixes_it(server):
    base = server[0]
    first = generate(base, seed=3)
    image = PIL.open(io.BytesIO(first))
    assert image.format == "PNG" and image.size == (32, 32) and image.mode == "RGB"
    assert generate(base, seed=3) == first
    assert generate(base, seed=4) != first


def test_bad_requests_name_their_field(server):
    base = server[0]
    auth = {"Authorization": "Bearer sk-test"}
    for body, field in (({"prompt": "x", "size": "33x32"}, "size"), ({"prompt": ""}, "prompt"),
                        ({"prompt": "x", "n": 2}, "n"), ({"prompt": "x", "response_format": "url"}, "response_format"),
                        ({"prompt": "x", "steps": 0}, "steps")):
        reply = httpx.post(f"{base}/v1/images/generations", json=body, headers=auth, timeout=30)
        assert reply.status_code == 400 and reply.json()["error"]["param"] == field, reply.text
    assert httpx.post(f"{base}/v1/images/generations", json={"prompt": "x"}, timeout=30).status_code == 401


def test_stream_reports_every_step(server):
    base = server[0]
    events = []
    with httpx.stream("POST", f"{base}/v1/images/generations", timeout=60,
                      headers={"Authorization": "Bearer sk-test"},
                      json={"prompt": "a bird", "size": "32x32", "steps": 3, "seed": 3, "stream": True}) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    assert [e["step"] for e in events if e["type"] == "image_generation.progress"] == [1, 2, 3]
    done = events[-1]
    assert done["type"] == "image_generation.completed"
    assert PIL.open(io.BytesIO(base64.b64decode(done["data"][0]["b64_json"]))).size == (32, 32)


def dit_stages(model_dir: str, stage: str = "dit") -> list[int]:
    """Engine processes running this pipeline's transformer stage (their command line names its folder)."""
    wanted = f"\x00{stage}\x00{model_dir}/transformer\x00".encode()
    pids = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if wanted in (entry / "cmdline").read_bytes():
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


def test_engine_killed_mid_generation_fails_that_request_only(server):
    base, _, model_dir = server
    outcome: dict = {}

    def slow() -> None:
        outcome["reply"] = httpx.post(f"{base}/v1/images/generations", timeout=120,
                                      headers={"Authorization": "Bearer sk-test"},
                                      json={"prompt": "a bird", "size": "256x256", "steps": 1000, "seed": 1})

    worker = threading.Thread(target=slow)
    worker.start()
    deadline = time.monotonic() + 60
    killed = False
    while time.monotonic() < deadline and not killed:
        for pid in dit_stages(model_dir):
            os.kill(pid, signal.SIGKILL)
            killed = True
        time.sleep(0.05)
    worker.join(timeout=120)
    assert killed
    reply = outcome["reply"]
    assert reply.status_code == 500
    assert "engine's dit stage" in reply.json()["error"]["message"]
    assert generate(base, seed=3)   # the next request starts fresh engines


def test_a_streaming_client_that_leaves_cancels_its_generation(server):
    base, _, model_dir = server
    auth = {"Authorization": "Bearer sk-test"}
    # 1000 steps at 256x256 would hold the only slot for minutes if nothing stopped it
    with httpx.stream("POST", f"{base}/v1/images/generations", timeout=60, headers=auth,
                      json={"prompt": "a bird", "size": "256x256", "steps": 1000, "seed": 1,
                            "stream": True}) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if line.startswith("data: ") and json.loads(line[6:]).get("step") == 2:
                break   # leave mid-generation: the connection closes here
    assert httpx.get(f"{base}/health", timeout=5).json()["slots_busy"] in (0, 1)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if not dit_stages(model_dir) and httpx.get(f"{base}/health", timeout=5).json()["slots_busy"] == 0:
            break
        time.sleep(0.1)
    assert not dit_stages(model_dir), "the stage process outlived its client"
    assert httpx.get(f"{base}/health", timeout=5).json()["slots_busy"] == 0, "the slot outlived its client"
    assert generate(base, seed=3)   # and the server goes on


@pytest.fixture(scope="module")
def server21(tmp_path_factory):
    yield from serve(tmp_path_factory, "qwen-image-21", 19700)


def test_qwen_image21_serves_rgba_pngs_fixed_by_the_seed(server21):
    base = server21[0]
    first = generate(base, seed=3, size="64x32")
    image = PIL.open(io.BytesIO(first))
    assert image.format == "PNG" and image.size == (64, 32) and image.mode == "RGBA"
    assert generate(base, seed=3, size="64x32") == first
    assert generate(base, seed=4, size="64x32") != first
