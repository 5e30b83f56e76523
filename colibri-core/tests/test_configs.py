"""colibri.configs: every config.json spelling real checkpoints use reads the same."""

from __future__ import annotations

import pytest

from colibri import configs
from colibri.errors import ConfigError


def test_first_of_skips_missing_and_null():
    cfg = {"a": None, "b": 0, "c": 3}
    assert configs.first_of(cfg, "a", "b", "c") == 0
    assert configs.first_of(cfg, "x", default=7) == 7


def test_require_int_names_every_spelling():
    with pytest.raises(ConfigError, match="'num_experts' / 'n_routed_experts'"):
        configs.require_int({}, "num_experts", "n_routed_experts", where="m/config.json")
    with pytest.raises(ConfigError, match="'hidden_size' is 'big'"):
        configs.require_int({"hidden_size": "big"}, "hidden_size")
    with pytest.raises(ConfigError, match="expected an integer from 1 to 1048576"):
        configs.require_int({"hidden_size": 0}, "hidden_size", minimum=1)
    assert configs.require_int({"hidden_size": 64.0}, "hidden_size") == 64
    with pytest.raises(ConfigError):
        configs.require_int({"flag": True}, "flag")


@pytest.mark.parametrize("cfg", [
    {"rope_theta": 1e6, "partial_rotary_factor": 0.5},                                      # hub spelling
    {"rope_parameters": {"rope_theta": 1e6, "partial_rotary_factor": 0.5, "rope_type": "default"}},  # transformers 5
    {"rope_theta": 5.0, "rope_parameters": {"rope_theta": 1e6, "partial_rotary_factor": 0.5}},  # parameters win
])
def test_rope_spellings_agree(cfg):
    rope = configs.rope(cfg)
    assert (rope.theta, rope.partial_rotary_factor, rope.rope_type) == (1e6, 0.5, "default")


def test_rope_scaling_and_sections():
    rope = configs.rope({"rope_theta": 10000, "rope_scaling": {"type": "yarn", "factor": 40}})
    assert rope.rope_type == "yarn" and rope.scaling == {"factor": 40}
    nested = {"rope_parameters": {"main": {"rope_theta": 1e4}, "compress": {"rope_theta": 1.6e5}}}
    assert configs.rope(nested, section="compress").theta == 1.6e5
    assert configs.rope({}).theta == 10000.0


def test_text_config_and_context():
    wrapper = {"model_type": "x", "text_config": {"max_position_embeddings": 4096}}
    assert configs.max_context(configs.text_config(wrapper)) == 4096
    assert configs.max_context({"model_max_length": 1048576}) == 1048576
    assert configs.num_experts({"n_routed_experts": 256}) == 256 == configs.num_experts({"num_local_experts": 256})


@pytest.mark.parametrize("cfg,expected", [
    ({"num_experts": 8}, (0, 1, 2, 3)),
    ({"num_experts": 8, "first_k_dense_replace": 1}, (1, 2, 3)),
    ({"num_experts": 8, "first_k_dense_replace": 1, "moe_layer_freq": 2}, (1, 3)),
    ({"num_experts": 8, "mlp_only_layers": [0, 2]}, (1, 3)),
    ({"num_experts": 8, "decoder_sparse_step": 2}, (1, 3)),
    ({"mlp_layer_types": ["dense", "sparse", "moe", "hash_moe"]}, (1, 2, 3)),
    ({}, ()),
])
def test_moe_layer_spellings(cfg, expected):
    assert configs.moe_layer_indices(cfg, 4) == expected


def test_moe_layer_types_validated():
    with pytest.raises(ConfigError, match="3 entries for 4 layers"):
        configs.moe_layer_indices({"mlp_layer_types": ["dense"] * 3}, 4)
    with pytest.raises(ConfigError, match="'mlp_layer_types'\\[1\\] is 'odd'"):
        configs.moe_layer_indices({"mlp_layer_types": ["dense", "odd"]}, 2)


def test_attention_layer_types():
    assert configs.attention_layer_types({"full_attention_interval": 4}, 8) == (
        "linear_attention",) * 3 + ("full_attention",) + ("linear_attention",) * 3 + ("full_attention",)
    explicit = {"layer_types": ["linear_attention", "full_attention"]}
    assert configs.attention_layer_types(explicit, 2) == ("linear_attention", "full_attention")
    assert configs.attention_layer_types({}, 2) == ("full_attention",) * 2
    with pytest.raises(ConfigError, match="1 entries for 2 layers"):
        configs.attention_layer_types({"layer_types": ["full_attention"]}, 2)


def test_layer_range_prefixes():
    assert configs.layer_range_prefixes("model.layers.", 61, 1) == ("model.layers.61.",)
    assert configs.layer_range_prefixes("model.layers.", 61, 0) == ()
