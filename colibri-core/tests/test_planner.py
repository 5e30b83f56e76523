"""The default planner's arithmetic and ``coli plan``."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from colibri import hookimpl, planner, plugins, sysinfo
from colibri.cli import app
from colibri.inventory import load_facts
from colibri.model import resolve_model
from colibri.records import PlanRequest, ResourcePlan
from typer.testing import CliRunner

runner = CliRunner()
MIB = 1024 * 1024


@pytest.fixture
def facts(olmoe_family, tiny_olmoe):
    return load_facts(resolve_model(tiny_olmoe.path))


def by_role(facts):
    """Expected bytes, computed from the headers independently of the planner."""
    expert = {t.name: t.nbytes for t in facts.tensors if ".mlp.experts." in t.name}
    dense = sum(t.nbytes for t in facts.tensors if t.name not in expert)
    per_expert = sum(n for name, n in expert.items() if name.startswith("model.layers.0.mlp.experts.0."))
    return dense, per_expert


def test_split_of_the_budget(facts):
    g = facts.geometry
    dense, per_expert = by_role(facts)
    ctx, slots = 256, 2
    kv = g.kv_bytes_per_token * ctx * slots
    # one prefill pass of min(ctx, 128) rows: per row its activations, each routed choice's output, one expert's
    # gate and up rows and a logits row; the pass's attention scores; the fixed runtime share
    rows = min(ctx, 128)
    per_row = (planner.ROW_ACTIVATIONS + g.top_k) * g.hidden_size + 2 * g.expert_intermediate + g.vocab_size
    reserve = (rows * per_row + rows * g.num_heads * ctx) * 4 + planner.FIXED_RESERVE_BYTES
    fixed = dense + kv + reserve
    row = per_expert * len(g.moe_layers)
    for want in (1, 3, 7):
        exact = planner.plan(facts.model, PlanRequest(fixed + want * row, ctx, slots), g, facts.layout, facts.tensors)
        assert (exact.dense_bytes, exact.kv_bytes, exact.reserve_bytes) == (dense, kv, reserve)
        assert exact.expert_bytes == per_expert and exact.moe_layers == len(g.moe_layers)
        assert exact.cache_slots_per_layer == want and exact.cache_bytes == want * row and exact.fits
        short = planner.plan(facts.model, PlanRequest(fixed + want * row - 1, ctx, slots), g, facts.layout,
                             facts.tensors)
        assert short.cache_slots_per_layer == want - 1
    assert exact.min_ram_bytes == fixed + row
    assert exact.routed_bytes_per_token == g.top_k * per_expert * len(g.moe_layers)


def test_slots_capped_at_experts_per_layer(facts):
    p = planner.plan(facts.model, PlanRequest(64 * 1024 * MIB, 128), facts.geometry, facts.layout, facts.tensors)
    assert p.cache_slots_per_layer == facts.geometry.num_experts == p.experts_per_layer
    assert any("every routed expert fits" in n for n in p.notes)


def test_not_even_one_slot_does_not_fit(facts):
    p = planner.plan(facts.model, PlanRequest(planner.FIXED_RESERVE_BYTES, 128), facts.geometry, facts.layout,
                     facts.tensors)
    assert not p.fits and p.cache_slots_per_layer == 0
    ok = planner.plan(facts.model, PlanRequest(p.min_ram_bytes, 128), facts.geometry, facts.layout, facts.tensors)
    assert ok.fits and ok.cache_slots_per_layer == 1
    assert not planner.plan(facts.model, PlanRequest(p.min_ram_bytes - 1, 128), facts.geometry, facts.layout,
                            facts.tensors).fits


def test_recurrent_state_and_disk_bound_speed(facts):
    g = replace(facts.geometry, state_bytes_per_slot=1000)
    p = planner.plan(facts.model, PlanRequest(8 * 1024 * MIB, 64, kv_slots=3, disk_bandwidth=1e9), g, facts.layout,
                     facts.tensors)
    assert p.state_bytes == 3000
    assert p.disk_bound_tokens_per_s == pytest.approx(1e9 / p.routed_bytes_per_token)


def test_forced_cap(facts):
    g = facts.geometry
    p = planner.plan(facts.model, PlanRequest(8 * 1024 * MIB, 64, cap=5), g, facts.layout, facts.tensors)
    assert p.cache_slots_per_layer == 5 and p.fits
    tight = planner.plan(facts.model, PlanRequest(p.min_ram_bytes - 1, 64, cap=5), g, facts.layout, facts.tensors)
    assert not tight.fits and any("--cap 5" in n for n in tight.notes)


def test_without_layout_everything_is_resident(facts):
    p = planner.plan(facts.model, PlanRequest(8 * 1024 * MIB, 64), facts.geometry, None, facts.tensors)
    assert p.dense_bytes == facts.tensors.total_bytes and p.moe_layers == 0 and p.fits


def test_hook_plan_resources(facts, family_class):
    """Core's planner answers by default; a family's own plan_resources wins."""
    request = PlanRequest(8 * 1024 * MIB, 64)
    hook = plugins.family_hook("testolmoe", "plan_resources")
    default = hook(model=facts.model, request=request, geometry=facts.geometry, layout=facts.layout,
                   tensors=facts.tensors)
    assert default == planner.plan(facts.model, request, facts.geometry, facts.layout, facts.tensors)
    custom = replace(default, notes=("the family's own plan",))

    class Planning(family_class):
        @hookimpl
        def plan_resources(self, model, request, geometry, layout, tensors):
            return custom

    plugins.reset()
    plugins.register(Planning(), "testolmoe")
    assert plugins.family_hook("testolmoe", "plan_resources")(
        model=facts.model, request=request, geometry=facts.geometry, layout=facts.layout,
        tensors=facts.tensors) is custom


# ----------------------------------------------------------------------------------------------- coli plan

def plan_json(*args):
    result = runner.invoke(app, ["plan", "--json", *args])
    return result, (json.loads(result.stdout) if result.stdout.strip() else None)


def test_plan_command_with_given_budget(olmoe_family, tiny_olmoe):
    result, data = plan_json("--model", str(tiny_olmoe.path), "--ram", "1", "--ctx", "512", "--kv-slots", "2",
                             "--disk-bw", "2")
    assert result.exit_code == 0, result.output
    assert data["ram_bytes"] == 1024**3 and data["ctx"] == 512 and data["kv_slots"] == 2
    assert data["disk_bandwidth"] == 2e9 and data["sources"] == {"ram": "--ram", "disk_bandwidth": "--disk-bw"}
    assert data["fits"] is True
    assert set(data) >= {f for f in ResourcePlan.__dataclass_fields__}


def test_plan_defaults_to_available_ram_and_reads_no_weights(olmoe_family, tiny_olmoe, monkeypatch, tmp_path):
    measured = []
    monkeypatch.setenv("COLIBRI_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(sysinfo, "memory",
                        lambda: sysinfo.MemoryInfo(3 * 1024**3, 5 * 1024**3, 8 * 1024**3, 3 * 1024**3, 0, 2))
    monkeypatch.setattr(sysinfo, "measure_read_bandwidth", lambda path: measured.append(path) or 1.5e9)
    result, data = plan_json("--model", str(tiny_olmoe.path))
    assert result.exit_code == 0, result.output
    assert data["ram_bytes"] == 3 * 1024**3 and data["sources"]["ram"] == "cgroup v2 limit"
    assert measured == [] and data["disk_bandwidth"] == 0 and "--measure-disk" in data["sources"]["disk_bandwidth"]
    assert data["ctx"] == 4096  # the default, within the model's 4096


def test_plan_measure_disk_reads_once_and_is_remembered(olmoe_family, tiny_olmoe, monkeypatch, tmp_path):
    measured = []
    monkeypatch.setenv("COLIBRI_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(sysinfo, "measure_read_bandwidth", lambda path: measured.append(path) or 1.5e9)
    result, data = plan_json("--model", str(tiny_olmoe.path), "--ram", "1", "--measure-disk")
    assert result.exit_code == 0, result.output
    assert measured == [tiny_olmoe.path / "model.safetensors"] and data["disk_bandwidth"] == 1.5e9
    result, data = plan_json("--model", str(tiny_olmoe.path), "--ram", "1")
    assert result.exit_code == 0, result.output
    assert len(measured) == 1 and data["disk_bandwidth"] == 1.5e9


def test_plan_that_does_not_fit_exits_1_with_the_numbers(olmoe_family, tiny_olmoe):
    result = runner.invoke(app, ["plan", "--model", str(tiny_olmoe.path), "--ram", "0.05", "--disk-bw", "1"])
    assert result.exit_code == 1
    assert "Traceback" not in result.output
    assert "fits              no" in result.stdout
    error = result.stderr.strip().splitlines()
    assert len(error) == 1 and error[0].startswith("error: ")
    assert "cannot hold one expert slot per MoE layer" in error[0] and "needs at least" in error[0]
    assert "--ram 0.08" in error[0]  # 72.4 MiB, rounded up
    assert runner.invoke(app, ["plan", "--model", str(tiny_olmoe.path), "--ram", "0.08", "--disk-bw", "1"]
                         ).exit_code == 0


@pytest.mark.parametrize("args, fragment", [
    (["--ctx", "5000"], "--ctx 5000 exceeds the testolmoe engine's limit of 4096"),
    (["--kv-slots", "9"], "--kv-slots 9 exceeds"),
    (["--kv-slots", "0"], "--kv-slots 0: must be at least 1"),
    (["--ram", "-1"], "--ram -1"),
    (["--disk-bw", "0"], "--disk-bw 0"),
])
def test_plan_refuses_values_past_limits(olmoe_family, tiny_olmoe, args, fragment):
    result = runner.invoke(app, ["plan", "--model", str(tiny_olmoe.path), "--ram", "1", "--disk-bw", "1", *args])
    assert result.exit_code == 1
    assert "Traceback" not in result.output
    assert fragment in result.stderr


def test_plan_text_output(olmoe_family, tiny_olmoe):
    result = runner.invoke(app, ["plan", "--model", str(tiny_olmoe.path), "--ram", "2", "--disk-bw", "1"])
    assert result.exit_code == 0
    for label in ("RAM budget", "dense weights", "KV cache", "reserve", "expert cache", "cold read/token",
                  "disk-bound speed", "minimum RAM"):
        assert label in result.stdout


def test_plan_default_ctx_without_limits_or_max_context(olmoe_family, family_class, tiny_olmoe):
    class Unbounded(family_class):
        @hookimpl
        def model_geometry(self, model):
            return replace(super().model_geometry(model), max_context=0)

        @hookimpl
        def limits(self, model):
            return None

    plugins.reset()
    plugins.register(Unbounded(), "testolmoe")
    result, data = plan_json("--model", str(tiny_olmoe.path), "--ram", "1", "--disk-bw", "1")
    assert result.exit_code == 0, result.output
    assert data["ctx"] == 4096 and data["kv_slots"] == 1


def test_plan_says_what_chat_and_serve_would_trade_under_a_tight_budget(facts, tiny_olmoe):
    at = planner.plan(facts.model, PlanRequest(0, 4096), facts.geometry, facts.layout, facts.tensors)
    ram = at.dense_bytes + at.kv_bytes + at.reserve_bytes + 4 * at.expert_bytes * at.moe_layers
    result, data = plan_json("--model", str(tiny_olmoe.path), "--ram", repr(ram / 1024 ** 3), "--disk-bw", "1")
    assert result.exit_code == 0, result.output
    assert data["ctx"] == 4096 and data["cache_slots_per_layer"] == 4        # the plan asked for stays as it was
    note = [n for n in data["notes"] if n.startswith("coli chat/serve without --ctx: ctx 4096 -> ")]
    assert len(note) == 1 and "expert slots per layer (4 at ctx 4096)" in note[0]
    assert note[0].endswith("pass --ctx to choose (coli run sizes it from its prompt + --max-tokens)")
    chosen = planner.plan(facts.model, PlanRequest(ram, 2048), facts.geometry, facts.layout, facts.tensors)
    assert "ctx 4096 -> 2048" in note[0] and f"keep {chosen.cache_slots_per_layer} expert" in note[0]
    _, asked = plan_json("--model", str(tiny_olmoe.path), "--ram", repr(ram / 1024 ** 3), "--ctx", "4096")
    assert not [n for n in asked["notes"] if "without --ctx" in n]          # an explicit --ctx: nothing to say
