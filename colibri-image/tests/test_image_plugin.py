"""Image plugin: diffusers pipeline detection, per-component shard sets, layout vs a real pipeline save."""

from __future__ import annotations

import json
import os
import shutil

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from colibri import plugins
from colibri.checkpoint import TensorIndex
from colibri.errors import ConfigError
from colibri.model import resolve_model
from colibri.testing.checks import check_layout_against_checkpoint
from colibri.testing.tiny import tiny_model
from colibri_image import plugin


@pytest.fixture(scope="session")
def pipeline(tmp_path_factory):
    return tiny_model("diffusers", tmp_path_factory.mktemp("tiny-image"))


def test_entry_point_registers_family():
    plugins.reset()
    assert "image" in plugins.families() and not plugins.families()["image"].error


def test_detect(tmp_path):
    assert plugin.detect_config(model_dir=tmp_path, config=None) is None
    (tmp_path / "model_index.json").write_text('{"_class_name": "StableDiffusionPipeline"}')
    claim = plugin.detect_config(model_dir=tmp_path, config=None)
    assert (claim.family, claim.model_type) == ("image", "diffusers")
    # A language model's config.json wins even if a model_index.json lies beside it.
    assert plugin.detect_config(model_dir=tmp_path, config={"model_type": "olmoe"}) is None


def test_resolve_and_geometry(pipeline):
    plugins.reset()
    model = resolve_model(pipeline.path)
    assert (model.family, model.model_type) == ("image", "diffusers")
    geo = plugin.model_geometry(model=model)
    assert geo.architecture == "StableDiffusionPipeline"
    assert dict(geo.notes)["unet"] == "diffusers.UNet2DConditionModel"
    assert geo.num_experts == 0 and geo.kv_bytes_per_token == 0 and geo.max_context == 32
    lim = plugin.limits(model=model)
    assert not lim.has_engine and "runs QwenImagePipeline, QwenImage21Pipeline only" in lim.reason_no_engine


def test_weight_files_one_set_per_component(pipeline):
    model = resolve_model(pipeline.path)
    sets = plugin.weight_files(model=model)
    assert sorted(s.prefix for s in sets) == ["text_encoder/", "unet/", "vae/"]
    index = TensorIndex(sets)
    assert "unet/conv_in.weight" in index and "vae/encoder.conv_in.weight" in index
    layout = plugin.tensor_layout(model=model)
    check_layout_against_checkpoint(layout, sets, pipeline.num_parameters)
    assert layout.experts == () and len(layout.embeddings) == 1
    assert layout.embeddings[0].startswith("text_encoder/") and layout.embeddings[0].endswith("token_embedding.weight")


def test_variant_files_are_not_double_counted(pipeline, tmp_path):
    copy = tmp_path / "pipe"
    shutil.copytree(pipeline.path, copy)
    shutil.copy(copy / "unet" / "diffusion_pytorch_model.safetensors",
                copy / "unet" / "diffusion_pytorch_model.fp16.safetensors")
    model = resolve_model(copy)
    index = TensorIndex(plugin.weight_files(model=model))
    assert sum(t.numel for t in index) == pipeline.num_parameters


def test_broken_model_index(tmp_path):
    (tmp_path / "model_index.json").write_text("{not json")
    model = resolve_model(tmp_path)
    with pytest.raises(ConfigError, match="model_index.json: not valid JSON"):
        plugin.model_geometry(model=model)
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "X", "unet": ["diffusers", "U"]}))
    with pytest.raises(ConfigError, match="no component folder holds safetensors"):
        plugin.weight_files(model=resolve_model(tmp_path))
