"""Expert-parallel mode on a loopback Ray cluster: experts held by workers on other nodes never change a token.

A head node and three expert nodes (each its own ``colibri_experts_<name>`` resource) run on 127.0.0.1. The head
engine keeps a one-slot expert cache, so nearly every routed expert is computed by the worker holding it; tokens
and prompt logits must equal the single-machine engine bit for bit at 2 and 3 workers, by layer and by expert.
Killing a worker (kill -9) between two decode steps must cost nothing but speed: the request completes from disk
with the same tokens, Ray restarts the worker, and the head uses it again.
"""

from __future__ import annotations

import os
import random
import signal
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("torch")
pytest.importorskip("transformers")
ray = pytest.importorskip("ray")

from ray.cluster_utils import Cluster  # noqa: E402

from colibri import inventory  # noqa: E402
from colibri.builder import build_family  # noqa: E402
from colibri.cluster import experts  # noqa: E402
from colibri.engine import Engine  # noqa: E402
from colibri.model import read_config  # noqa: E402
from colibri.records import ResolvedModel  # noqa: E402
from colibri.testing.tiny import tiny_model  # noqa: E402
from colibri_olmoe.plugin import engine_hparams  # noqa: E402

GEOMETRY = {"num_layers": 3, "num_experts": 16, "top_k": 4}
DECODE = 12
NODE_MEMORY = 80 << 20


@pytest.fixture(scope="module")
def binary() -> Path:
    return build_family("olmoe")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return tiny_model("olmoe", tmp_path_factory.mktemp("experts"), seed=11, **GEOMETRY).path


@pytest.fixture(scope="module")
def layers(model_dir) -> dict[int, int]:
    return experts.moe_layers(inventory.load_facts(resolved(model_dir)))


@pytest.fixture(scope="module")
def cluster():
    temp = tempfile.mkdtemp(prefix="cx", dir="/tmp")   # short: Ray's socket paths live under it
    # This cluster's address file under it too, away from any other Ray on the machine; and loopback addresses
    # kept as they are (Ray otherwise swaps 127.0.0.1 for the machine's own address).
    env = {"RAY_TMPDIR": temp, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    constants = ray._private.ray_constants   # read when ray was imported; the env var covers the node processes
    enable = constants.ENABLE_RAY_CLUSTER
    constants.ENABLE_RAY_CLUSTER = False
    os.makedirs(f"{temp}/ray")
    node = {"num_cpus": 1, "object_store_memory": NODE_MEMORY, "node_ip_address": "127.0.0.1"}
    c = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False, "temp_dir": f"{temp}/ray"})
    for i in range(3):
        c.add_node(**node, resources={f"colibri_experts_n{i}": 1})
    c.wait_for_nodes()
    ray.init(address=c.address, namespace=experts.NAMESPACE, log_to_driver=False)
    yield c
    ray.shutdown()
    c.shutdown()
    constants.ENABLE_RAY_CLUSTER = enable
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def resolved(path: Path) -> ResolvedModel:
    return ResolvedModel(path, "olmoe", "olmoe", read_config(path))


def prompt_of(path: Path) -> list[int]:
    rng = random.Random(5)
    return [rng.randrange(2, read_config(path)["vocab_size"]) for _ in range(40)]


def engine(binary: Path, path: Path, cap: int, *args: str) -> Engine:
    argv = [str(binary), "--model", str(path), "--ctx", "128", "--cap", str(cap), "--threads", "1",
            *args, *engine_hparams(resolved(path))]
    return Engine(argv, env={"COLIBRI_PREFETCH": "0"})


@pytest.fixture(scope="module")
def baseline(binary, model_dir):
    with engine(binary, model_dir, 0) as eng:
        result = eng.generate(prompt_of(model_dir), max_tokens=DECODE, logits=True)
    assert len(result.tokens) == DECODE
    return result.tokens, result.logits


