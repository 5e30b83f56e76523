"""The parts of the cluster modes (docs/cluster.md) that need no Ray cluster: the missing-extra error, the flags
refused before anything starts, the replicas' stats merged for /experts, and the engine host leaving a
self-healing replica pool up when one replica fails a request. The modes themselves run on a loopback Ray cluster
in the top-level tests/test_cluster_replicas.py."""

from __future__ import annotations

import asyncio
import sys

import pytest
from typer.testing import CliRunner

from colibri.cli import app
from colibri.cluster import MissingExtraError, require_ray
from colibri.cluster.replicas import merge_stats
from colibri.errors import EngineError
from colibri.server.engine_host import EngineHost


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture
def no_ray(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)   # import ray now raises ImportError


def test_without_ray_the_cluster_commands_name_the_extra(no_ray):
    with pytest.raises(MissingExtraError) as caught:
        require_ray()
    assert caught.value.one_line() == 'the cluster modes need Ray, which is not installed (pip install ' \
                                      '"colibri-core[cluster]")'
    res = invoke("cluster", "status")
    assert res.exit_code == 1
    assert res.output.strip().splitlines() == ['error: the cluster modes need Ray, which is not installed '
                                               '(pip install "colibri-core[cluster]")']


@pytest.mark.parametrize("args, message", [
    (["--address", "10.0.0.1:6379"], "--address: only with --replicas N"),
    (["--replica-resource", "big"], "--replica-resource: only with --replicas N"),
    (["--replicas", "0"], "--replicas 0: must be at least 1"),
])
def test_cluster_flags_are_checked_before_anything_loads(args, message, tmp_path):
    res = invoke("serve", "--model", tmp_path / "none", *args)
    assert res.exit_code == 1
    assert message in res.output and "Traceback" not in res.output


def test_cluster_serve_takes_the_cluster_flags_without_replicas(tmp_path):
    res = invoke("cluster", "serve", "--model", tmp_path / "none", "--address", "10.0.0.1:6379")
    assert res.exit_code == 1
    assert "only with --replicas" not in res.output and str(tmp_path / "none") in res.output   # the model is next


def test_merged_stats_add_counters_and_recompute_the_hit_rate():
    one = {"ev": "stats", "expert_hits": 3, "expert_misses": 1, "hit_rate": 0.75, "rss_bytes": 100,
           "layers": [0, 1], "experts": [8, 8], "hits": [2, 1], "misses": [0, 1], "uses": [[1, 0], [0, 1]]}
    two = {"ev": "stats", "expert_hits": 1, "expert_misses": 3, "hit_rate": 0.25, "rss_bytes": 50,
           "layers": [0, 1], "experts": [8, 8], "hits": [1, 0], "misses": [1, 2], "uses": [[0, 2], [1, 1]]}
    merged = merge_stats([one, two])
    assert merged["expert_hits"] == 4 and merged["expert_misses"] == 4 and merged["hit_rate"] == 0.5
    assert merged["rss_bytes"] == 150 and merged["replicas"] == 2
    assert merged["layers"] == [0, 1] and merged["experts"] == [8, 8]      # the same on every replica
    assert merged["hits"] == [3, 1] and merged["misses"] == [1, 3] and merged["uses"] == [[1, 2], [1, 2]]


class _Pool:
    """A stand-in for ReplicaPool: one replica failed a request, the pool lives on."""

    self_healing = True
    ready: dict = {}
    alive = True
    closed = False

    def submit(self, *args, **kwargs):
        raise AssertionError("not used")

    def close(self) -> None:
        self.closed = True


def test_a_failed_replica_does_not_restart_the_pool():
    async def scenario():
        pool = _Pool()
        host = EngineHost(lambda: pool)
        host.start()
        assert await host.engine(timeout=5) is pool
        host.report_death(pool, EngineError("replica 0 on 10.0.0.2: engine was killed by SIGKILL"))
        assert host.state == "ready" and host.restarts == 0 and await host.engine(timeout=0) is pool
        await host.close()
        assert pool.closed

    asyncio.run(scenario())


def test_an_address_where_no_cluster_listens_is_one_line_at_once(tmp_path, monkeypatch):
    pytest.importorskip("ray", reason='ray is not installed (pip install "colibri-core[cluster]")')
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))   # no cluster of this machine is "auto" here
    res = invoke("cluster", "status", "--address", "127.0.0.1:1")   # port 1: nothing listens there
    assert res.exit_code == 1
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --address 127.0.0.1:1: cannot join the Ray cluster "
                                                   "(nothing answers at "), lines
