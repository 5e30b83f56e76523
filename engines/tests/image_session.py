"""Drive the colibri-image engine binary through every stage of tiny QwenImagePipeline and QwenImage21Pipeline,
f32 and int8.

Used by ``make -C engines test-image`` and ``sanitize-image`` (the same stages under ASan/UBSan, which abort the
stage on the first error). The pipeline is built here with diffusers and transformers (nothing is committed); the
image must be the one the regular build gives (colibri-image's tests check that one against diffusers).

    python3 image_session.py ENGINE_BINARY
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from session_env import use_packages

use_packages("colibri-image")

import numpy as np  # noqa: E402

from colibri_image.pipeline import Request, Trace, open_dir  # noqa: E402
from colibri_image.tiny import build_qwen_image21_pipeline, build_qwen_image_pipeline  # noqa: E402


def main(binary: str) -> int:
    failures = 0
    with tempfile.TemporaryDirectory(prefix="colibri-image-session-") as tmp:
        for build, channels in ((build_qwen_image_pipeline, 3), (build_qwen_image21_pipeline, 4)):
            tiny = build(Path(tmp) / build.__name__)
            for weights in ("f32", "int8"):
                req = Request("a hummingbird in the rain", width=64, height=32, steps=2, seed=3,
                              negative_prompt="blurry", guidance=4.0)
                trace = Trace()
                image = open_dir(tiny.path, Path(binary), threads=2, weights=weights).generate(req, trace)
                ok = image.shape == (32, 64, channels) and all(np.isfinite(lat).all() for lat in trace.latents)
                again = open_dir(tiny.path, Path(binary), threads=1, weights=weights).generate(req)
                ok = ok and np.array_equal(image, again)
                print(f"{'ok' if ok else 'FAIL'}: {tiny.kind} {weights} stages (text, dit with CFG, vae), "
                      "1 and 2 threads agree")
                failures += not ok
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
