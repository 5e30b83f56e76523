"""Qwen plugin: detection, geometry (tiny models and real-style configs), tensor layout vs real saves."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from colibri import plugins
from colibri.errors import ConfigError
from colibri.model import resolve_model
from colibri.testing.checks import check_layout_against_checkpoint, claim_of, resolved, routers_and_experts_consistent
from colibri.testing.tiny import tiny_model
from colibri_qwen import plugin

KINDS = ("qwen2_moe", "qwen3_moe", "qwen3_next", "qwen3_5_moe_text", "qwen3_5_moe")

# Qwen/Qwen3-30B-A3B config.json (hub spelling: num_experts, top-level rope_theta, mlp_only_layers).
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "bos_token_id": 151643,
    "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048,
    "intermediate_size": 6144, "max_position_embeddings": 40960, "max_window_layers": 48, "mlp_only_layers": [],
    "model_type": "qwen3_moe", "moe_intermediate_size": 768, "norm_topk_prob": True, "num_attention_heads": 32,
    "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0, "tie_word_embeddings": False,
    "vocab_size": 151936,
}
# Qwen/Qwen1.5-MoE-A2.7B: no mlp_only_layers / qkv_bias fields (older config), shared expert 5632 wide.
QWEN15_MOE = {
    "architectures": ["Qwen2MoeForCausalLM"], "decoder_sparse_step": 1, "hidden_size": 2048,
    "intermediate_size": 5632, "max_position_embeddings": 8192, "model_type": "qwen2_moe",
    "moe_intermediate_size": 1408, "num_attention_heads": 16, "num_experts": 60, "num_experts_per_tok": 4,
    "num_hidden_layers": 24, "num_key_value_heads": 16, "rope_theta": 1000000.0,
    "shared_expert_intermediate_size": 5632, "tie_word_embeddings": False, "vocab_size": 151936,
}
# Qwen/Qwen3-Next-80B-A3B-Instruct: hybrid layout by full_attention_interval, partial RoPE at top level.
QWEN3_NEXT_80B = {
    "architectures": ["Qwen3NextForCausalLM"], "decoder_sparse_step": 1, "full_attention_interval": 4,
    "head_dim": 256, "hidden_size": 2048, "intermediate_size": 5120, "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
    "linear_value_head_dim": 128, "max_position_embeddings": 262144, "mlp_only_layers": [],
    "model_type": "qwen3_next", "moe_intermediate_size": 512, "norm_topk_prob": True, "num_attention_heads": 16,
    "num_experts": 512, "num_experts_per_tok": 10, "num_hidden_layers": 48, "num_key_value_heads": 2,
    "partial_rotary_factor": 0.25, "rope_theta": 10000000, "shared_expert_intermediate_size": 512,
    "tie_word_embeddings": False, "vocab_size": 151936,
}
# Qwen/Qwen3.5-35B-A3B: multimodal wrapper, the LM under text_config with M-RoPE rope_parameters.
QWEN35_35B = {
    "architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
    "tie_word_embeddings": False, "image_token_id": 248056,
    "text_config": {
        "model_type": "qwen3_5_moe_text", "hidden_size": 2048, "num_hidden_layers": 40, "num_attention_heads": 16,
        "num_key_value_heads": 2, "head_dim": 256, "num_experts": 256, "num_experts_per_tok": 8,
        "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512, "full_attention_interval": 4,
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_num_key_heads": 16,
        "linear_num_value_heads": 32, "linear_value_head_dim": 128, "max_position_embeddings": 262144,
        "vocab_size": 248320, "mtp_num_hidden_layers": 1,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                            "mrope_interleaved": True, "mrope_section": [11, 11, 10]},
    },
    "vision_config": {"depth": 27, "hidden_size": 1152, "model_type": "qwen3_5_moe"},
}


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny-qwen")


def test_entry_point_registers_family():
    plugins.reset()
    assert "qwen" in plugins.families() and not plugins.families()["qwen"].error


@pytest.mark.parametrize("model_type", KINDS + ("qwen2", "qwen3", "olmoe", "deepseek_v3", None))
def test_detect_config(tmp_path, model_type):
    claim = claim_of(plugin.FAMILY, tmp_path, {"model_type": model_type})
    assert (claim is not None) == (model_type in KINDS)
    if claim:
        assert (claim.family, claim.model_type) == ("qwen", model_type)


@pytest.mark.parametrize("kind", KINDS)
def test_tiny_resolves_and_layout_matches_checkpoint(tiny_root, kind):
    built = tiny_model(kind, tiny_root)
    plugins.reset()
    model = resolve_model(built.path)
    assert (model.family, model.model_type) == ("qwen", kind)
    geo = plugin.model_geometry(model=model)
    assert (geo.num_experts, geo.top_k, geo.expert_intermediate) == (16, 4, 32)
    layout = plugin.tensor_layout(model=model)
    routers_and_experts_consistent(layout, geo.moe_layers, geo.num_experts)
    index = check_layout_against_checkpoint(layout, built.path, built.num_stored_elements)
    assert built.num_stored_elements == built.num_parameters
    if kind == "qwen3_5_moe":
        assert any(t.name.startswith("model.visual.") for t in index)   # skipped, but present on disk


@pytest.mark.parametrize("kind", ("qwen3_next", "qwen3_5_moe_text"))
def test_tiny_hybrid_geometry(tiny_root, kind):
    geo = plugin.model_geometry(model=resolved(tiny_model(kind, tiny_root).path, "qwen"))
    # layers 0-2 Gated DeltaNet, layer 3 full attention: KV for one layer only.
    assert geo.kv_bytes_per_token == 1 * 2 * 2 * 16 * 4
    conv_dim = 2 * 2 * 16 + 4 * 16
    # live state + the engine's end-of-prompt checkpoint
    assert geo.state_bytes_per_slot == 2 * 3 * (conv_dim * 3 * 4 + 4 * 16 * 16 * 4)


@pytest.mark.parametrize("overrides", [{"num_experts": 8, "top_k": 2}, {"tie_word_embeddings": True},
                                       {"num_layers": 3, "mlp_only_layers": [1]}])
def test_tiny_overrides(tiny_root, overrides):
    built = tiny_model("qwen2_moe", tiny_root, **overrides)
    model = resolved(built.path, "qwen")
    geo = plugin.model_geometry(model=model)
    layout = plugin.tensor_layout(model=model)
    assert geo.num_experts == overrides.get("num_experts", 16)
    assert geo.dense_layers == tuple(overrides.get("mlp_only_layers", ()))
    assert (layout.lm_head is None) == bool(overrides.get("tie_word_embeddings"))
    routers_and_experts_consistent(layout, geo.moe_layers, geo.num_experts)
    check_layout_against_checkpoint(layout, built.path, built.num_parameters)


def test_qwen3_30b_a3b(tmp_path):
    geo = plugin.model_geometry(model=resolved(tmp_path, "qwen", QWEN3_30B_A3B))
    assert (geo.num_layers, geo.num_heads, geo.num_kv_heads, geo.head_dim) == (48, 32, 4, 128)
    assert (geo.num_experts, geo.top_k, geo.expert_intermediate, geo.num_shared_experts) == (128, 8, 768, 0)
    assert geo.moe_layers == tuple(range(48)) and geo.max_context == 40960
    assert geo.kv_bytes_per_token == 48 * 2 * 4 * 128 * 4
    assert "theta 1e+06" in dict(geo.notes)["rope"]
    layout = plugin.tensor_layout(model=resolved(tmp_path, "qwen", QWEN3_30B_A3B))
    assert len(layout.experts) == 48 * 128
    assert "model.layers.47.self_attn.k_norm.weight" in layout.norms


def test_qwen15_moe_defaults_qkv_bias_and_shared_expert(tmp_path):
    model = resolved(tmp_path, "qwen", QWEN15_MOE)
    geo = plugin.model_geometry(model=model)
    assert (geo.num_experts, geo.top_k, geo.num_shared_experts, geo.max_context) == (60, 4, 1, 8192)
    assert geo.attention.endswith("qkv bias")
    assert dict(geo.notes)["router"] == "softmax top-k"
    layout = plugin.tensor_layout(model=model)
    assert "model.layers.0.self_attn.q_proj.bias" in layout.required
    assert "model.layers.23.mlp.shared_expert_gate.weight" in layout.required


def test_qwen3_next_80b(tmp_path):
    model = resolved(tmp_path, "qwen", QWEN3_NEXT_80B)
    geo = plugin.model_geometry(model=model)
    assert geo.kv_bytes_per_token == 12 * 2 * 2 * 256 * 4
    conv_dim = 2 * 16 * 128 + 32 * 128
    assert geo.state_bytes_per_slot == 2 * 36 * (conv_dim * 3 * 4 + 32 * 128 * 128 * 4)
    assert "partial 0.25" in dict(geo.notes)["rope"]
    layout = plugin.tensor_layout(model=model)
    assert "model.layers.3.self_attn.q_proj.weight" in layout.required
    assert "model.layers.4.linear_attn.in_proj_qkvz.weight" in layout.required
    assert "mtp." in layout.skipped_prefixes


def test_qwen35_multimodal_wrapper_reads_text_config(tmp_path):
    model = resolved(tmp_path, "qwen", QWEN35_35B)
    geo = plugin.model_geometry(model=model)
    assert (geo.num_layers, geo.vocab_size, geo.num_experts, geo.top_k) == (40, 248320, 256, 8)
    assert geo.kv_bytes_per_token == 10 * 2 * 2 * 256 * 4 and geo.max_context == 262144
    layout = plugin.tensor_layout(model=model)
    assert layout.embeddings[0] == "model.language_model.embed_tokens.weight"
    assert "model.language_model.layers.0.linear_attn.in_proj_qkv.weight" in layout.required
    assert "model.visual." in layout.skipped_prefixes
    assert dict(geo.notes)["router"] == "softmax top-k, renormalised"
    assert plugin.limits(model=model).max_context == 262144


def test_bad_field_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="num_experts"):
        plugin.model_geometry(model=resolved(tmp_path, "qwen", {**QWEN3_30B_A3B, "num_experts": "many"}))
    broken = {k: v for k, v in QWEN3_NEXT_80B.items() if k != "linear_num_key_heads"}
    with pytest.raises(ConfigError, match="linear_num_key_heads"):
        plugin.model_geometry(model=resolved(tmp_path, "qwen", broken))


def test_limits(tmp_path):
    lim = plugin.limits(model=resolved(tmp_path, "qwen", QWEN3_30B_A3B))
    assert lim.max_context == 40960 and lim.has_engine


def _hparams(tmp_path, config) -> dict[str, str]:
    args = plugin.engine_hparams(resolved(tmp_path, "qwen", config))
    assert list(args[::2]) == ["--set"] * (len(args) // 2)
    return dict(a.split("=", 1) for a in args[1::2])


def test_engine_hparams_of_real_configs(tmp_path):
    q3 = _hparams(tmp_path, QWEN3_30B_A3B)
    assert (q3["qk_norm"], q3["norm_topk_prob"], q3["rope_theta"], q3["num_experts"]) == ("1", "1", "1000000.0", "128")
    assert "mlp_only_layers" not in q3 and "layer_types" not in q3 and "shared_expert_intermediate_size" not in q3
    q15 = _hparams(tmp_path, QWEN15_MOE)
    assert (q15["qkv_bias"], q15["norm_topk_prob"], q15["shared_expert_intermediate_size"]) == ("1", "0", "5632")
    nxt = _hparams(tmp_path, QWEN3_NEXT_80B)
    assert nxt["partial_rotary_factor"] == "0.25" and nxt["linear_projection"] == "fused"
    assert nxt["layer_types"].split(",")[:4] == ["linear_attention"] * 3 + ["full_attention"]
    assert (nxt["zero_centered_norm"], nxt["attn_output_gate"]) == ("1", "1")
    q35 = _hparams(tmp_path, QWEN35_35B)
    assert q35["weight_prefix"] == "model.language_model." and q35["linear_projection"] == "split"
    assert q35["norm_topk_prob"] == "1" and q35["vocab_size"] == "248320"
    assert "mrope_section" not in q35      # text positions are equal on every M-RoPE section: plain RoPE
