"""DeepSeek plugin: detection, geometry (tiny models and real-style configs), tensor layout vs real saves."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from colibri import configs, plugins
from colibri.errors import ConfigError
from colibri.model import resolve_model
from colibri.testing.checks import check_layout_against_checkpoint, claim_of, resolved, routers_and_experts_consistent
from colibri.testing.tiny import tiny_model
from colibri_deepseek_v4 import plugin

FAMILY = "deepseek-v4"
KINDS = ("deepseek_v3", "deepseek_v32", "deepseek_v4")

# deepseek-ai/DeepSeek-V3 config.json: hub spelling (top-level rope_theta + yarn rope_scaling, n_routed_experts,
# first_k_dense_replace + moe_layer_freq, explicit scoring_func / topk_method, FP8 quantization_config).
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "bos_token_id": 0, "eos_token_id": 1,
    "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168, "intermediate_size": 18432,
    "kv_lora_rank": 512, "max_position_embeddings": 163840, "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256,
    "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 128, "num_experts_per_tok": 8,
    "num_hidden_layers": 61, "num_key_value_heads": 128, "num_nextn_predict_layers": 1, "q_lora_rank": 1536,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "topk_group": 4,
    "topk_method": "noaux_tc", "torch_dtype": "bfloat16", "v_head_dim": 128, "vocab_size": 129280,
}
DEEPSEEK_V32 = {**DEEPSEEK_V3, "model_type": "deepseek_v32", "architectures": ["DeepseekV32ForCausalLM"],
                "index_head_dim": 128, "index_n_heads": 64, "index_topk": 2048}
# A DeepSeek-V4-style config in the legacy spelling (compress_ratios per layer, num_hash_layers).
V4_RATIOS = [128, 128] + [4 if i % 2 else 128 for i in range(41)]
DEEPSEEK_V4 = {
    "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "vocab_size": 129280,
    "hidden_size": 4096, "moe_intermediate_size": 2048, "num_hidden_layers": 43, "num_attention_heads": 64,
    "num_key_value_heads": 1, "head_dim": 512, "q_lora_rank": 1024, "num_experts_per_tok": 6,
    "n_routed_experts": 256, "n_shared_experts": 1, "scoring_func": "sqrtsoftplus", "routed_scaling_factor": 1.5,
    "max_position_embeddings": 1048576, "rope_theta": 10000.0, "compress_ratios": V4_RATIOS, "num_hash_layers": 3,
    "hc_mult": 4, "sliding_window": 128, "o_groups": 8, "o_lora_rank": 1024, "index_n_heads": 64,
    "index_head_dim": 128, "index_topk": 512, "num_nextn_predict_layers": 1, "qk_rope_head_dim": 64,
}


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny-deepseek")


def test_entry_point_registers_family():
    plugins.reset()
    assert FAMILY in plugins.families() and not plugins.families()[FAMILY].error


@pytest.mark.parametrize("model_type", KINDS + ("deepseek_v2", "kimi_k2", "glm_moe_dsa", None))
def test_detect_config(tmp_path, model_type):
    claim = claim_of(plugin.FAMILY, tmp_path, {"model_type": model_type})
    assert (claim is not None) == (model_type in KINDS)
    if claim:
        assert (claim.family, claim.model_type) == (FAMILY, model_type)


@pytest.mark.parametrize("kind", KINDS)
def test_tiny_resolves_and_layout_matches_checkpoint(tiny_root, kind):
    built = tiny_model(kind, tiny_root)
    plugins.reset()
    model = resolve_model(built.path)
    assert (model.family, model.model_type) == (FAMILY, kind)
    geo = plugin.model_geometry(model=model)
    assert (geo.num_experts, geo.top_k, geo.expert_intermediate, geo.num_shared_experts) == (16, 4, 32, 1)
    layout = plugin.tensor_layout(model=model)
    routers_and_experts_consistent(layout, geo.moe_layers, geo.num_experts)
    # The checkpoint also stores routing buffers (e_score_correction_bias, tid2eid) beyond num_parameters().
    check_layout_against_checkpoint(layout, built.path, built.num_stored_elements)
    assert built.num_stored_elements > built.num_parameters


def test_tiny_v3_router_defaults_when_saved_by_transformers(tiny_root):
    model = resolved(tiny_model("deepseek_v3", tiny_root).path, FAMILY)
    assert "scoring_func" not in model.config and "topk_method" not in model.config
    geo = plugin.model_geometry(model=model)
    assert dict(geo.notes)["router"].startswith("sigmoid (noaux_tc), 4 groups, keep 2")
    assert geo.moe_layers == (1, 2) and geo.dense_layers == (0,)
    assert geo.kv_bytes_per_token == 3 * (32 + 8) * 4


def test_tiny_v3_without_q_lora(tiny_root):
    built = tiny_model("deepseek_v3", tiny_root, q_lora_rank=None, num_experts=20, first_k_dense_replace=2)
    model = resolved(built.path, FAMILY)
    layout = plugin.tensor_layout(model=model)
    assert "model.layers.0.self_attn.q_proj.weight" in layout.required
    geo = plugin.model_geometry(model=model)
    assert geo.moe_layers == (2,) and geo.num_experts == 20
    check_layout_against_checkpoint(layout, built.path, built.num_stored_elements)


def test_tiny_v4_layer_kinds(tiny_root):
    model = resolved(tiny_model("deepseek_v4", tiny_root).path, FAMILY)
    geo = plugin.model_geometry(model=model)
    # The engine's KV rows: every layer as wide as a CSA row (key, entry, raw compressor and indexer rows).
    assert geo.kv_bytes_per_token == 3 * (6 * 32 + 5 * 16) * 4
    assert geo.state_bytes_per_slot == 0
    layout = plugin.tensor_layout(model=model)
    assert "model.layers.0.ffn.gate.tid2eid" in layout.buffers       # hash-routed first layer
    assert "model.layers.1.ffn.gate.bias" in layout.buffers
    assert layout.experts[0].tensors[0].endswith("ffn.experts.0.w1.weight")
    assert layout.lm_head == "head.weight"


def test_deepseek_v3_real_config(tmp_path):
    model = resolved(tmp_path, FAMILY, DEEPSEEK_V3)
    geo = plugin.model_geometry(model=model)
    assert (geo.num_layers, geo.hidden_size, geo.num_heads) == (61, 7168, 128)
    assert (geo.num_experts, geo.top_k, geo.expert_intermediate, geo.num_shared_experts) == (256, 8, 2048, 1)
    assert geo.dense_layers == (0, 1, 2) and geo.moe_layers == tuple(range(3, 61))
    assert geo.kv_bytes_per_token == 61 * (512 + 64) * 4 and geo.max_context == 163840
    rope = configs.rope(DEEPSEEK_V3)
    assert (rope.theta, rope.rope_type, rope.scaling["factor"]) == (10000.0, "yarn", 40)
    layout = plugin.tensor_layout(model=model)
    assert layout.skipped_prefixes == ("model.layers.61.",)
    assert len(layout.experts) == 58 * 256 and len(layout.routers) == 58
    assert "model.layers.3.mlp.gate.e_score_correction_bias" in layout.buffers


def test_deepseek_v32_real_config_adds_indexer_keys(tmp_path):
    model = resolved(tmp_path, FAMILY, DEEPSEEK_V32)
    geo = plugin.model_geometry(model=model)
    assert geo.kv_bytes_per_token == 61 * (512 + 64 + 128) * 4
    layout = plugin.tensor_layout(model=model)
    assert "model.layers.0.self_attn.indexer.weights_proj.weight" in layout.required


def test_deepseek_v4_legacy_spelling_matches_modern(tmp_path):
    legacy = plugin.model_geometry(model=resolved(tmp_path, FAMILY, DEEPSEEK_V4))
    modern_cfg = {k: v for k, v in DEEPSEEK_V4.items() if k not in ("compress_ratios", "num_hash_layers")}
    types = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}
    modern_cfg["layer_types"] = [types[r] for r in V4_RATIOS]
    modern_cfg["mlp_layer_types"] = ["hash_moe"] * 3 + ["moe"] * 40
    modern = plugin.model_geometry(model=resolved(tmp_path, FAMILY, modern_cfg))
    assert legacy == modern
    assert legacy.moe_layers == tuple(range(43)) and legacy.num_kv_heads == 1 and legacy.head_dim == 512
    assert legacy.kv_bytes_per_token == 43 * (6 * 512 + 5 * 128) * 4
    layout = plugin.tensor_layout(model=resolved(tmp_path, FAMILY, DEEPSEEK_V4))
    assert sum(name.endswith("tid2eid") for name in layout.buffers) == 3


def test_bad_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="kv_lora_rank"):
        plugin.model_geometry(model=resolved(tmp_path, FAMILY, {k: v for k, v in DEEPSEEK_V3.items()
                                                                  if k != "kv_lora_rank"}))
    with pytest.raises(ConfigError, match="compress_ratios"):
        plugin.model_geometry(model=resolved(tmp_path, FAMILY, {**DEEPSEEK_V4, "compress_ratios": [7] * 43}))


def test_limits(tmp_path):
    lim = plugin.limits(model=resolved(tmp_path, FAMILY, DEEPSEEK_V3))
    assert lim.max_context == 163840
    assert lim.has_engine or lim.reason_no_engine == "no engine for deepseek-v4 yet"


def test_fp8_block_scales_are_read_from_the_checkpoint(tmp_path):
    """Which weights are FP8 is read from their weight_scale_inv companions on disk, never from names; scales are
    buffers (bytes, not parameters) and an expert's scales belong to its bytes."""
    from safetensors.numpy import save_file
    import numpy as np

    e0 = "model.layers.3.mlp.experts.0."
    on_disk = [e0 + "gate_proj.weight_scale_inv", e0 + "up_proj.weight_scale_inv", e0 + "down_proj.weight_scale_inv",
               "model.layers.0.self_attn.kv_b_proj.weight_scale_inv", "model.layers.0.mlp.down_proj.weight_scale_inv"]
    save_file({n: np.zeros(1, np.float32) for n in on_disk}, str(tmp_path / "model.safetensors"))
    layout = plugin.tensor_layout(model=resolved(tmp_path, FAMILY, DEEPSEEK_V32))
    expert = next(x for x in layout.experts if (x.layer, x.expert) == (3, 0))
    assert expert.tensors[3:] == tuple(t + "_scale_inv" for t in expert.tensors[:3])
    assert len(next(x for x in layout.experts if (x.layer, x.expert) == (3, 1)).tensors) == 3
    assert set(on_disk) <= set(layout.buffers)
    assert "model.layers.0.self_attn.o_proj.weight_scale_inv" not in layout.buffers   # not on disk
    assert not any("scale_inv" in n for n in layout.required)
    with pytest.raises(ConfigError, match="quantization_config.quant_method"):
        plugin.tensor_layout(model=resolved(tmp_path, FAMILY, {**DEEPSEEK_V32,
                                                               "quantization_config": {"quant_method": "gptq"}}))


def test_each_composition_names_its_own_engine(tmp_path):
    from colibri.records import ResolvedModel

    def source(model_type):
        config = {"model_type": model_type}
        return plugin.engine_source(model=ResolvedModel(tmp_path, "deepseek-v4", model_type, config))

    assert source("deepseek_v3") == source("deepseek_v32") == plugin.engine_source(model=None)
    assert source("deepseek_v3").name == "colibri-deepseek-mla" and source("deepseek_v4").name == "colibri-deepseek-v4"
    assert source("deepseek_v4").runtime_api == plugin.RUNTIME_API
