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


@pytest.mark.parametrize("fields, fragment", [
    ({"num_hidden_layers": 1e9}, "'num_hidden_layers' is 1000000000.0, expected an integer from 0 to 16384"),
    ({"num_experts": -1}, "'num_experts' is -1"),
    ({"vocab_size": "512"}, "'vocab_size' is '512'"),
    ({"hidden_size": 64.5}, "'hidden_size' is 64.5"),
    ({"num_experts": 16, "num_experts_per_tok": 20}, "'num_experts_per_tok' is 20 but 'num_experts' is 16"),
    ({"num_attention_heads": 6, "num_key_value_heads": 4}, "'num_attention_heads' (6) is not a multiple"),
    ({"n_routed_experts": 16, "n_group": 3}, "'n_group' (3) does not divide the 16 experts"),
    ({"n_group": 4, "topk_group": 5}, "'topk_group' is 5 but there are 4 expert groups"),
    ({"rms_norm_eps": "x"}, "'rms_norm_eps' is 'x', expected a number in (0, 1]"),
    ({"rms_norm_eps": None}, "'rms_norm_eps' is null"),
    ({"rope_theta": -1}, "'rope_theta' is -1"),
    ({"rope_parameters": {"rope_theta": "big"}}, "rope_parameters: 'rope_theta' is 'big'"),
    ({"tie_word_embeddings": "no"}, "'tie_word_embeddings' is 'no', expected true or false"),
    ({"text_config": {"num_hidden_layers": 10**6}}, "text_config.'num_hidden_layers' is 1000000"),
])
def test_check_config_names_file_and_field(fields, fragment):
    with pytest.raises(ConfigError) as err:
        configs.check_config({"model_type": "x", **fields}, where="m/config.json")
    assert err.value.message.startswith("m/config.json: ")
    assert fragment in err.value.message, err.value.message


def test_check_config_accepts_real_spellings():
    configs.check_config({"num_hidden_layers": 61, "n_routed_experts": 256, "num_experts_per_tok": 8, "n_group": 8,
                          "topk_group": 4, "num_attention_heads": 128, "num_key_value_heads": 128,
                          "rms_norm_eps": 1e-6, "rope_theta": 10000, "q_lora_rank": None, "clip_qkv": None,
                          "max_position_embeddings": 163840, "tie_word_embeddings": False,
                          "rope_scaling": {"type": "yarn", "factor": 40}})


def test_require_int_bounds_by_field_and_rope_refuses_strings():
    with pytest.raises(ConfigError, match="from 1 to 16384"):
        configs.require_int({"num_hidden_layers": 100_000}, "num_hidden_layers", minimum=1)
    assert configs.require_int({"num_hidden_layers": 61}, "num_hidden_layers") == 61
    with pytest.raises(ConfigError, match="'rope_theta' is 'x'"):
        configs.rope({"rope_theta": "x"})
    assert configs.require_number({"rms_norm_eps": 1e-6}, "rms_norm_eps", 1e-5) == 1e-6
    with pytest.raises(ConfigError, match="'mlp_only_layers'"):
        configs.moe_layer_indices({"num_experts": 4, "mlp_only_layers": ["a"]}, 4)
