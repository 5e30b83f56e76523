"""QwenImage21Pipeline as diffusers runs it (text-to-image), on the stages machinery of pipeline.py.

What differs from Qwen-Image 1.0, all from diffusers' pipeline_qwenimage21.py and its models:
- the text encoder is Qwen3-VL (q/k norms, no q/k/v bias) and the pipeline reads the last layer's output *before*
  the final norm; its template's system turn is dropped (as many tokens as the system turn alone tokenizes to);
  an empty prompt becomes " "; nothing is truncated; the tokenizer lives in ``processor/``;
- the transformer reads unpatched latents (one token per latent pixel, 64 channels) and is single-stream and
  block-causal (engine stage ``dit21``); true CFG is plain ``neg + s * (cond - neg)``, without the norm rescale;
- the schedule's base sigmas are the pipeline's ``sample_sigmas`` (model_index.json) when configured, and the
  defaults are 40 steps and no guidance (true_cfg_scale 1);
- latents are un-normalised as ``x * std + mean``; the VAE (``vae21``) writes RGBA (4 channels).
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np

from colibri.errors import ConfigError

from .noise import torch_randn
from .pipeline import Pipeline, Request, Stage

SYSTEM_PROMPT = "Comprehend and analyze the provided prompt."
SYSTEM_TURN = f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n"
PROMPT_TEMPLATE = SYSTEM_TURN + "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
VAE_SCALE = 16                   # QwenImage21Pipeline.vae_scale_factor


class Pipeline21(Pipeline):
    CLASS = "QwenImage21Pipeline"
    COMPONENTS = ("text_encoder", "processor", "transformer", "vae", "scheduler")
    DEFAULT_STEPS = 40
    DEFAULT_GUIDANCE = 1.0
    DIT_STAGE = "dit21"

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.vae_scale = VAE_SCALE
        t = self.text_cfg.get("text_config", self.text_cfg)
        self.TEXT_STAGE_ARGS = (f"bias={int(bool(t.get('attention_bias', False)))}", "qk_norm=1", "final_norm=0")
        sample = self.index.get("sample_sigmas")
        if sample is not None and (not isinstance(sample, list) or not sample
                                   or not all(isinstance(x, (int, float)) for x in sample)):
            raise ConfigError(f"{self.dir / 'model_index.json'}: sample_sigmas must be a list of numbers",
                              "restore model_index.json from the pipeline")
        self.sample_sigmas = None if sample is None else np.asarray(sample, np.float64).astype(np.float32)
        if self.sample_sigmas is not None:
            self.DEFAULT_STEPS = len(self.sample_sigmas)

    def base_sigmas(self, steps: int) -> np.ndarray:
        # the configured grid sets the step count; asking for another count falls back to diffusers' default grid
        if self.sample_sigmas is not None and steps == len(self.sample_sigmas):
            return self.sample_sigmas
        return super().base_sigmas(steps)

    # ------------------------------------------------------------------------------------------- stage args

    def dit_args(self) -> list[str]:
        c = self.dit_cfg
        if int(c.get("patch_size", 1)) != 1:
            raise ConfigError(f"{self.dir / 'transformer' / 'config.json'}: patch_size {c['patch_size']} is not "
                              "supported", "QwenImage21Transformer2DModel reads unpatched latents (patch_size 1)")
        axes = list(c.get("axes_dims_rope", (16, 56, 56)))
        return [f"layers={c.get('num_layers', 32)}", f"heads={c.get('num_attention_heads', 32)}",
                f"head_dim={c.get('attention_head_dim', 128)}", f"in_channels={c.get('in_channels', 64)}",
                f"out_channels={self.pred_width()}", f"joint_dim={c.get('context_in_dim', 4096)}",
                f"mlp_ratio={c.get('mlp_ratio', 3)}", f"eps={c.get('eps', 1e-6)}",
                f"causal_condition={int(bool(c.get('causal_condition', True)))}",
                f"axes0={axes[0]}", f"axes1={axes[1]}", f"axes2={axes[2]}"]

    def vae_args(self) -> list[str]:
        c = self.vae_cfg
        if not c.get("is_residual", True):
            raise ConfigError(f"{self.dir / 'vae' / 'config.json'}: is_residual false is not supported",
                              "use Qwen-Image-2.1's VAE")
        mult = list(c.get("dim_mult", [1, 2, 4, 8, 8]))
        up = list(c.get("temperal_downsample", [False, True, True, True]))[::-1]
        base = c.get("decoder_base_dim") or c.get("base_dim", 96)
        return [f"base_dim={base}", f"z_dim={c.get('z_dim', 64)}", f"num_res_blocks={c.get('num_res_blocks', 2)}",
                f"levels={len(mult)}", f"out_channels={c.get('out_channels', 4)}",
                f"patch={c.get('patch_size') or 1}", *[f"mult{i}={m}" for i, m in enumerate(mult)],
                *[f"tup{i}={int(bool(u))}" for i, u in enumerate(up)]]

    def pred_width(self) -> int:
        return int(self.dit_cfg.get("out_channels") or self.dit_cfg.get("in_channels", 64))

    # ------------------------------------------------------------------------------------------- stages

    def encode(self, prompts: list[str]) -> list[np.ndarray]:
        from colibri.tokenizer import load_tokenizer_dir

        tok = load_tokenizer_dir(self.dir / "processor", None)
        drop = len(tok.encode(SYSTEM_TURN, add_special_tokens=False))
        out = []
        with Stage(self, "text", "text_encoder", self.text_args()) as stage:
            for prompt in prompts:
                ids = tok.encode(PROMPT_TEMPLATE.format(prompt or " "), add_special_tokens=False)
                stage.send(struct.pack("<i", len(ids)) + np.asarray(ids, dtype="<i4").tobytes())
                n, dim = struct.unpack("<ii", stage.recv(8))
                hidden = np.frombuffer(stage.recv(4 * n * dim), dtype="<f4").reshape(n, dim)
                out.append(hidden[drop:].copy())
        return out

    def initial_latents(self, req: Request) -> tuple[np.ndarray, int, int]:
        channels = int(self.dit_cfg.get("in_channels", 64))
        lh, lw = 2 * (req.height // (VAE_SCALE * 2)), 2 * (req.width // (VAE_SCALE * 2))
        noise = torch_randn(req.seed, channels * lh * lw).reshape(channels, lh * lw)
        return np.ascontiguousarray(noise.T), lh, lw

    def dit_grid(self, lh: int, lw: int) -> tuple[int, int]:
        return lh, lw

    def guide(self, pred: np.ndarray, neg: np.ndarray, guidance: float) -> np.ndarray:
        return neg + np.float32(guidance) * (pred - neg)

    def decode(self, latents: np.ndarray, lh: int, lw: int) -> np.ndarray:
        z = int(self.vae_cfg.get("z_dim", 64))
        x = latents.T.reshape(z, lh, lw)
        mean = np.asarray(self.vae_cfg["latents_mean"], np.float32).reshape(z, 1, 1)
        std = np.asarray(self.vae_cfg["latents_std"], np.float32).reshape(z, 1, 1)
        x = (x * std + mean).astype(np.float32)
        with Stage(self, "vae21", "vae", self.vae_args()) as stage:
            stage.send(struct.pack("<ii", lh, lw) + np.ascontiguousarray(x, "<f4").tobytes())
            h, w, c = struct.unpack("<iii", stage.recv(12))
            img = np.frombuffer(stage.recv(4 * c * h * w), dtype="<f4").reshape(c, h, w)
        pixels = np.clip(img * np.float32(0.5) + np.float32(0.5), 0, 1)
        return np.round(pixels.transpose(1, 2, 0) * np.float32(255)).astype(np.uint8)
