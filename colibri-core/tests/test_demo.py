"""``coli demo``: the synthetic checkpoint (real OLMoE layout, torch-free writer), its caching, its budget, a run."""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest
from typer.testing import CliRunner

from colibri import demo, plugins
from colibri.checkpoint import read_header
from colibri.safetensors_writer import write_safetensors

TINY = demo.DemoSpec(hidden=64, layers=3, heads=4, experts=16, top_k=4, expert_width=32, vocab=600,
                     layers_per_shard=2, tokenizer_corpus_bytes=150_000)


def test_safetensors_writer_round_trips(tmp_path):
    from safetensors.numpy import load_file

    arrays = {"a": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.array([1, 2, 3], dtype=np.int64),
              "c": np.ones((2, 2, 2), dtype=np.float16)}
    path = tmp_path / "x.safetensors"
    size = write_safetensors(path, arrays.items(), {"format": "pt"})
    assert size == path.stat().st_size
    loaded = load_file(str(path))
    for name, arr in arrays.items():
        np.testing.assert_array_equal(loaded[name], arr)
    header = read_header(path)
    assert header.data_start % 8 == 0 and header.metadata == {"format": "pt"}
    assert [t.name for t in header.tensors] == ["a", "b", "c"]
    assert not list(tmp_path.glob(".*tmp"))


def test_tiny_demo_checkpoint_loads_in_transformers(tmp_path):
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "demo"
    demo.write_checkpoint(TINY, out)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "olmoe" and config["num_experts"] == 16
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 3       # embeddings + two shards of layers
    model, info = AutoModelForCausalLM.from_pretrained(str(out), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert model.num_parameters() * 4 == TINY.total_bytes
    # The N(0, 1/fan_in) recipe: an expert's rows have unit-ish norm, norms sit around 1.
    q = model.state_dict()["model.layers.1.self_attn.q_proj.weight"]
    assert 0.8 < float(q.pow(2).sum(1).mean()) < 1.2
    norm = model.state_dict()["model.layers.1.input_layernorm.weight"]
    assert 0.9 < float(norm.mean()) < 1.1 and float(norm.std()) > 0.05
    tok = AutoTokenizer.from_pretrained(str(out))
    ids = tok("def f(x): return x")["input_ids"]
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), 600) and torch.isfinite(logits).all()


def test_ensure_checkpoint_builds_once_atomically(tmp_path, monkeypatch):
    monkeypatch.setenv("COLIBRI_CACHE", str(tmp_path / "cache"))
    path, built = demo.ensure_checkpoint(TINY)
    assert built and (path / demo.COMPLETE_MARKER).exists()
    assert path.parent == tmp_path / "cache" / "demo"
    assert [p.name for p in path.parent.iterdir() if not p.name.endswith(".lock")] == [TINY.name]
    again, built_again = demo.ensure_checkpoint(TINY)
    assert again == path and not built_again
    # A leftover without the marker (a killed build) is rebuilt, not trusted.
    (path / demo.COMPLETE_MARKER).unlink()
    _, rebuilt = demo.ensure_checkpoint(TINY)
    assert rebuilt


@pytest.fixture
def olmoe_installed(monkeypatch):
    pytest.importorskip("colibri_olmoe")
    monkeypatch.setenv("COLIBRI_LOAD_PLUGINS", "olmoe")
    plugins.reset()
    yield
    plugins.reset()


def test_budget_holds_a_quarter_of_the_experts(tmp_path, olmoe_installed):
    from colibri.inventory import load_facts
    from colibri.launch import prepare
    from colibri.model import resolve_model

    out = tmp_path / "demo"
    demo.write_checkpoint(TINY, out)
    facts = load_facts(resolve_model(out))
    ram = demo.budget_for_cache_fraction(facts, ctx=256)
    spec = prepare(facts.model, ram_gib=ram / 1024 ** 3, ctx=256, facts=facts)
    assert spec.cap == 4                                       # 16 experts / 4
    assert spec.plan.ram_bytes < facts.tensors.total_bytes + spec.plan.kv_bytes + spec.plan.reserve_bytes


def test_coli_demo_runs_streaming_experts(tmp_path, monkeypatch, olmoe_installed):
    """The real thing: the default-size checkpoint under a budget smaller than the model."""
    monkeypatch.setattr(demo, "cache_root", lambda: tmp_path)   # the engine build stays in the shared cache
    res = CliRunner().invoke(__import__("colibri.cli", fromlist=["app"]).app,
                             ["demo", "--tokens", "12", "--threads", "2"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    out = res.stdout
    assert "RANDOM weights" in out and "noise" in out
    assert "8 of 32 experts per layer (25%" in out
    assert "smaller than the model" in out
    read = re.search(r"streamed\s+([\d.]+) (MiB|GiB) of experts read from disk in (\d+) reads", out)
    assert read and int(read.group(3)) > 0
    assert re.search(r"decode 12 tok", out)
    assert (tmp_path / "demo" / demo.DemoSpec().name / demo.COMPLETE_MARKER).exists()
    assert os.path.getsize(next((tmp_path / "demo" / demo.DemoSpec().name).glob("*00002*"))) > 50_000_000
