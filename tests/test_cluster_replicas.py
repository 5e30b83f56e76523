"""Replicas mode end to end (docs/cluster.md): ``coli serve --replicas 2`` on a three-node Ray cluster on loopback
(``ray.cluster_utils.Cluster``: a head and two nodes tagged ``node_a`` and ``node_b``, one replica pinned to each),
over the tiny OLMoE model, against ``coli run``. Also ``coli cluster status`` on that cluster.

Cross-package (core's server, the OLMoE engine), so it lives in the top-level tests/. The cluster and the server
start once for the module. Ray keeps its sockets under a short private RAY_TMPDIR (AF_UNIX paths are short, and a
private one keeps other Ray users on this machine from joining this cluster).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

ray = pytest.importorskip("ray", reason='ray is not installed (the cluster extra: pip install "colibri-core[cluster]")')

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "colibri-core" / "tests"))  # core's serve harness
from cli_server import COLI, coli_server  # noqa: E402

CTX = 256
TAGS = ("node_a", "node_b")
NODE_MEMORY = {"object_store_memory": 80 * 1024 * 1024}
PROMPTS = ("The capital of France is", "Once upon a time", "Two plus two makes", "The quick brown fox")


@pytest.fixture(scope="module")
def model_dir(tiny_root) -> Path:
    pytest.importorskip("colibri_olmoe")
    from colibri.testing.tiny import tiny_model

    return tiny_model("olmoe", tiny_root).path


@pytest.fixture(scope="module")
def ray_env():
    """A short private RAY_TMPDIR for the module (the cluster, the server and coli cluster status all use it)."""
    temp = tempfile.mkdtemp(prefix="ray", dir="/tmp")
    before = os.environ.get("RAY_TMPDIR")
    os.environ["RAY_TMPDIR"] = temp
    yield temp
    if before is None:
        os.environ.pop("RAY_TMPDIR", None)
    else:
        os.environ["RAY_TMPDIR"] = before
    shutil.rmtree(temp, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster(ray_env, coli_runs):
    from ray.cluster_utils import Cluster

    made = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"head": 1},
                                                         "include_dashboard": False, **NODE_MEMORY})
    try:
        for tag in TAGS:
            made.add_node(num_cpus=2, resources={tag: 1}, **NODE_MEMORY)
        made.wait_for_nodes()
        ray.init(address=made.address, namespace="colibri", log_to_driver=False)
        yield made
    finally:
        ray.shutdown()
        made.shutdown()


@pytest.fixture(scope="module")
def served(cluster, model_dir):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "NO_COLOR": "1"}
    env.pop("COLI_API_KEY", None)
    args = ["serve", "--model", str(model_dir), "--replicas", "2", "--address", cluster.address,
            "--replica-resource", TAGS[0], "--replica-resource", TAGS[1], "--kv-slots", "2", "--ctx", str(CTX),
            "--threads", "1", "--log-level", "warning"]
    with coli_server(args, env) as running:
        yield running


def coli_run(model_dir, prompt: str) -> subprocess.Popen:
    args = [*COLI, "run", prompt, "--model", str(model_dir), "--temp", "0", "-n", "12", "--ctx", str(CTX),
            "--threads", "1", "--json"]
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})


@pytest.fixture(scope="module")
def coli_runs(model_dir) -> Iterator[dict[str, subprocess.Popen]]:
    """``coli run`` of each prompt, started before the cluster so that they run while it starts."""
    runs = {prompt: coli_run(model_dir, prompt) for prompt in PROMPTS}
    yield runs
    for proc in runs.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def expected(coli_runs) -> dict[str, str]:
    """``coli run``'s greedy text of each prompt (a single engine, no cluster)."""
    texts = {}
    for prompt, proc in coli_runs.items():
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
        texts[prompt] = json.loads(out)["text"]
        assert texts[prompt]
    return texts


def chat(base: str, prompt: str, **extra) -> httpx.Response:
    body = {"model": "x", "messages": [{"role": "user", "content": prompt}], "max_tokens": 12, "temperature": 0,
            **extra}
    return httpx.post(base + "/v1/chat/completions", json=body, timeout=120)