@pytest.mark.parametrize("workers,partition", [(2, "layer"), (2, "expert"), (3, "layer"), (3, "expert")])
def test_tokens_identical_at_every_partitioning(cluster, binary, model_dir, layers, baseline, workers, partition,
                                                tmp_path):
    ec = experts.start_expert_cluster(binary, model_dir, workers, partition, layers=layers, threads=1,
                                      workdir=tmp_path)
    try:
        with engine(binary, model_dir, 1, *ec.engine_args()) as eng:
            result = eng.generate(prompt_of(model_dir), max_tokens=DECODE, logits=True)
            stats = eng.stats()
        assert result.tokens == baseline[0]
        assert result.logits == baseline[1], "prompt logits are not bit-identical"
        # The workers really computed: every one answered, and the head read (almost) nothing from disk.
        assert result.stats["remote_messages"] > 0 and result.stats["remote_failures"] == 0
        assert result.stats["decode"]["remote_layer_round_trips"] > 0
        assert [w["alive"] for w in stats["expert_workers"]] == [True] * workers
        assert all(w["messages"] > 0 for w in stats["expert_workers"])
        held = sum(w["experts"] for w in stats["expert_workers"])
        assert held == sum(layers.values())
        assert stats["expert_misses"] == 0 and stats["expert_bytes_read"] == 0
        rows = experts.expert_shard_rows()
        mine = [r for r in rows if ec.run_id in r["worker"]]
        assert len(mine) == workers and all(r["alive"] and r["ram_bytes"] > 0 for r in mine)
        assert [r["layers"] for r in sorted(mine, key=lambda r: r["worker"])] == \
            [{layer: experts.ranges(es) for layer, es in share.items()} for share in ec.shares]
    finally:
        ec.stop()


