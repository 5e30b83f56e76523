"""coli convert on real transformers-saved tiny checkpoints of every MoE family (installed family plugins)."""

from __future__ import annotations

import os

import pytest

from colibri import plugins

os.environ.setdefault("HF_HUB_OFFLINE", "1")

pytestmark = pytest.mark.usefixtures("installed_families")


def _kinds():
    from colibri.testing.tiny import TEXT_KINDS

    return list(TEXT_KINDS)


@pytest.mark.parametrize("kind", _kinds())
def test_every_moe_family_converts_and_verifies(kind, tiny_root, tmp_path):
    pytest.importorskip("transformers")
    from colibri.convert.container import open_container
    from colibri.convert.run import convert
    from colibri.model import resolve_model
    from colibri.testing.tiny import tiny_model

    built = tiny_model(kind, tiny_root, seed=0)
    model = resolve_model(str(built.path))          # an installed family plugin claims it (else: a clear error)
    layout = plugins.family_hook(model.family, "tensor_layout")(model=model)
    out = tmp_path / "out"
    result = convert(model, out, experts="int8", dense="int8", verify=True)
    assert result.verified.experts == len(layout.experts) > 0
    assert result.verified.max_ratio["int8-row"] <= 1.0
    # The container is claimed by the same family, and every expert is one contiguous block.
    again = resolve_model(str(out))
    assert (again.family, again.model_type) == (model.family, model.model_type)
    container = open_container(out)
    for ex in layout.experts:
        container.extent(ex.tensors)
    for _, name in layout.routers:
        assert container.tensors[name].scheme == "f32"
    # A DSA indexer selects keys by a hard top-k, like a router selects experts: it stays f32 under every --dense.
    indexer = [name for name in container.tensors if ".indexer." in name]
    assert bool(indexer) == (kind in ("deepseek_v32", "deepseek_v4", "glm_moe_dsa"))
    assert all(container.tensors[name].scheme == "f32" for name in indexer), indexer


def test_olmoe_bf16_int4(tiny_root, tmp_path):
    pytest.importorskip("colibri_olmoe")
    from colibri.convert.run import convert
    from colibri.model import resolve_model
    from colibri.testing.tiny import tiny_model

    built = tiny_model("olmoe", tiny_root, seed=1, dtype="bfloat16", intermediate_size=64)
    result = convert(resolve_model(str(built.path)), tmp_path / "out", experts="int4", dense="int4", verify=True)
    assert result.verified.max_ratio["int4-g64"] <= 1.0


@pytest.mark.parametrize("kind", ["extractor", "diffusers"])
def test_families_without_routed_experts_are_refused(kind, tiny_root, tmp_path):
    from colibri.convert.run import convert
    from colibri.errors import FamilyError
    from colibri.model import resolve_model
    from colibri.testing.tiny import tiny_model

    built = tiny_model(kind, tiny_root, seed=0)
    model = resolve_model(str(built.path))
    with pytest.raises(FamilyError, match="has no converter"):
        convert(model, tmp_path / "out")


def test_quality_pipeline_through_the_real_engine(tiny_root):
    """coli bench quality's Python side, end to end on native checkpoints: f32 against itself is exact, and a
    bf16 copy of the same weights differs a little but agrees mostly."""
    pytest.importorskip("colibri_olmoe")
    from colibri.convert.quality import run_quality
    from colibri.model import resolve_model
    from colibri.testing.tiny import tiny_model

    f32 = resolve_model(str(tiny_model("olmoe", tiny_root, seed=3).path))
    bf16 = resolve_model(str(tiny_model("olmoe", tiny_root, seed=3, dtype="bfloat16").path))
    texts = ["The quick brown fox jumps over the lazy dog, again and again.", "Hello there; how are you today?"]
    same = run_quality(f32, f32, texts, ram_gib=1, ctx=128, threads=2)
    assert same.mean_kl == 0.0 and same.top1_agreement == 1.0 and same.positions > 20
    lossy = run_quality(bf16, f32, texts, ram_gib=1, ctx=128, threads=2)
    assert 0.0 < lossy.mean_kl < 0.05 and lossy.top1_agreement >= 0.8
    assert lossy.ppl_ratio == pytest.approx(1.0, rel=0.1)
