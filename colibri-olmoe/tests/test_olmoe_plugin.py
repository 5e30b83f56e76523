"""OLMoE plugin: detection, geometry (tiny model and a real-style config), tensor layout vs a real save."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from colibri import plugins
from colibri.errors import ConfigError
from colibri.model import resolve_model
from colibri.testing.checks import check_layout_against_checkpoint, claim_of, resolved, routers_and_experts_consistent
from colibri.testing.tiny import tiny_model
from colibri_olmoe import plugin

# allenai/OLMoE-1B-7B-0924 config.json as published (hub spelling: top-level rope_theta, rope_scaling null).
OLMOE_1B_7B = {
    "architectures": ["OlmoeForCausalLM"], "attention_bias": False, "clip_qkv": None, "eos_token_id": 50279,
    "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 1024, "max_position_embeddings": 4096,
    "model_type": "olmoe", "norm_topk_prob": False, "num_attention_heads": 16, "num_experts": 64,
    "num_experts_per_tok": 8, "num_hidden_layers": 16, "num_key_value_heads": 16, "pad_token_id": 1,
    "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 10000.0, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "vocab_size": 50304,
}


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny-olmoe")


def test_entry_point_registers_family():
    plugins.reset()
    loaded = plugins.families()
    assert "olmoe" in loaded and not loaded["olmoe"].error


@pytest.mark.parametrize("model_type,claimed", [("olmoe", True), ("qwen3_moe", False), ("llama", False),
                                                (None, False)])
def test_detect_config(tmp_path, model_type, claimed):
    config = {"model_type": model_type} if model_type else {}
    claim = claim_of(plugin.FAMILY, tmp_path, config)
    assert (claim is not None) == claimed
    if claimed:
        assert claim.family == "olmoe" and claim.model_type == "olmoe"
    assert claim_of(plugin.FAMILY, tmp_path, None) is None


def test_resolve_tiny_model_through_entry_points(tiny_root):
    built = tiny_model("olmoe", tiny_root)
    plugins.reset()
    model = resolve_model(built.path)
    assert (model.family, model.model_type) == ("olmoe", "olmoe")


def test_geometry_real_config(tmp_path):
    geo = plugin.model_geometry(model=resolved(tmp_path, "olmoe", OLMOE_1B_7B))
    assert (geo.num_layers, geo.hidden_size, geo.vocab_size) == (16, 2048, 50304)
    assert (geo.num_heads, geo.num_kv_heads, geo.head_dim) == (16, 16, 128)
    assert (geo.num_experts, geo.top_k, geo.expert_intermediate, geo.num_shared_experts) == (64, 8, 1024, 0)
    assert geo.moe_layers == tuple(range(16)) and geo.dense_layers == ()
    assert geo.max_context == 4096
    assert geo.kv_bytes_per_token == 2 * 16 * 128 * 4 * 16
    assert geo.state_bytes_per_slot == 0
    assert dict(geo.notes)["router"] == "softmax top-k"


@pytest.mark.parametrize("overrides", [{}, {"num_experts": 32, "top_k": 8, "norm_topk_prob": True},
                                       {"num_kv_heads": 2, "tie_word_embeddings": True}])
def test_tiny_geometry_and_layout(tiny_root, overrides):
    built = tiny_model("olmoe", tiny_root, **overrides)
    model = resolved(built.path, "olmoe")
    geo = plugin.model_geometry(model=model)
    cfg = model.config
    assert geo.num_experts == cfg["num_experts"] == overrides.get("num_experts", 16)
    assert geo.top_k == overrides.get("top_k", 4)
    assert geo.num_kv_heads == overrides.get("num_kv_heads", 4)
    assert geo.kv_bytes_per_token == 2 * geo.num_kv_heads * 16 * 4 * geo.num_layers
    layout = plugin.tensor_layout(model=model)
    assert (layout.lm_head is None) == bool(overrides.get("tie_word_embeddings"))
    routers_and_experts_consistent(layout, geo.moe_layers, geo.num_experts)
    check_layout_against_checkpoint(layout, built.path, built.num_parameters)


def test_missing_field_is_a_config_error(tmp_path):
    broken = {k: v for k, v in OLMOE_1B_7B.items() if k != "num_experts"}
    with pytest.raises(ConfigError, match="num_experts"):
        plugin.model_geometry(model=resolved(tmp_path, "olmoe", broken))


def test_limits_context_from_config(tmp_path):
    lim = plugin.limits(model=resolved(tmp_path, "olmoe", OLMOE_1B_7B))
    assert lim.max_context == 4096
    assert lim.has_engine or lim.reason_no_engine  # a missing engine is always explained
