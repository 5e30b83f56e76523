"""Every installed family against transformers: ``coli info`` and ``coli doctor --deep`` on each tiny model.

Parameter counts must equal transformers' ``num_parameters()`` (tensors under ``skipped_prefixes``, such as a
vision tower the engine never loads, are counted apart), and doctor must find every role the family names.
"""

from __future__ import annotations

import json

import pytest
from colibri.cli import app
from colibri.testing.tiny import KINDS, tiny_model
from typer.testing import CliRunner

runner = CliRunner()


pytestmark = pytest.mark.usefixtures("installed_families")


@pytest.mark.parametrize("kind", KINDS)
def test_info_counts_every_family(kind, tiny_root):
    built = tiny_model(kind, tiny_root)
    result = runner.invoke(app, ["info", "--json", "--model", str(built.path)])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    params = data["parameters"]
    assert params["total"] + params["skipped"] == built.num_parameters, (
        f"{data['family']}: info counts {params['total'] + params['skipped']} parameters, transformers "
        f"{built.num_parameters}; stored tensors that are not parameters (buffers such as e_score_correction_bias "
        f"or tid2eid: {built.num_stored_elements - built.num_parameters} elements here) belong in "
        f"TensorLayout.buffers")
    assert params["total"] + params["skipped"] + params["buffers"] == built.num_stored_elements, params
    assert 0 < params["active_per_token"] <= params["total"]
    if data["geometry"]["experts"]:
        assert params["routed_experts"] > 0 and params["active_per_token"] < params["total"]


@pytest.mark.parametrize("kind", KINDS)
def test_doctor_deep_passes_every_family(kind, tiny_root):
    built = tiny_model(kind, tiny_root)
    result = runner.invoke(app, ["doctor", "--deep", "--json", "--model", str(built.path)])
    assert result.exit_code == 0, result.output
    checks = {c["name"]: c for c in json.loads(result.stdout)["checks"]}
    assert checks["shards"]["status"] == "pass" and checks["tensor roles"]["status"] in ("pass", "warn")


@pytest.mark.parametrize("kind", KINDS)
def test_plan_every_family(kind, tiny_root):
    built = tiny_model(kind, tiny_root)
    model = str(built.path)
    info = json.loads(runner.invoke(app, ["info", "--json", "--model", model]).stdout)
    # --disk-bw given, so the plan reads no byte of the model (a measured bandwidth would time a read of a shard).
    result = runner.invoke(app, ["plan", "--json", "--ram", "1", "--disk-bw", "1", "--model", model])
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)
    geometry, size = info["geometry"], info["bytes"]
    assert plan["fits"] and plan["family"] == info["family"]
    if plan.get("stages"):   # a pipeline runs one stage at a time: its resident weights are the largest stage's
        assert 0 < plan["dense_bytes"] < size["dense"] + size["embeddings"]
    else:
        held = size["dense"] + size["embeddings"] - size["paged_embeddings"]   # a paged embedding stays in the file
        assert plan["dense_bytes"] == size["resident"] == held, "dense residency must match info's bytes"
    used = plan["dense_bytes"] + plan["kv_bytes"] + plan["state_bytes"] + plan["reserve_bytes"] + plan["cache_bytes"]
    assert used <= plan["ram_bytes"] == 1024 ** 3
    assert plan["experts_per_layer"] == (geometry["experts"] or 0)
    if geometry["experts"]:
        assert plan["moe_layers"] == len(geometry["moe_layers"])
        assert plan["expert_bytes"] == size["per_expert"]
        # 1 GiB holds every expert of a tiny model: the cache is the whole routed part, read once at most.
        assert plan["cache_slots_per_layer"] == geometry["experts"]
        assert plan["cache_bytes"] == size["routed_experts"]
        assert plan["routed_bytes_per_token"] == geometry["top_k"] * plan["moe_layers"] * plan["expert_bytes"]
        assert plan["disk_bound_tokens_per_s"] == pytest.approx(1e9 / plan["routed_bytes_per_token"])
        # At the smallest RAM it names, one slot per layer fits; just below it, the plan says no in one line.
        gib = plan["min_ram_bytes"] / 1024 ** 3
        tight = runner.invoke(app, ["plan", "--json", "--ram", repr(gib * 1.001), "--disk-bw", "1", "--model", model])
        assert tight.exit_code == 0, tight.output
        assert json.loads(tight.stdout)["cache_slots_per_layer"] >= 1
        short = runner.invoke(app, ["plan", "--ram", repr(gib * 0.95), "--disk-bw", "1", "--model", model])
        assert short.exit_code == 1 and "Traceback" not in short.output
        assert len([line for line in short.stderr.splitlines() if line.strip()]) == 1, short.stderr
    else:
        assert plan["cache_bytes"] == 0 and plan["routed_bytes_per_token"] == 0
