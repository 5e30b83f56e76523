"""``coli demo --synthetic``'s checkpoint writer: a real OLMoE layout transformers loads, random O(1) weights."""

from __future__ import annotations

import json
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from colibri_olmoe.synthetic import DemoSpec, ensure_checkpoint, write_checkpoint

TINY = DemoSpec(hidden=64, layers=3, heads=4, experts=16, top_k=4, expert_width=32, vocab=600,
                layers_per_shard=2, tokenizer_corpus_bytes=150_000)


def test_tiny_synthetic_checkpoint_loads_in_transformers(tmp_path):
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "demo"
    write_checkpoint(TINY, out)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "olmoe" and config["num_experts"] == 16
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 3       # embeddings + two shards of layers
    model, info = AutoModelForCausalLM.from_pretrained(str(out), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert model.num_parameters() * 4 == TINY.total_bytes
    # The N(0, 1/fan_in) recipe: rows of unit-ish norm, norms around 1 with real spread.
    q = model.state_dict()["model.layers.1.self_attn.q_proj.weight"]
    assert 0.8 < float(q.pow(2).sum(1).mean()) < 1.2
    norm = model.state_dict()["model.layers.1.input_layernorm.weight"]
    assert 0.9 < float(norm.mean()) < 1.1 and float(norm.std()) > 0.05
    tok = AutoTokenizer.from_pretrained(str(out))
    ids = tok("def f(x): return x")["input_ids"]
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), 600) and torch.isfinite(logits).all()


def test_ensure_checkpoint_writes_once_under_the_cache_dir(tmp_path):
    path, built = ensure_checkpoint(tmp_path, TINY)
    assert built and path == tmp_path / TINY.name and (path / ".complete").exists()
    assert ensure_checkpoint(tmp_path, TINY) == (path, False)
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == [TINY.name]
