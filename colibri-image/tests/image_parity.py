"""What the Qwen-Image parity tests share: diffusers' run with every step's latents, tolerances, PSNR, the CLI."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")   # a test module importing this helper is skipped without torch and diffusers
pytest.importorskip("diffusers")


def tiny_pipeline(kind: str) -> Any:
    """A module-scoped fixture: a tiny pipeline of ``kind`` (colibri.testing.tiny) built once per test module."""

    @pytest.fixture(scope="module")
    def tiny(tmp_path_factory: Any) -> Any:
        from colibri.testing.tiny import tiny_model

        return tiny_model(kind, tmp_path_factory.mktemp(f"tiny-{kind}"))

    return tiny


@pytest.fixture(scope="module", name="engine")
def engine_fixture(tiny: Any) -> Any:
    """The image engine binary for the module's ``tiny`` pipeline (built on first use)."""
    from colibri import builder
    from colibri.model import resolve_model

    return builder.engine_for_model(resolve_model(tiny.path))


def run_reference(pipe: Any, req: Any, default_guidance: float) -> tuple[list[np.ndarray], np.ndarray]:
    """diffusers' pipeline on ``req``: every step's latents and the image as uint8."""
    latents = []

    def keep(_pipe, _i, _t, kwargs):
        latents.append(kwargs["latents"][0].numpy().copy())
        return kwargs

    out = pipe(req.prompt, negative_prompt=req.negative_prompt, height=req.height, width=req.width,
               true_cfg_scale=default_guidance if req.guidance is None else req.guidance,
               num_inference_steps=req.steps, generator=torch.Generator().manual_seed(req.seed), output_type="np",
               callback_on_step_end=keep)
    return latents, np.round(out.images[0] * 255).astype(np.uint8)


def assert_matches(trace: Any, image: np.ndarray, ref_latents: list[np.ndarray], ref_image: np.ndarray,
                   steps: int, shape: tuple[int, ...]) -> None:
    """Every step's latents within 1e-4 relative, the image within 1/255 per pixel with most pixels identical."""
    assert len(trace.latents) == len(ref_latents) == steps
    for ours, theirs in zip(trace.latents, ref_latents):
        assert np.abs(ours - theirs).max() <= 1e-4 * np.abs(theirs).max()
    assert image.shape == ref_image.shape == shape
    diff = np.abs(image.astype(int) - ref_image.astype(int))
    assert diff.max() <= 1 and (diff == 0).mean() > 0.99


def psnr(ours: np.ndarray, theirs: np.ndarray) -> float:
    mse = ((ours.astype(np.float64) - theirs.astype(np.float64)) ** 2).mean()
    return 10 * np.log10(255.0 ** 2 / mse) if mse else float("inf")


def assert_int8_psnr(path: Any, engine: Any, reference: Any, req: Any, default_guidance: float, label: str) -> None:
    """int8 weights (per row at load) against diffusers in f32: PSNR printed and above 35 dB, and really int8."""
    from colibri_image.pipeline import open_dir

    ours = open_dir(path, engine, weights="int8").generate(req)
    _, theirs = run_reference(reference, req, default_guidance)
    value = psnr(ours, theirs)
    print(f"{label} int8 PSNR vs diffusers f32 (negative prompt {req.negative_prompt!r}): {value:.1f} dB")
    assert value > 35.0
    assert not np.array_equal(ours, open_dir(path, engine).generate(req))   # int8 really ran


def coli(*args: str, cwd: Any = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", "from colibri.cli import main; main()", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=300)
