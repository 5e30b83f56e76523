"""QwenImagePipeline in colibri's engine against diffusers itself, on a tiny random pipeline, in float32.

Text-encoder hidden states within 1e-4, every denoising step's latents within 1e-4 relative, the decoded image
within 1/255 per pixel (most pixels identical), with and without true CFG; torch's CPU noise and the scheduler's
dynamic-shift schedule reproduced without torch.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

import image_parity   # first: the module is skipped without torch and diffusers
from image_parity import coli, torch
from colibri.errors import ConfigError, UsageError
from colibri_image.noise import torch_randn
from colibri_image.pipeline import Pipeline, Request, Trace

SIZE = 32
STEPS = 3


engine_fixture = image_parity.engine_fixture   # the "engine" fixture
tiny = image_parity.tiny_pipeline("qwen-image")


@pytest.fixture(scope="module")
def reference(tiny):
    from diffusers import QwenImagePipeline

    torch.set_grad_enabled(False)
    return QwenImagePipeline.from_pretrained(str(tiny.path), torch_dtype=torch.float32)


def run_reference(pipe, req: Request):
    return image_parity.run_reference(pipe, req, Pipeline.DEFAULT_GUIDANCE)


@pytest.mark.parametrize("seed,count", [(0, 1024), (42, 1000), (7, 16), (2**32 + 3, 64)])
def test_noise_is_torchs_cpu_generator(seed, count):
    expected = torch.randn(count, generator=torch.Generator().manual_seed(seed)).numpy()
    assert np.abs(torch_randn(seed, count) - expected).max() < 2e-6


def test_schedule_is_the_schedulers(tiny, engine, reference):
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift

    pipe = Pipeline(tiny.path, engine)
    sched, cfg = reference.scheduler, reference.scheduler.config
    for steps, seq in ((3, 16), (20, 4096), (50, 1024)):
        mu = calculate_shift(seq, cfg.base_image_seq_len, cfg.max_image_seq_len, cfg.base_shift, cfg.max_shift)
        sched.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
        assert np.array_equal(pipe.sigmas(steps, seq), sched.sigmas.numpy())


@pytest.mark.parametrize("negative", [None, "blurry, low quality"])
def test_pipeline_matches_diffusers(tiny, engine, reference, negative):
    req = Request("a hummingbird in the rain", width=SIZE, height=SIZE, steps=STEPS, seed=5,
                  negative_prompt=negative, guidance=4.0)
    trace = Trace()
    image = Pipeline(tiny.path, engine).generate(req, trace)

    embeds, _ = reference.encode_prompt(req.prompt, device="cpu")
    assert trace.prompt_embeds.shape == tuple(embeds.shape[1:])
    assert np.abs(trace.prompt_embeds - embeds[0].numpy()).max() < 1e-4
    if negative:
        neg, _ = reference.encode_prompt(negative, device="cpu")
        assert np.abs(trace.negative_embeds - neg[0].numpy()).max() < 1e-4

    ref_latents, ref_image = run_reference(reference, req)
    image_parity.assert_matches(trace, image, ref_latents, ref_image, STEPS, (SIZE, SIZE, 3))


@pytest.mark.parametrize("negative", [None, "blurry"])
def test_int8_weights_psnr_above_35_db(tiny, engine, reference, negative):
    req = Request("a hummingbird in the rain", width=64, height=64, steps=4, seed=5, negative_prompt=negative)
    image_parity.assert_int8_psnr(tiny.path, engine, reference, req, Pipeline.DEFAULT_GUIDANCE, "Qwen-Image")


def test_same_seed_same_image_across_threads(tiny, engine):
    req = Request("a red square", width=SIZE, height=SIZE, steps=2, seed=11)
    one = Pipeline(tiny.path, engine, threads=1).generate(req)
    two = Pipeline(tiny.path, engine, threads=2).generate(req)
    other = Pipeline(tiny.path, engine, threads=2).generate(Request("a red square", SIZE, SIZE, 2, seed=12))
    assert np.array_equal(one, two) and not np.array_equal(one, other)


@pytest.mark.parametrize("width,height", [(33, 32), (32, 48), (16, 16), (8192, 32)])
def test_bad_size_is_one_clear_error(tiny, engine, width, height):
    with pytest.raises(UsageError, match="must be a multiple of 32 between 32 and 4096"):
        Pipeline(tiny.path, engine).check(Request("x", width=width, height=height))


def test_unknown_class_and_missing_component(tiny, engine, tmp_path):
    copy = tmp_path / "pipe"
    shutil.copytree(tiny.path, copy)
    index = json.loads((copy / "model_index.json").read_text())
    shutil.rmtree(copy / "vae")
    with pytest.raises(ConfigError, match=r"vae: component folder missing"):
        Pipeline(copy, engine)
    index["_class_name"] = "FluxPipeline"
    (copy / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(ConfigError, match="'FluxPipeline' is not supported.*QwenImagePipeline"):
        Pipeline(copy, engine)


def test_coli_run_writes_a_png(tiny, engine, tmp_path):
    from PIL import Image

    out = tmp_path / "bird.png"
    done = coli("run", "--model", str(tiny.path), "a hummingbird in the rain", "--out", str(out), "--size", "64x32",
                "--steps", "3", "--seed", "9", "--negative-prompt", "blurry", "--guidance", "3.5", "--weights", "f32")
    assert done.returncode == 0, done.stderr
    assert "3/3" in done.stderr and "s/step" in done.stderr
    assert str(out) in done.stderr and "peak RSS" in done.stderr
    with Image.open(out) as image:
        assert image.format == "PNG" and image.size == (64, 32)
        pixels = np.asarray(image)
    req = Request("a hummingbird in the rain", width=64, height=32, steps=3, seed=9, negative_prompt="blurry",
                  guidance=3.5)
    assert np.array_equal(pixels, Pipeline(tiny.path, engine).generate(req))
    assert [p.name for p in tmp_path.iterdir()] == ["bird.png"]   # nothing left half-written
    as_json = coli("run", "--model", str(tiny.path), "x", "--out", str(out), "--size", "32x32", "--steps", "2",
                   "--json")
    stats = json.loads(as_json.stdout)
    assert set(stats["stage_peak_rss_bytes"]) == {"text", "dit", "vae"}
    assert 0 < max(stats["stage_peak_rss_bytes"].values()) <= stats["peak_rss_bytes"] < 2 ** 31


@pytest.mark.parametrize("args,message", [
    (["--size", "100x64"], "--size 100x64: the width must be a multiple of 32"),
    (["--size", "wide"], "--size 'wide': not WIDTHxHEIGHT"),
    (["--steps", "0"], "--steps 0: must be between 1 and 1000"),
])
def test_coli_run_refuses_bad_flags_in_one_line(tiny, tmp_path, args, message):
    done = coli("run", "--model", str(tiny.path), "x", "--out", str(tmp_path / "x.png"), *args)
    assert done.returncode == 1 and done.stderr.startswith(f"error: {message}") and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and not (tmp_path / "x.png").exists()


def test_coli_run_names_a_missing_component_and_an_unknown_class(tiny, tmp_path):
    copy = tmp_path / "pipe"
    shutil.copytree(tiny.path, copy)
    shutil.rmtree(copy / "transformer")
    done = coli("run", "--model", str(copy), "x", "--out", str(tmp_path / "x.png"))
    assert done.returncode == 1 and "transformer: component folder missing" in done.stderr
    index = json.loads((copy / "model_index.json").read_text())
    index["_class_name"] = "FluxPipeline"
    (copy / "model_index.json").write_text(json.dumps(index))
    done = coli("run", "--model", str(copy), "x", "--out", str(tmp_path / "x.png"))
    assert done.returncode == 1 and "'FluxPipeline' is not supported; colibri-image runs QwenImagePipeline" in \
        done.stderr


def test_plan_prints_each_stage_and_the_peak(tiny):
    done = coli("plan", "--model", str(tiny.path), "--ram", "1", "--json")
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)
    stages = dict(plan["stages"])
    assert set(stages) == {"text_encoder", "transformer", "vae"}
    assert plan["min_ram_bytes"] == max(stages.values()) and plan["fits"]
    text = coli("plan", "--model", str(tiny.path), "--ram", "1").stdout
    assert "stage transformer" in text and "peak (largest stage)" in text and "KV cache" not in text
    small = coli("plan", "--model", str(tiny.path), "--ram", "0.01")   # below the largest stage
    assert small.returncode == 1 and "cannot hold the largest stage (vae" in small.stderr


def test_doctor_understands_the_diffusers_layout(tiny, engine):
    done = coli("doctor", "--model", str(tiny.path), "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    checks = {c["name"]: c for c in json.loads(done.stdout)["checks"]}
    assert all(c["status"] == "pass" for c in checks.values()), checks
    assert checks["chat template"]["detail"] == "not needed (a text-to-image model)"
    assert "tokenizer.json" in checks["tokenizer"]["detail"]
