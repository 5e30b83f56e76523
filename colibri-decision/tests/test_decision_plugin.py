"""Decision plugin: GLiNER2-style extractor detection, encoder geometry and tensor layout vs real saves."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from colibri import plugins
from colibri.errors import ConfigError
from colibri.model import resolve_model
from colibri.testing.checks import check_layout_against_checkpoint, claim_of, resolved
from colibri.testing.tiny import tiny_model
from colibri_decision import plugin

# fastino/gliner2-base-v1 style: a deberta-v3-base encoder described in encoder_config.
GLINER2_BASE = {
    "model_type": "extractor", "model_name": "microsoft/deberta-v3-base", "max_width": 8,
    "counting_layer": "count_lstm_v2", "token_pooling": "first",
    "encoder_config": {"model_type": "deberta-v2", "hidden_size": 768, "num_hidden_layers": 12,
                       "num_attention_heads": 12, "intermediate_size": 3072, "vocab_size": 128100,
                       "max_position_embeddings": 512, "relative_attention": True, "position_buckets": 256,
                       "norm_rel_ebd": "layer_norm", "position_biased_input": False, "type_vocab_size": 0},
}


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny-decision")


def test_entry_point_registers_family():
    plugins.reset()
    assert "decision" in plugins.families() and not plugins.families()["decision"].error


@pytest.mark.parametrize("model_type", ("extractor", "bert", "deberta-v2", "olmoe", None))
def test_detect_config(tmp_path, model_type):
    claim = claim_of(plugin.FAMILY, tmp_path, {"model_type": model_type})
    assert (claim is not None) == (model_type == "extractor")


@pytest.mark.parametrize("encoder", ("bert", "deberta-v2"))
def test_tiny_layout_matches_checkpoint(tiny_root, encoder):
    built = tiny_model("extractor", tiny_root, encoder=encoder)
    plugins.reset()
    model = resolve_model(built.path)
    assert (model.family, model.model_type) == ("decision", "extractor")
    geo = plugin.model_geometry(model=model)
    assert (geo.num_layers, geo.hidden_size, geo.vocab_size, geo.max_context) == (2, 32, 512, 128)
    assert geo.num_experts == 0 and geo.kv_bytes_per_token == 0
    layout = plugin.tensor_layout(model=model)
    check_layout_against_checkpoint(layout, built.path, built.num_parameters)
    assert layout.embeddings == ("encoder.embeddings.word_embeddings.weight",)
    assert any(name.startswith("span_rep.") for name in layout.required)


def test_real_style_config_geometry(tmp_path):
    geo = plugin.model_geometry(model=resolved(tmp_path, "decision", GLINER2_BASE))
    assert (geo.num_layers, geo.hidden_size, geo.num_heads, geo.vocab_size) == (12, 768, 12, 128100)
    assert geo.architecture == "GLiNER2-style extractor (deberta-v2 encoder)"
    assert dict(geo.notes)["max span width"] == "8"
    _, norms, other = plugin.encoder_tensors(GLINER2_BASE["encoder_config"], "deberta-v2", "config.json")
    assert "encoder.rel_embeddings.weight" in other and "embeddings.position_embeddings.weight" not in other
    assert "encoder.LayerNorm.weight" in norms


def test_missing_or_unknown_encoder(tmp_path):
    with pytest.raises(ConfigError, match="encoder_config"):
        plugin.model_geometry(model=resolved(tmp_path, "decision", {"model_type": "extractor"}))
    odd = {**GLINER2_BASE, "encoder_config": {**GLINER2_BASE["encoder_config"], "model_type": "t5"}}
    with pytest.raises(ConfigError, match="'t5' is not supported"):
        plugin.limits(model=resolved(tmp_path, "decision", odd))


def test_limits(tmp_path):
    lim = plugin.limits(model=resolved(tmp_path, "decision", GLINER2_BASE))
    assert lim.max_context == 512 and (lim.has_engine or lim.reason_no_engine == "no engine for decision yet")


def test_laya_is_claimed_by_its_marker_file(tiny_root):
    pytest.importorskip("laya.common")
    built = tiny_model("laya", tiny_root)
    plugins.reset()
    model = resolve_model(built.path)   # no config.json at its root: rl_agent_config.json is the marker
    assert (model.family, model.model_type) == ("decision", "laya")
    geo = plugin.model_geometry(model=model)
    assert (geo.num_layers, geo.hidden_size, geo.vocab_size, geo.max_context) == (2, 64, 512, 128)
    assert geo.architecture.startswith("Laya (modernbert")
    layout = plugin.tensor_layout(model=model)
    check_layout_against_checkpoint(layout, built.path, built.num_parameters)
    assert layout.embeddings == ("encoder.embeddings.tok_embeddings.weight",)
    assert any(name.startswith("scorer.") for name in layout.required)
    limits = plugin.limits(model=model)
    assert limits.has_engine and limits.max_context == 128   # the checkpoint's max_len bounds a sequence


def test_laya_without_its_encoder_config_is_one_clear_error(tmp_path):
    (tmp_path / plugin.LAYA_MARKER).write_text('{"encoder": "answerdotai/ModernBERT-base", "head_layers": 1}')
    claim = plugin.detect_config(model_dir=tmp_path, config=None)
    assert claim is not None and claim.model_type == "laya"
    with pytest.raises(ConfigError, match="encoder/config.json: missing"):
        plugin.model_geometry(model=resolved(tmp_path, "decision", {}, model_type="laya"))
    assert plugin.detect_config(model_dir=tmp_path / "nowhere", config=None) is None



def test_laya_option_layout_other_than_sequential_is_refused(tiny_root, tmp_path):
    import json
    import shutil

    from colibri_decision import laya

    pytest.importorskip("laya.common")
    copy = tmp_path / "parallel"
    shutil.copytree(tiny_model("laya", tiny_root).path, copy)
    agent = json.loads((copy / plugin.LAYA_MARKER).read_text())
    (copy / plugin.LAYA_MARKER).write_text(json.dumps({**agent, "option_layout": "parallel"}))
    with pytest.raises(ConfigError, match="option_layout 'parallel' is not supported"):
        laya.agent_config(copy)
