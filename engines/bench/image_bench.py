"""colibri-image vs diffusers' CPU pipeline on one QwenImagePipeline at the real Qwen-Image transformer width.

Builds (once, under $COLIBRI_CACHE/bench) a synthetic pipeline whose transformer has Qwen-Image's width (24 heads
x 128, joint dim 3584, 64 latent channels) with fewer blocks, a one-layer Qwen2.5-VL text encoder at its real
width, and the real VAE, in bf16 as the release ships. Then, in one run:

  1. diffusers' QwenImagePipeline on CPU (bf16 weights, as a CPU user loads the release), s/step and peak RSS;
  2. `coli run` (int8 weights per row, VAE f32), s/step and peak RSS, in RAM;
  3. `coli run` again under a cgroup v1 memory cap below the sum of the components (needs root), which only works
     because the stages run one at a time.

    python engines/bench/image_bench.py [--layers 2] [--size 256] [--steps 3]

Not a test: it never asserts speed; it prints one table (and exits 1 if the capped run fails).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from stream_bench import CappedGroup  # noqa: E402  (the cgroup v1 cap the LLM benchmark uses)

PROMPT = "a hummingbird in the rain"


def build(out: Path, layers: int) -> Path:
    from colibri_image.tiny import build_qwen_image_pipeline

    if (out / "model_index.json").is_file():
        return out
    tmp = out.with_name(out.name + ".tmp")
    build_qwen_image_pipeline(
        tmp, dtype="bfloat16", num_layers=layers, in_channels=64, out_channels=16, num_attention_heads=24,
        attention_head_dim=128, joint_attention_dim=3584, axes_dims_rope=(16, 56, 56),
        text=dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=1, num_attention_heads=28,
                  num_key_value_heads=4, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                                                          "mrope_section": [16, 24, 24]}),
        vae=dict(base_dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2,
                 temperal_downsample=[False, True, True], latents_mean=[0.0] * 16, latents_std=[1.0] * 16))
    tmp.rename(out)
    return out


DIFFUSERS_RUN = r"""
import json, resource, sys, time, torch
from diffusers import QwenImagePipeline
torch.set_grad_enabled(False)
pipe = QwenImagePipeline.from_pretrained(sys.argv[1], torch_dtype=torch.bfloat16)
size, steps = int(sys.argv[2]), int(sys.argv[3])
stamps = []
def keep(_p, _i, _t, kwargs):
    stamps.append(time.monotonic()); return kwargs
start = time.monotonic()
pipe(sys.argv[4], height=size, width=size, num_inference_steps=steps, generator=torch.Generator().manual_seed(1),
     callback_on_step_end=keep, output_type="np")
per_step = [b - a for a, b in zip([start] + stamps, stamps)][1:] or [stamps[0] - start]
print(json.dumps({"s_per_step": sum(per_step) / len(per_step), "seconds": time.monotonic() - start,
                  "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


def run_diffusers(model: Path, size: int, steps: int) -> dict:
    done = subprocess.run([sys.executable, "-c", DIFFUSERS_RUN, str(model), str(size), str(steps), PROMPT],
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_colibri(model: Path, size: int, steps: int, out: Path, group: CappedGroup | None = None) -> dict:
    argv = [sys.executable, "-c", "from colibri.cli import main; main()", "run", "--model", str(model), PROMPT,
            "--out", str(out), "--size", f"{size}x{size}", "--steps", str(steps), "--seed", "1", "--json"]
    if group is not None:
        argv = group.wrap(argv)
    started = time.monotonic()
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode:
        return {"error": (done.stderr.strip().splitlines() or ["?"])[-1]}
    stats = json.loads(done.stdout)
    stats["wall"] = time.monotonic() - started
    return stats


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    cache = Path(os.environ.get("COLIBRI_CACHE", Path.home() / ".cache" / "colibri")) / "bench"
    cache.mkdir(parents=True, exist_ok=True)
    model = build(cache / f"qwen-image-width-{args.layers}l", args.layers)
    sizes = {}
    for component in ("text_encoder", "transformer", "vae"):
        sizes[component] = sum(f.stat().st_size for f in (model / component).glob("*.safetensors"))
    total = sum(sizes.values())
    print(f"pipeline {model}: " + ", ".join(f"{k} {v / 2**30:.2f} GiB" for k, v in sizes.items()) +
          f" (sum {total / 2**30:.2f} GiB, bf16)")

    ref = run_diffusers(model, args.size, args.steps)
    ours = run_colibri(model, args.size, args.steps, cache / "bench.png")
    cap = int(0.75 * total)
    try:
        group = CappedGroup(cap)
    except (RuntimeError, OSError) as exc:
        capped = {"error": f"no cgroup v1 memory cap ({exc})"}
    else:
        try:
            capped = run_colibri(model, args.size, args.steps, cache / "bench-capped.png", group)
        finally:
            group.close()
    print(f"{args.size}x{args.size}, {args.steps} steps, transformer {args.layers} blocks at width 3072")
    print(f"{'run':34} {'s/step':>8} {'peak RSS':>10}")
    print(f"{'diffusers CPU (bf16)':34} {ref['s_per_step']:8.2f} {ref['peak_rss_bytes'] / 2**30:8.2f} GiB")
    for label, stats in (("colibri (int8, in RAM)", ours), (f"colibri (int8, cap {cap / 2**30:.2f} GiB)", capped)):
        if "error" in stats:
            print(f"{label:34} failed: {stats['error']}")
        else:
            print(f"{label:34} {stats['s_per_step'] or float('nan'):8.2f} "
                  f"{stats['peak_rss_bytes'] / 2**30:8.2f} GiB   (whole run {stats['seconds']:.1f} s)")
    return 1 if "error" in capped or "error" in ours else 0


if __name__ == "__main__":
    sys.exit(main())