def test_killed_worker_falls_back_to_disk_and_comes_back(cluster, binary, model_dir, layers, baseline, tmp_path):
    ec = experts.start_expert_cluster(binary, model_dir, 2, "expert", layers=layers, threads=1, workdir=tmp_path)
    try:
        victim = ec.infos()[0]
        assert victim is not None and not victim["restarted"]
        vocab = read_config(model_dir)["vocab_size"]
        allow_all = b"\xff" * (4 * ((vocab + 31) // 32))
        with engine(binary, model_dir, 1, *ec.engine_args()) as eng:
            # A constrained request waits for a mask before every step: the kill lands between two decode steps.
            req = eng.submit(prompt_of(model_dir), max_tokens=DECODE, constrained=True)
            eng.mask(req, allow_all)
            for ev in req.events(timeout=30):
                if ev["ev"] != "token" or len(req.tokens) >= DECODE:
                    continue
                if len(req.tokens) == 4:
                    os.kill(victim["pid"], signal.SIGKILL)
                eng.mask(req, allow_all)
            assert req.tokens == baseline[0]
            assert req.stats["decode"]["remote_failures"] == 1   # detected once, then streamed from disk
            assert req.stats["decode"]["bytes_read"] > 0
            # Ray restarts the actor, the actor restarts the worker on its port, the head reconnects.
            assert experts.wait_for(lambda: (ec.infos(timeout=2)[0] or {}).get("restarted") is True, 60)
            back = ec.infos()[0]
            assert back["pid"] != victim["pid"] and back["address"] == victim["address"]
            assert experts.wait_for(lambda: eng.stats()["expert_workers"][0]["alive"], 30)
            before = eng.stats()["expert_workers"][0]
            assert before["reconnects"] == 1
            again = eng.generate(prompt_of(model_dir), max_tokens=DECODE)
            after = eng.stats()["expert_workers"][0]
        assert again.tokens == baseline[0]
        assert after["messages"] > before["messages"] and again.stats["remote_failures"] == 0
    finally:
        ec.stop()


def test_partition_balances_by_routing_counts():
    layers = {0: 4, 1: 4, 2: 4}
    by_layer = experts.partition_experts(layers, 2, "layer")
    assert [sorted(s) for s in by_layer] == [[0, 2], [1]]
    counts = {0: [10, 9, 1, 0], 1: [0, 0, 5, 5], 2: [1, 1, 1, 1]}
    by_expert = experts.partition_experts(layers, 2, "expert", counts)
    assert by_expert[0][0] == [0, 3] and by_expert[1][0] == [1, 2]   # 10+0 against 9+1
    assert by_expert[0][1] == [0, 2] and by_expert[1][1] == [1, 3]
    assert experts.partition_experts(layers, 3, "expert")[2] == {0: [2], 1: [2], 2: [2]}
    assert experts.ranges([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    # A worker whose RAM holds 3 experts keeps its hottest 3; the rest nobody holds (they stream from disk).
    capped = experts.partition_experts(layers, 2, "expert", counts, max_per_worker=3)
    assert capped[0] == {0: [0], 1: [2], 2: [0]} and capped[1] == {0: [1, 2], 1: [3]}


def test_hotset_sidecar_counts(tmp_path):
    sidecar = tmp_path / ".colibri-hotset"
    sidecar.write_text("colibri-hotset 1 key 00ff\nlayer 0 experts 3\n4 0 2\nlayer 2 experts 2\n1 1\n")
    assert experts.read_hotset_counts(sidecar) == {0: [4, 0, 2], 2: [1, 1]}
    sidecar.write_text("something else")
    assert experts.read_hotset_counts(sidecar) == {}
    assert experts.read_hotset_counts(tmp_path / "missing") == {}


def test_coli_run_with_expert_workers(cluster, model_dir):
    """`coli run --expert-workers N --partition P`: the same greedy reply as without them."""
    import json

    from typer.testing import CliRunner

    from colibri.cli import app

    def run(*extra: str) -> dict:
        res = CliRunner().invoke(app, ["run", "The quick brown fox", "--model", str(model_dir), "--raw", "--json",
                                       "--temp", "0", "--max-tokens", "8", "--ctx", "128", "--threads", "1",
                                       "--cap", "1", *extra], catch_exceptions=False)
        assert res.exit_code == 0, res.output
        return json.loads(res.stdout)

    alone = run()
    spread = run("--expert-workers", "3", "--partition", "layer", "--address", cluster.address)
    assert spread["generated_ids"] == alone["generated_ids"]
    assert spread["stats"]["remote_messages"] > 0 and "remote_messages" not in alone["stats"]
    assert not [r for r in experts.expert_shard_rows() if r["alive"]]   # the command stopped its workers


def test_bad_expert_map_is_one_clear_error(binary, model_dir, tmp_path):
    from colibri.engine import EngineError

    bad = tmp_path / "map.txt"
    bad.write_text("colibri-expert-map 1\nworker 127.0.0.1:9\nlayer 99 experts 0-3\n")
    with pytest.raises(EngineError, match=r"map.txt line 3: layer 99 is not a MoE layer"):
        engine(binary, model_dir, 1, "--expert-map", str(bad)).close()


def test_unreachable_worker_streams_from_disk(binary, model_dir, baseline, tmp_path):
    """A worker that is not up when the head starts costs the timeout once; its experts come from disk."""
    import socket

    with socket.socket() as s:   # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dead = tmp_path / "map.txt"
    dead.write_text(f"colibri-expert-map 1\nworker 127.0.0.1:{port}\nlayer 0 experts 0-15\n")
    with engine(binary, model_dir, 1, "--expert-map", str(dead), "--expert-timeout-ms", "200") as eng:
        result = eng.generate(prompt_of(model_dir), max_tokens=DECODE, logits=True)
        workers = eng.stats()["expert_workers"]
    assert result.tokens == baseline[0] and result.logits == baseline[1]
    assert workers[0]["alive"] is False and result.stats["remote_messages"] == 0 and result.stats["bytes_read"] > 0