def replica_actors() -> list:
    """The replicas' actor handles, in replica order."""
    names = sorted((e["name"] for e in ray.util.list_named_actors(all_namespaces=True)
                    if e["namespace"] == "colibri" and e["name"].startswith("replica-")),
                   key=lambda name: int(name.rsplit("-", 1)[1]))
    return [ray.get_actor(name, namespace="colibri") for name in names]


def cluster_status(cluster) -> dict:
    out = subprocess.run([*COLI, "cluster", "status", "--address", cluster.address, "--json"], capture_output=True,
                         text=True, timeout=120, env=dict(os.environ))
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_greedy_output_through_the_cluster_equals_coli_run(served, expected):
    base, _ = served
    health = httpx.get(base + "/health").json()
    assert health["status"] == "ok" and health["slots"] == 4   # 2 replicas x 2 slots
    for prompt in PROMPTS[:2]:
        reply = chat(base, prompt)
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["message"]["content"] == expected[prompt]


def test_sixteen_concurrent_clients_across_two_replicas(served, expected, cluster):
    base, _ = served
    before = {a: ray.get(a.load.remote())["served"] for a in replica_actors()}
    asks = [PROMPTS[i % len(PROMPTS)] for i in range(16)]
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        replies = list(pool.map(lambda prompt: chat(base, prompt), asks))
    for prompt, reply in zip(asks, replies):
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["message"]["content"] == expected[prompt]
    served_now = {a: ray.get(a.load.remote())["served"] - before[a] for a in replica_actors()}
    assert sum(served_now.values()) == 16 and all(n > 0 for n in served_now.values()), served_now

    status = cluster_status(cluster)
    tags = {node["node_id"]: node["tags"] for node in status["nodes"]}
    assert sorted(t for node in status["nodes"] for t in node["tags"]) == ["head", *TAGS]
    assert all(node["alive"] and node["cpus"] >= 1 and node["ram_total"] > 0 for node in status["nodes"])
    replicas = sorted(status["replicas"], key=lambda r: r["index"])
    assert [tags[r["node_id"]] for r in replicas] == [[TAGS[0]], [TAGS[1]]]   # pinned by their tags
    assert all(r["state"] == "ready" and r["slots"] == 2 and r["served"] >= 1 for r in replicas)
    assert all(0.0 <= r["mean_hit_rate"] <= 1.0 and 0.0 <= r["engine_hit_rate"] <= 1.0 for r in replicas)
    text = subprocess.run([*COLI, "cluster", "status", "--address", cluster.address], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "NO_COLOR": "1"})
    assert text.returncode == 0, text.stderr
    assert "nodes (3 alive)" in text.stdout and "replicas (2)" in text.stdout and "node_b" in text.stdout


def test_a_killed_replica_fails_its_request_cleanly_and_is_replaced(served, expected):
    base, _ = served
    first = replica_actors()[0]
    info = ray.get(first.info.remote())
    # Stopped, the engine holds the request without answering: it is in flight for certain when it is killed.
    os.kill(info["engine_pid"], signal.SIGSTOP)
    try:
        outcome: dict = {}
        asker = threading.Thread(target=lambda: outcome.update(reply=chat(base, PROMPTS[0], cache_slot=0)))
        asker.start()
        deadline = time.monotonic() + 60
        while ray.get(first.load.remote())["slots_busy"] == 0:
            assert time.monotonic() < deadline, "the request never reached replica 0"
            time.sleep(0.05)
    finally:
        os.kill(info["engine_pid"], signal.SIGKILL)
    asker.join(timeout=120)
    reply = outcome["reply"]
    assert reply.status_code == 503, reply.text
    message = reply.json()["error"]["message"]
    assert "\n" not in message and "replica 0" in message and "SIGKILL" in message, message

    # the other replica serves on meanwhile (global slot 1 is replica 1's)
    other = chat(base, PROMPTS[1], cache_slot=1)
    assert other.status_code == 200 and other.json()["choices"][0]["message"]["content"] == expected[PROMPTS[1]]
    # and the next request on replica 0 waits for Ray's replacement, then succeeds
    again = chat(base, PROMPTS[0], cache_slot=0)
    assert again.status_code == 200, again.text
    assert again.json()["choices"][0]["message"]["content"] == expected[PROMPTS[0]]
    replaced = ray.get(first.info.remote())
    assert replaced["reconstructed"] and replaced["engine_pid"] != info["engine_pid"]
    assert httpx.get(base + "/health").json()["status"] == "ok"
