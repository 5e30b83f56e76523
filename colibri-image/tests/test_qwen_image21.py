"""QwenImage21Pipeline in colibri's engine against diffusers itself, on a tiny random pipeline, in float32.

Text-encoder hidden states (Qwen3-VL, before its final norm, system turn dropped) within 1e-4, every denoising
step's latents within 1e-4 relative, the decoded RGBA image within 1/255 per pixel (most pixels identical), with and
without true CFG; int8 weights' PSNR; ``coli run`` writes an RGBA PNG.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")

from colibri import builder  # noqa: E402
from colibri.errors import ConfigError  # noqa: E402
from colibri.model import resolve_model  # noqa: E402
from colibri.testing.tiny import tiny_model  # noqa: E402
from colibri_image.pipeline import Pipeline, Request, Trace, open_dir  # noqa: E402
from colibri_image.pipeline21 import Pipeline21  # noqa: E402
from colibri_image.tiny import prompt_only_processor_from  # noqa: E402

SIZE = 32
STEPS = 3


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_model("qwen-image-21", tmp_path_factory.mktemp("tiny-qwen-image21"))


@pytest.fixture(scope="module")
def engine(tiny):
    return builder.engine_for_model(resolve_model(tiny.path))


def load_reference(path):
    from diffusers import QwenImage21Pipeline

    torch.set_grad_enabled(False)
    return QwenImage21Pipeline.from_pretrained(str(path), dtype=torch.float32,
                                               processor=prompt_only_processor_from(path / "processor"))


@pytest.fixture(scope="module")
def reference(tiny):
    return load_reference(tiny.path)


def run_reference(pipe, req: Request):
    latents = []

    def keep(_pipe, _i, _t, kwargs):
        latents.append(kwargs["latents"][0].numpy().copy())
        return kwargs

    out = pipe(req.prompt, negative_prompt=req.negative_prompt, true_cfg_scale=req.guidance or 1.0,
               height=req.height, width=req.width, num_inference_steps=req.steps,
               generator=torch.Generator().manual_seed(req.seed), output_type="np", callback_on_step_end=keep)
    return latents, np.round(out.images[0] * 255).astype(np.uint8)


def test_open_dir_picks_the_class(tiny, engine):
    assert isinstance(open_dir(tiny.path, engine), Pipeline21)
    with pytest.raises(ConfigError, match="a QwenImage21Pipeline, not a QwenImagePipeline"):
        Pipeline(tiny.path, engine)


def test_dropped_tokens_are_the_pipelines(tiny, engine, reference):
    from colibri.tokenizer import load_tokenizer_dir
    from colibri_image.pipeline21 import SYSTEM_TURN

    tok = load_tokenizer_dir(tiny.path / "processor", None)
    assert len(tok.encode(SYSTEM_TURN, add_special_tokens=False)) == reference._drop_idx


@pytest.mark.parametrize("prompt,negative,guidance", [("a hummingbird in the rain", None, None),
                                                      ("a red fox", "blurry, low quality", 4.0),
                                                      ("", None, None)])
def test_pipeline_matches_diffusers(tiny, engine, reference, prompt, negative, guidance):
    req = Request(prompt, width=SIZE, height=SIZE, steps=STEPS, seed=5, negative_prompt=negative,
                  guidance=guidance)
    trace = Trace()
    image = open_dir(tiny.path, engine).generate(req, trace)

    embeds, _, _ = reference.encode_prompt(req.prompt, device="cpu")
    assert trace.prompt_embeds.shape == tuple(embeds.shape[1:])
    assert np.abs(trace.prompt_embeds - embeds[0].numpy()).max() < 1e-4
    if negative:
        neg, _, _ = reference.encode_prompt(negative, device="cpu")
        assert np.abs(trace.negative_embeds - neg[0].numpy()).max() < 1e-4

    ref_latents, ref_image = run_reference(reference, req)
    assert len(trace.latents) == len(ref_latents) == STEPS
    for ours, theirs in zip(trace.latents, ref_latents):
        assert np.abs(ours - theirs).max() <= 1e-4 * np.abs(theirs).max()
    assert image.shape == ref_image.shape == (SIZE, SIZE, 4)
    diff = np.abs(image.astype(int) - ref_image.astype(int))
    assert diff.max() <= 1 and (diff == 0).mean() > 0.99
