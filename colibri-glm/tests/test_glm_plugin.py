"""GLM plugin: detection, geometry (tiny models and real-style configs), tensor layout vs real saves."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from colibri import plugins
from colibri.errors import ConfigError
from colibri.model import resolve_model
from colibri.testing.checks import check_layout_against_checkpoint, claim_of, resolved, routers_and_experts_consistent
from colibri.testing.tiny import tiny_model
from colibri_glm import plugin

KINDS = ("glm4_moe", "glm4_moe_lite", "glm_moe_dsa")

# zai-org/GLM-4.5 config.json (hub spelling: top-level partial_rotary_factor / rope_theta, explicit head_dim).
GLM45 = {
    "architectures": ["Glm4MoeForCausalLM"], "attention_bias": True, "eos_token_id": [151329, 151336, 151338],
    "first_k_dense_replace": 3, "head_dim": 128, "hidden_act": "silu", "hidden_size": 5120,
    "intermediate_size": 12288, "max_position_embeddings": 131072, "model_type": "glm4_moe",
    "moe_intermediate_size": 1536, "n_group": 1, "n_routed_experts": 160, "n_shared_experts": 1,
    "norm_topk_prob": True, "num_attention_heads": 96, "num_experts_per_tok": 8, "num_hidden_layers": 92,
    "num_key_value_heads": 8, "num_nextn_predict_layers": 1, "pad_token_id": 151329, "partial_rotary_factor": 0.5,
    "rms_norm_eps": 1e-05, "rope_theta": 1000000, "routed_scaling_factor": 2.5, "tie_word_embeddings": False,
    "topk_group": 1, "use_qk_norm": True, "vocab_size": 151552,
}
# zai-org/GLM-4.7-Flash (glm4_moe_lite, MLA) in the hub spelling with first_k_dense_replace.
GLM47_FLASH = {
    "architectures": ["Glm4MoeLiteForCausalLM"], "model_type": "glm4_moe_lite", "hidden_size": 2048,
    "num_hidden_layers": 47, "num_attention_heads": 20, "num_key_value_heads": 20, "kv_lora_rank": 512,
    "q_lora_rank": 768, "qk_rope_head_dim": 64, "qk_nope_head_dim": 192, "v_head_dim": 256,
    "n_routed_experts": 64, "n_shared_experts": 1, "num_experts_per_tok": 4, "moe_intermediate_size": 1536,
    "intermediate_size": 10240, "first_k_dense_replace": 1, "max_position_embeddings": 202752,
    "vocab_size": 154880, "num_nextn_predict_layers": 1, "rope_theta": 1000000, "routed_scaling_factor": 1.8,
    "n_group": 1, "topk_group": 1, "norm_topk_prob": True,
}
# GLM-5 class (glm_moe_dsa): MLA + DSA indexer.
GLM5 = {
    "architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa", "hidden_size": 6144,
    "num_hidden_layers": 78, "num_attention_heads": 64, "num_key_value_heads": 64, "kv_lora_rank": 512,
    "q_lora_rank": 2048, "qk_rope_head_dim": 64, "qk_nope_head_dim": 192, "v_head_dim": 256,
    "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8, "moe_intermediate_size": 2048,
    "intermediate_size": 12288, "first_k_dense_replace": 3, "max_position_embeddings": 202752,
    "vocab_size": 154880, "num_nextn_predict_layers": 1, "index_head_dim": 128, "index_n_heads": 32,
    "index_topk": 2048, "rope_parameters": {"rope_theta": 1000000, "rope_type": "default"},
}


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny-glm")


def test_entry_point_registers_family():
    plugins.reset()
    assert "glm" in plugins.families() and not plugins.families()["glm"].error


@pytest.mark.parametrize("model_type", KINDS + ("glm4", "chatglm", "deepseek_v3", None))
def test_detect_config(tmp_path, model_type):
    claim = claim_of(plugin.FAMILY, tmp_path, {"model_type": model_type})
    assert (claim is not None) == (model_type in KINDS)
    if claim:
        assert (claim.family, claim.model_type) == ("glm", model_type)


@pytest.mark.parametrize("kind", KINDS)
def test_tiny_resolves_and_layout_matches_checkpoint(tiny_root, kind):
    built = tiny_model(kind, tiny_root)
    plugins.reset()
    model = resolve_model(built.path)
    assert (model.family, model.model_type) == ("glm", kind)
    geo = plugin.model_geometry(model=model)
    assert (geo.num_experts, geo.top_k, geo.num_shared_experts) == (16, 4, 1)
    assert geo.dense_layers == (0,) and geo.moe_layers == (1, 2)
    layout = plugin.tensor_layout(model=model)
    routers_and_experts_consistent(layout, geo.moe_layers, geo.num_experts)
    check_layout_against_checkpoint(layout, built.path, built.num_stored_elements)


def test_tiny_glm4_moe_without_qk_norm_and_bias(tiny_root):
    built = tiny_model("glm4_moe", tiny_root, use_qk_norm=False, attention_bias=False, num_kv_heads=4)
    model = resolved(built.path, "glm")
    layout = plugin.tensor_layout(model=model)
    assert not any("q_norm" in n for n in layout.norms)
    assert not any(n.endswith(".bias") for n in layout.required)
    assert plugin.model_geometry(model=model).kv_bytes_per_token == 3 * 2 * 4 * 16 * 4
    check_layout_against_checkpoint(layout, built.path, built.num_stored_elements)


def test_glm45_real_config(tmp_path):
    model = resolved(tmp_path, "glm", GLM45)
    geo = plugin.model_geometry(model=model)
    assert (geo.num_layers, geo.num_heads, geo.num_kv_heads, geo.head_dim) == (92, 96, 8, 128)
    assert (geo.num_experts, geo.top_k, geo.expert_intermediate) == (160, 8, 1536)
    assert geo.dense_layers == (0, 1, 2) and geo.kv_bytes_per_token == 92 * 2 * 8 * 128 * 4
    assert "partial 0.5" in dict(geo.notes)["rope"] and "theta 1e+06" in dict(geo.notes)["rope"]
    layout = plugin.tensor_layout(model=model)
    assert layout.skipped_prefixes == ("model.layers.92.",)
    assert "model.layers.5.self_attn.k_proj.bias" in layout.required
    assert "model.layers.5.self_attn.q_norm.weight" in layout.norms


def test_glm47_flash_first_k_dense_equals_mlp_layer_types(tmp_path):
    hub = plugin.model_geometry(model=resolved(tmp_path, "glm", GLM47_FLASH))
    saved = {k: v for k, v in GLM47_FLASH.items() if k != "first_k_dense_replace"}
    saved["mlp_layer_types"] = ["dense"] + ["sparse"] * 46
    assert plugin.model_geometry(model=resolved(tmp_path, "glm", saved)) == hub
    assert hub.kv_bytes_per_token == 47 * (512 + 64) * 4 and hub.moe_layers == tuple(range(1, 47))


def test_glm5_dsa(tmp_path):
    model = resolved(tmp_path, "glm", GLM5)
    geo = plugin.model_geometry(model=model)
    assert geo.kv_bytes_per_token == 78 * (512 + 64 + 128) * 4 and geo.max_context == 202752
    assert geo.attention == "MLA + DSA lightning indexer"
    layout = plugin.tensor_layout(model=model)
    assert "model.layers.77.self_attn.indexer.wk.weight" in layout.required
    assert len(layout.experts) == 75 * 256


def test_bad_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="mlp_layer_types"):
        plugin.model_geometry(model=resolved(tmp_path, "glm", {**GLM47_FLASH, "mlp_layer_types": ["dense"]}))
    with pytest.raises(ConfigError, match="n_routed_experts"):
        plugin.model_geometry(model=resolved(tmp_path, "glm", {k: v for k, v in GLM45.items()
                                                               if k != "n_routed_experts"}))


def test_limits(tmp_path):
    lim = plugin.limits(model=resolved(tmp_path, "glm", GLM45))
    assert lim.max_context == 131072 and (lim.has_engine or lim.reason_no_engine == "no engine for glm yet")
