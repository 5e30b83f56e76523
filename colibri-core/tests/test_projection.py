"""``coli plan --experts/--dense`` projects the container ``coli convert`` would write: the same bytes, per role and
per shard, as the converted model has, and the same plan."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from colibri.cli import app

runner = CliRunner()


@pytest.fixture(scope="module")
def wide_olmoe(tiny_root):
    """Core's tiny OLMoE-layout checkpoint with experts 64 wide, so int4's groups of 64 inputs fit every matrix."""
    from tiny_checkpoint import write_checkpoint

    return write_checkpoint(tiny_root / "olmoe-wide", intermediate_size=64).path


def plan_json(*args):
    result = runner.invoke(app, ["plan", "--json", "--disk-bw", "2", "--ram", "1", *args])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.mark.parametrize("experts,dense", [("int4", "int8"), ("int8", "bf16"), ("int4", "f32")])
def test_projection_matches_the_converted_container(olmoe_family, wide_olmoe, tmp_path, experts, dense):
    from colibri.convert.run import convert
    from colibri.model import resolve_model

    out = tmp_path / "container"
    result = convert(resolve_model(str(wide_olmoe)), out, experts=experts, dense=dense)
    projected = plan_json("--model", str(wide_olmoe), "--experts", experts, "--dense", dense)
    real = plan_json("--model", str(out))
    for key in ("dense_bytes", "expert_bytes", "cache_slots_per_layer", "cache_bytes", "routed_bytes_per_token",
                "disk_bound_tokens_per_s", "min_ram_bytes", "fits"):
        assert projected[key] == real[key], key
    container = projected["projected_container"]
    assert container["container_bytes"] == result.output_bytes
    assert container["shards"] == result.shards and container["source_bytes"] == result.source_bytes
    assert real["projected_container"] is None
    shipped = plan_json("--model", str(wide_olmoe))
    assert shipped["expert_bytes"] > projected["expert_bytes"]     # f32 source experts shrink


def test_projection_flags_are_checked(olmoe_family, wide_olmoe, tmp_path):
    result = runner.invoke(app, ["plan", "--model", str(wide_olmoe), "--experts", "int3"])
    assert result.exit_code == 1 and "--experts int3: unknown scheme" in result.output
    result = runner.invoke(app, ["plan", "--model", str(wide_olmoe), "--dense", "int8"])
    assert result.exit_code == 1 and "--dense without --experts" in result.output
    text = runner.invoke(app, ["plan", "--model", str(wide_olmoe), "--ram", "1", "--experts", "int4"]).output
    assert "projected container: experts int4, dense bf16" in text and "nothing was converted" in text


def test_plan_repo_reads_only_json_and_headers_over_the_network(olmoe_family, wide_olmoe, tmp_path, monkeypatch,
                                                                surgery):
    import shutil
    import sys
    from pathlib import Path

    from huggingface_hub import constants

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from hub_server import HubRepo, HubServer

    local = tmp_path / "sharded"
    shutil.copytree(wide_olmoe, local)
    surgery.shard(local, parts=3)
    files = {p.name: p.read_bytes() for p in local.iterdir() if p.is_file()}
    monkeypatch.setenv("COLIBRI_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    with HubServer({"allenai/tiny-olmoe": HubRepo(files)}) as hub:
        monkeypatch.setattr(constants, "ENDPOINT", hub.url)   # what HF_ENDPOINT sets at import
        monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                            hub.url + "/{repo_id}/resolve/{revision}/{filename}")
        remote = plan_json("--repo", "allenai/tiny-olmoe", "--experts", "int4", "--dense", "int8")
        shard_gets = [(path, rng) for method, path, rng in hub.state.log
                      if method == "GET" and path.endswith(".safetensors")]
    assert sorted(p.rsplit("/", 1)[1] for p, _ in shard_gets) == sorted(n for n in files if n.endswith(".safetensors"))
    assert all(rng == "bytes=0-65535" for _, rng in shard_gets)          # one Range read of each header
    copy = Path(remote["model"])
    on_disk = sum(p.stat().st_blocks * 512 for p in copy.rglob("*.safetensors"))
    assert on_disk < sum(len(d) for n, d in files.items() if n.endswith(".safetensors")) // 4   # sparse
    here = plan_json("--model", str(local), "--experts", "int4", "--dense", "int8")
    for key in ("dense_bytes", "expert_bytes", "min_ram_bytes", "disk_bound_tokens_per_s", "projected_container"):
        assert remote[key] == here[key], key
    assert remote["repo"] == "allenai/tiny-olmoe"
