"""``coli demo`` on colibri-olmoe's bundled models: the quarter-of-the-experts budget, the trained colibri-nano
streaming experts, and ``--synthetic``. Cross-package (core's CLI and demo flow, a family's demo_model and engine),
so it lives here rather than in core's own tests."""

from __future__ import annotations

import re

import pytest
from typer.testing import CliRunner

from colibri import demo, plugins


@pytest.fixture
def olmoe_installed(monkeypatch):
    pytest.importorskip("colibri_olmoe")
    monkeypatch.setenv("COLIBRI_LOAD_PLUGINS", "olmoe")
    plugins.reset()
    yield
    plugins.reset()


def test_budget_holds_a_quarter_of_the_experts(olmoe_installed):
    from colibri.inventory import load_facts
    from colibri.launch import prepare
    from colibri.model import resolve_model

    offered = demo.find_demo_model()
    facts = load_facts(resolve_model(offered.path))
    ram = demo.budget_for_cache_fraction(facts, ctx=256)
    spec = prepare(facts.model, ram_gib=ram / 1024 ** 3, ctx=256, facts=facts)
    assert spec.cap == facts.geometry.num_experts // 4
    assert spec.plan.ram_bytes < facts.tensors.total_bytes + spec.plan.kv_bytes + spec.plan.reserve_bytes


def run_demo(*args: str):
    res = CliRunner().invoke(__import__("colibri.cli", fromlist=["app"]).app,
                             ["demo", "--threads", "2", *args], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    return res.stdout


def test_coli_demo_runs_the_bundled_model_streaming_experts(olmoe_installed):
    """The default: the trained model under a budget that caches a quarter of its experts, greedy completion."""
    out = run_demo("--tokens", "24")
    assert "colibri-nano" in out and "RANDOM" not in out and "noise" not in out
    # The planner's fixed 64 MiB reserve outweighs this small model, so the budget is not smaller than the whole
    # file; what streams is the experts: the cache holds a quarter of each layer's, the rest is read on a miss.
    assert re.search(r"8 of 32 experts per layer \(25%", out)
    read = re.search(r"streamed\s+([\d.]+) (KiB|MiB) of experts read from disk in (\d+) reads "
                     r"\(hit rate ([\d.]+)%", out)
    assert read and int(read.group(3)) > 0 and 0 < float(read.group(4)) < 100
    completion = out[out.index("def fibonacci(n):"):].split("\n\n")[0]
    assert len(completion) > len("def fibonacci(n):") + 8    # it wrote something after the prompt
    again = run_demo("--tokens", "24")                        # greedy: placement never changes the tokens
    assert again[again.index("def fibonacci(n):"):].split("\n\n")[0] == completion


def test_coli_demo_synthetic_runs_a_random_model(tmp_path, monkeypatch, olmoe_installed):
    from colibri_olmoe import plugin
    from colibri_olmoe.synthetic import DemoSpec

    tiny = DemoSpec(hidden=64, layers=3, heads=4, experts=16, top_k=4, expert_width=32, vocab=600,
                    layers_per_shard=2, tokenizer_corpus_bytes=150_000)
    monkeypatch.setattr(plugin, "synthetic_spec", lambda: tiny)
    monkeypatch.setattr(demo, "demo_cache_dir", lambda: tmp_path / "demo")   # the engine build stays shared
    out = run_demo("--synthetic", "--tokens", "12", "--prompt", "import os")
    assert "RANDOM weights" in out and "noise" in out
    assert "4 of 16 experts per layer (25%" in out
    assert re.search(r"decode 12 tok", out)                   # no stop tokens for a random model
    assert (tmp_path / "demo" / tiny.name / demo.COMPLETE_MARKER).exists()
