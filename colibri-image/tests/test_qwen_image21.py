"""QwenImage21Pipeline in colibri's engine against diffusers itself, on a tiny random pipeline, in float32.

Text-encoder hidden states (Qwen3-VL, before its final norm, system turn dropped) within 1e-4, every denoising
step's latents within 1e-4 relative, the decoded RGBA image within 1/255 per pixel (most pixels identical), with and
without true CFG; int8 weights' PSNR; ``coli run`` writes an RGBA PNG.
"""

from __future__ import annotations

import json
import shutil
import subprocess

import numpy as np
import pytest

import image_parity   # first: the module is skipped without torch and diffusers
from image_parity import coli, torch
from colibri.errors import ConfigError
from colibri.testing.tiny import tiny_model
from colibri_image.pipeline import Pipeline, Request, Trace, open_dir
from colibri_image.pipeline21 import Pipeline21
from colibri_image.tiny import prompt_only_processor_from

SIZE = 32
STEPS = 3


engine_fixture = image_parity.engine_fixture   # the "engine" fixture
tiny = image_parity.tiny_pipeline("qwen-image-21")


def load_reference(path):
    from diffusers import QwenImage21Pipeline

    torch.set_grad_enabled(False)
    return QwenImage21Pipeline.from_pretrained(str(path), dtype=torch.float32,
                                               processor=prompt_only_processor_from(path / "processor"))


@pytest.fixture(scope="module")
def reference(tiny):
    return load_reference(tiny.path)


def run_reference(pipe, req: Request):
    return image_parity.run_reference(pipe, req, Pipeline21.DEFAULT_GUIDANCE)


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
    image_parity.assert_matches(trace, image, ref_latents, ref_image, STEPS, (SIZE, SIZE, 4))


@pytest.mark.parametrize("negative", [None, "blurry"])
def test_int8_weights_psnr_above_35_db(tiny, engine, reference, negative):
    req = Request("a hummingbird in the rain", width=64, height=64, steps=4, seed=5, negative_prompt=negative,
                  guidance=3.0 if negative else None)
    image_parity.assert_int8_psnr(tiny.path, engine, reference, req, Pipeline21.DEFAULT_GUIDANCE, "Qwen-Image-2.1")


def test_configured_sample_sigmas_set_the_schedule(tmp_path, engine):
    grid = [1.0, 0.8, 0.55, 0.3]
    tiny = tiny_model("qwen-image-21", tmp_path / "sigmas", sample_sigmas=grid)
    pipe = open_dir(tiny.path, engine)
    assert pipe.resolve(Request("x")).steps == len(grid)
    req = Request("a red fox", width=SIZE, height=SIZE, seed=2)
    trace = Trace()
    pipe.generate(req, trace)
    ref_latents, _ = run_reference(load_reference(tiny.path), Request("a red fox", SIZE, SIZE, None, seed=2))
    assert len(trace.latents) == len(ref_latents) == len(grid)
    for ours, theirs in zip(trace.latents, ref_latents):
        assert np.abs(ours - theirs).max() <= 1e-4 * np.abs(theirs).max()


def test_missing_processor_and_unknown_class(tiny, engine, tmp_path):
    copy = tmp_path / "pipe"
    shutil.copytree(tiny.path, copy)
    shutil.rmtree(copy / "processor")
    with pytest.raises(ConfigError, match=r"processor: component folder missing"):
        open_dir(copy, engine)
    index = json.loads((copy / "model_index.json").read_text())
    index["_class_name"] = "QwenImage22Pipeline"
    (copy / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(ConfigError, match="'QwenImage22Pipeline' is not supported; colibri-image runs "
                                          "QwenImagePipeline, QwenImage21Pipeline"):
        open_dir(copy, engine)


def test_coli_run_writes_an_rgba_png(tiny, engine, tmp_path):
    from PIL import Image

    out = tmp_path / "fox.png"
    done = coli("run", "--model", str(tiny.path), "a red fox", "--out", str(out), "--size", "64x32", "--steps", "3",
                "--seed", "9", "--weights", "f32")
    assert done.returncode == 0, done.stderr
    assert "3/3" in done.stderr and "s/step" in done.stderr and "peak RSS" in done.stderr
    with Image.open(out) as image:
        assert image.format == "PNG" and image.mode == "RGBA" and image.size == (64, 32)
        pixels = np.asarray(image)
    assert np.array_equal(pixels, open_dir(tiny.path, engine).generate(Request("a red fox", 64, 32, 3, seed=9)))
    assert [p.name for p in tmp_path.iterdir()] == ["fox.png"]


def test_engine_out_of_memory_is_one_clean_error(tiny, engine, monkeypatch):
    """An allocation that fails inside a stage returns to the engine's main (no exit() deep in a block): exit
    status 1 and one 'error: out of memory' line, which the pipeline reports as one EngineError line."""
    import resource
    import struct

    from colibri.errors import EngineError
    from colibri_image.pipeline import Stage

    pipe = open_dir(tiny.path, engine)

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (512 << 20, 512 << 20))

    real_popen = subprocess.Popen
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: real_popen(*a, **k, preexec_fn=cap))   # a RAM cap
    stage = Stage(pipe, "dit21", "transformer", pipe.dit_args())
    with pytest.raises(EngineError) as caught, stage:   # a 1024 x 1024 token grid does not fit in 512 MiB
        stage.send(struct.pack("<iii", 1024, 1024, 1) + struct.pack("<i", 1) + bytes(4 * 32))
        stage.recv(4)
    assert stage.proc.returncode == 1   # returned from main, not killed, not exit(3)
    message = str(caught.value)
    assert "the engine's dit21 stage (transformer/) ran out of memory: out of memory allocating " in message
    assert "\n" not in message and "Traceback" not in message


def test_doctor_and_plan_understand_the_21_layout(tiny, engine):
    done = coli("doctor", "--model", str(tiny.path), "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    checks = {c["name"]: c for c in json.loads(done.stdout)["checks"]}
    assert all(c["status"] == "pass" for c in checks.values()), checks
    assert "tokenizer.json" in checks["tokenizer"]["detail"]   # found in processor/
    plan = json.loads(coli("plan", "--model", str(tiny.path), "--ram", "1", "--json").stdout)
    assert set(dict(plan["stages"])) == {"text_encoder", "transformer", "vae"}


def test_a_patchified_vae_matches_diffusers(tmp_path, engine):
    """A VAE with patch_size 2 (conv_out's 16 channels unpatchified into RGBA) and fewer levels, still 16x."""
    tiny = tiny_model("qwen-image-21", tmp_path / "patched", vae=dict(
        dim_mult=[1, 1, 2, 2], temperal_downsample=[False, True, False], patch_size=2, in_channels=16,
        out_channels=16))
    req = Request("a red fox", width=64, height=32, steps=2, seed=4)
    trace = Trace()
    image = open_dir(tiny.path, engine).generate(req, trace)
    ref_latents, ref_image = run_reference(load_reference(tiny.path), req)
    image_parity.assert_matches(trace, image, ref_latents, ref_image, 2, (32, 64, 4))
