"""Kimi plugin: detection, geometry (tiny models and real-style configs), tensor layout vs real saves."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from colibri import plugins
from colibri.errors import ConfigError
from colibri.model import resolve_model
from colibri.testing.checks import check_layout_against_checkpoint, claim_of, resolved, routers_and_experts_consistent
from colibri.testing.tiny import tiny_model
from colibri_kimi import plugin

KINDS = ("kimi_k2", "kimi_linear")

# moonshotai/Kimi-K2-Instruct config.json: DeepSeek-V3 fields, 384 experts, yarn rope_scaling, no MTP layers.
KIMI_K2 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2", "vocab_size": 163840, "hidden_size": 7168,
    "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 64,
    "num_key_value_heads": 64, "n_shared_experts": 1, "n_routed_experts": 384, "routed_scaling_factor": 2.827,
    "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
    "topk_method": "noaux_tc", "n_group": 1, "topk_group": 1, "num_experts_per_tok": 8, "moe_layer_freq": 1,
    "first_k_dense_replace": 1, "norm_topk_prob": True, "scoring_func": "sigmoid", "max_position_embeddings": 131072,
    "rope_theta": 50000.0, "num_nextn_predict_layers": 0, "tie_word_embeddings": False,
    "rope_scaling": {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
}
# moonshotai/Kimi-Linear-48B-A3B-Instruct: linear_attn_config with 1-indexed layer lists, Kimi spellings.
KDA = [i for i in range(1, 28) if i not in (4, 8, 12, 16, 20, 24, 27)]
KIMI_LINEAR = {
    "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", "vocab_size": 163840,
    "hidden_size": 2304, "intermediate_size": 9216, "moe_intermediate_size": 1024, "num_hidden_layers": 27,
    "num_attention_heads": 32, "num_key_value_heads": 32, "kv_lora_rank": 512, "q_lora_rank": None,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "mla_use_nope": True, "num_experts": 256,
    "num_experts_per_token": 8, "num_shared_experts": 1, "moe_renormalize": True, "routed_scaling_factor": 2.446,
    "num_expert_group": 1, "topk_group": 1, "first_k_dense_replace": 1, "moe_layer_freq": 1,
    "model_max_length": 1048576,
    "linear_attn_config": {"full_attn_layers": [4, 8, 12, 16, 20, 24, 27], "kda_layers": KDA, "head_dim": 128,
                           "num_heads": 32, "short_conv_kernel_size": 4},
}


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny-kimi")


def test_entry_point_registers_family():
    plugins.reset()
    assert "kimi" in plugins.families() and not plugins.families()["kimi"].error


@pytest.mark.parametrize("model_type", KINDS + ("kimi_k25", "deepseek_v3", "kimi_vl", None))
def test_detect_config(tmp_path, model_type):
    claim = claim_of(plugin.FAMILY, tmp_path, {"model_type": model_type})
    assert (claim is not None) == (model_type in KINDS)
    if claim:
        assert (claim.family, claim.model_type) == ("kimi", model_type)


def test_plugin_is_self_contained():
    source = open(plugin.__file__, encoding="utf-8").read()
    assert "colibri_deepseek" not in source


@pytest.mark.parametrize("kind", KINDS)
def test_tiny_resolves_and_layout_matches_checkpoint(tiny_root, kind):
    built = tiny_model(kind, tiny_root)
    plugins.reset()
    model = resolve_model(built.path)
    assert (model.family, model.model_type) == ("kimi", kind)
    geo = plugin.model_geometry(model=model)
    assert (geo.num_experts, geo.top_k, geo.num_shared_experts, geo.dense_layers) == (16, 4, 1, (0,))
    layout = plugin.tensor_layout(model=model)
    routers_and_experts_consistent(layout, geo.moe_layers, geo.num_experts)
    check_layout_against_checkpoint(layout, built.path, built.num_stored_elements)


def test_tiny_kimi_linear_hybrid_geometry(tiny_root):
    model = resolved(tiny_model("kimi_linear", tiny_root).path, "kimi")
    geo = plugin.model_geometry(model=model)
    assert geo.kv_bytes_per_token == 1 * (32 + 8) * 4                 # layer 3 is the only MLA layer
    # 3 KDA layers, x 2 for the engine's end-of-prompt checkpoint of the state
    assert geo.state_bytes_per_slot == 2 * 3 * (3 * 64 * 3 * 4 + 4 * 16 * 16 * 4)
    layout = plugin.tensor_layout(model=model)
    assert layout.experts[0].tensors[1].endswith("block_sparse_moe.experts.0.w3.weight")


def test_kimi_k2_real_config(tmp_path):
    model = resolved(tmp_path, "kimi", KIMI_K2)
    geo = plugin.model_geometry(model=model)
    assert (geo.num_layers, geo.num_experts, geo.top_k, geo.num_heads) == (61, 384, 8, 64)
    assert geo.dense_layers == (0,) and geo.kv_bytes_per_token == 61 * (512 + 64) * 4
    assert "theta 50000 (yarn)" in dict(geo.notes)["rope"]
    layout = plugin.tensor_layout(model=model)
    assert layout.skipped_prefixes == () and len(layout.experts) == 60 * 384


def test_kimi_linear_real_config(tmp_path):
    model = resolved(tmp_path, "kimi", KIMI_LINEAR)
    geo = plugin.model_geometry(model=model)
    assert (geo.num_experts, geo.top_k, geo.max_context) == (256, 8, 1048576)
    assert geo.kv_bytes_per_token == 7 * (512 + 64) * 4
    assert geo.state_bytes_per_slot == 2 * 20 * (3 * 32 * 128 * 3 * 4 + 32 * 128 * 128 * 4)
    layout = plugin.tensor_layout(model=model)
    assert "model.layers.3.self_attn.kv_b_proj.weight" in layout.required      # 1-indexed layer 4 is MLA
    assert "model.layers.0.self_attn.f_a_proj.weight" in layout.required
    assert "model.layers.0.block_sparse_moe.gate_proj.weight" in layout.required


def test_kimi_linear_bad_layer_lists(tmp_path):
    bad = {**KIMI_LINEAR, "linear_attn_config": {**KIMI_LINEAR["linear_attn_config"], "kda_layers": KDA[:-1]}}
    with pytest.raises(ConfigError, match="unassigned"):
        plugin.model_geometry(model=resolved(tmp_path, "kimi", bad))
    bad = {**KIMI_LINEAR, "linear_attn_config": {**KIMI_LINEAR["linear_attn_config"], "kda_layers": KDA + [28]}}
    with pytest.raises(ConfigError, match="kda_layers names layer 28 of 27"):
        plugin.model_geometry(model=resolved(tmp_path, "kimi", bad))


def test_limits(tmp_path):
    lim = plugin.limits(model=resolved(tmp_path, "kimi", KIMI_LINEAR))
    assert lim.max_context == 1048576
    assert lim.has_engine and "int4-g64" in lim.quant_schemes


def test_kimi_k2_fp8_scales(tmp_path):
    """FP8 scales come from the checkpoint (weight_scale_inv companions), as buffers; an expert's belong to it."""
    from safetensors.numpy import save_file
    import numpy as np

    fp8 = {**KIMI_K2, "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}}
    e = "model.layers.1.mlp.experts.0."
    on_disk = [e + f"{m}_proj.weight_scale_inv" for m in ("gate", "up", "down")]
    on_disk.append("model.layers.0.self_attn.q_a_proj.weight_scale_inv")
    save_file({n: np.zeros(1, np.float32) for n in on_disk}, str(tmp_path / "model.safetensors"))
    layout = plugin.tensor_layout(model=resolved(tmp_path, "kimi", fp8))
    assert len(next(x for x in layout.experts if (x.layer, x.expert) == (1, 0)).tensors) == 6
    assert "model.layers.0.self_attn.q_a_proj.weight_scale_inv" in layout.buffers
    assert not any("scale_inv" in n for n in layout.required)


def test_each_composition_names_its_own_engine(tmp_path):
    from colibri.records import ResolvedModel

    def source(model_type):
        return plugin.engine_source(model=ResolvedModel(tmp_path, "kimi", model_type, {"model_type": model_type}))

    assert source("kimi_k2").name == "colibri-kimi" == plugin.engine_source(model=None).name
    assert source("kimi_linear").name == "colibri-kimi-linear"
    assert source("kimi_k2").runtime_api == source("kimi_linear").runtime_api == plugin.RUNTIME_API
