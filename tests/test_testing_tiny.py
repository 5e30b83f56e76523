"""colibri.testing.tiny: the tiny checkpoints other packages' tests rely on."""

from __future__ import annotations

import json
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from colibri.checkpoint import TensorIndex, default_shard_set
from colibri.testing import tiny


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny-core")


def _index(path):
    return TensorIndex((default_shard_set(path),))


def test_kinds_cover_every_family():
    assert set(tiny.TEXT_KINDS) >= {"olmoe", "qwen2_moe", "qwen3_moe", "qwen3_next", "qwen3_5_moe_text",
                                    "deepseek_v3", "deepseek_v32", "deepseek_v4", "kimi_linear", "kimi_k2",
                                    "glm4_moe", "glm4_moe_lite", "glm_moe_dsa"}
    with pytest.raises(ValueError, match="unknown tiny model kind 'llama'"):
        tiny.tiny_model("llama", "/nonexistent")


def test_memoised_and_reused_across_processes(root):
    first = tiny.tiny_model("qwen3_moe", root, seed=1)
    assert tiny.tiny_model("qwen3_moe", root, seed=1) is first
    tiny._memo.clear()                                  # as a fresh process would see it: the sidecar answers
    again = tiny.tiny_model("qwen3_moe", root, seed=1)
    assert again == first and (first.path / "config.json").is_file()
    other = tiny.tiny_model("qwen3_moe", root, seed=2)
    assert other.path != first.path


def test_seed_decides_the_weights(root, tmp_path):
    from safetensors.numpy import load_file

    a = tiny.build_text_model("olmoe", tmp_path / "a", seed=4)
    b = tiny.build_text_model("olmoe", tmp_path / "b", seed=4)
    c = tiny.build_text_model("olmoe", tmp_path / "c", seed=5)
    wa, wb, wc = (load_file(str(m.path / "model.safetensors")) for m in (a, b, c))
    name = "model.layers.0.mlp.gate.weight"
    assert (wa[name] == wb[name]).all() and not (wa[name] == wc[name]).all()
    # O(1) scale, not HF's 0.02 init: router rows ~ N(0, 1/hidden)
    assert 0.5 < float(wa[name].std()) * 8 < 1.5
    norm = wa["model.layers.0.input_layernorm.weight"]
    assert abs(float(norm.mean()) - 1.0) < 0.1 and float(norm.std()) > 0.03


def test_overrides_use_the_family_spelling(root):
    built = tiny.tiny_model("deepseek_v3", root, num_experts=24, top_k=6, num_layers=4)
    cfg = json.loads((built.path / "config.json").read_text())
    assert (cfg["n_routed_experts"], cfg["num_experts_per_tok"], cfg["num_hidden_layers"]) == (24, 6, 4)
    kimi = tiny.tiny_model("kimi_linear", root, top_k=2, n_group=2, topk_group=1)
    kcfg = json.loads((kimi.path / "config.json").read_text())
    assert (kcfg["num_experts_per_token"], kcfg["num_expert_group"]) == (2, 2)


def test_routing_buffers_are_randomised(root):
    built = tiny.tiny_model("deepseek_v4", root)
    from safetensors.numpy import load_file

    w = load_file(str(built.path / "model.safetensors"))
    bias = w["model.layers.1.ffn.gate.bias"]
    assert float(abs(bias).max()) > 0.05
    table = w["model.layers.0.ffn.gate.tid2eid"]
    assert table.shape == (512, 4) and table.min() >= 0 and table.max() < 16
    assert all(len(set(row)) == 4 for row in table.tolist())
    assert built.num_stored_elements == built.num_parameters + 16 * 2 + 512 * 4


def test_kimi_k2_is_deepseek_v3_under_its_own_type(root):
    built = tiny.tiny_model("kimi_k2", root)
    cfg = json.loads((built.path / "config.json").read_text())
    assert cfg["model_type"] == "kimi_k2" and cfg["architectures"] == ["DeepseekV3ForCausalLM"]
    ds = tiny.tiny_model("deepseek_v3", root)
    assert {t.name for t in _index(built.path)} == {t.name for t in _index(ds.path)}


def test_tokenizer_and_chat_template(root):
    from jinja2 import Environment
    from tokenizers import Tokenizer

    built = tiny.tiny_model("qwen2_moe", root)
    tok = Tokenizer.from_file(str(built.path / "tokenizer.json"))
    assert tok.get_vocab_size() == 512
    ids = tok.encode("<|im_start|>user\nhello experts<|im_end|>").ids
    assert ids[0] == tok.token_to_id("<|im_start|>") and tok.token_to_id("<|im_end|>") in ids
    assert tok.decode(tok.encode("Placement may change speed, never the tokens.").ids) == \
        "Placement may change speed, never the tokens."
    tcfg = json.loads((built.path / "tokenizer_config.json").read_text())
    text = Environment().from_string(tcfg["chat_template"]).render(
        messages=[{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    cfg = json.loads((built.path / "config.json").read_text())
    assert cfg["eos_token_id"] == tok.token_to_id("<|im_end|>")
    gen = json.loads((built.path / "generation_config.json").read_text())
    assert gen.get("eos_token_id") is None and gen["do_sample"] is False


def test_chat_template_as_jinja_file(tmp_path):
    tiny.train_tokenizer(tmp_path, "olmoe", chat_template_in="jinja")
    assert "chat_template" not in json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert "<|assistant|>" in (tmp_path / "chat_template.jinja").read_text()


def test_bf16_keeps_router_tensors_f32(root):
    built = tiny.tiny_model("glm4_moe", root, dtype="bfloat16")
    dtypes = {t.name: t.dtype for t in _index(built.path)}
    assert dtypes["model.layers.1.mlp.experts.0.up_proj.weight"] == "BF16"
    assert dtypes["model.layers.1.mlp.gate.e_score_correction_bias"] == "F32"


def test_transformers_runs_the_tiny_model(root):
    import torch
    from transformers import AutoModelForCausalLM

    built = tiny.tiny_model("olmoe", root)
    model = AutoModelForCausalLM.from_pretrained(built.path)
    assert model.num_parameters() == built.num_parameters
    out = model.generate(torch.tensor([[5, 77, 300, 12]]), max_new_tokens=6, do_sample=False)
    assert out.shape == (1, 10)                  # eos_token_id is null in generation_config: full length
    layer = model.model.layers[0]
    with torch.no_grad():
        hidden = layer.input_layernorm(model.model.embed_tokens(torch.arange(64)))
        logits = hidden @ layer.mlp.gate.weight.T
    assert float(logits.std()) > 0.5              # O(1) router logits: routing far from uniform
