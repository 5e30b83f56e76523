"""QwenImagePipeline as diffusers runs it, with the three networks in colibri's C engine, one stage at a time
(QwenImage21Pipeline is pipeline21.py, on the same stages machinery; :func:`open_dir` picks the class).

The arithmetic between the networks (prompt template, dropped prefix tokens, the flow-matching schedule with its
dynamic shift and terminal stretch, true classifier-free guidance with the per-token rescale, packing, the VAE's
latent un-normalisation, the final 8-bit rounding) is here, in float32 exactly as diffusers orders it. Each stage
is its own engine process (``colibri-qwen-image text|dit|vae``): it loads one component's weights, answers, and
exits before the next stage starts, so peak RAM is the largest component plus activations.
"""

from __future__ import annotations

import copy
import dataclasses
import struct
import subprocess
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from colibri.errors import ConfigError, EngineError, UsageError

from .noise import torch_randn

SUPPORTED = ("QwenImagePipeline", "QwenImage21Pipeline")
COMPONENTS = ("text_encoder", "tokenizer", "transformer", "vae", "scheduler")
PROMPT_TEMPLATE = ("<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, "
                   "text, spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}"
                   "<|im_end|>\n<|im_start|>assistant\n")
TEMPLATE_DROP = 34               # QwenImagePipeline.prompt_template_encode_start_idx
TOKENIZER_MAX = 1024             # QwenImagePipeline.tokenizer_max_length
MAX_SEQUENCE = 512               # __call__'s max_sequence_length default
MIN_SIDE, MAX_SIDE, SIZE_STEP = 32, 4096, 32
WEIGHTS = ("int8", "f32")        # int8: the text encoder's and the transformer's matrices per row at load


@dataclass(frozen=True)
class Request:
    prompt: str
    width: int = 1024
    height: int = 1024
    steps: int | None = None     # None: the pipeline's default (Pipeline.resolve)
    seed: int = 0
    negative_prompt: str | None = None
    guidance: float | None = None   # true_cfg_scale (applies only with a negative prompt, as in diffusers)


@dataclass
class Trace:
    """What a run produced on the way (the parity tests compare each to diffusers)."""

    prompt_embeds: np.ndarray | None = None
    negative_embeds: np.ndarray | None = None
    latents: list[np.ndarray] = field(default_factory=list)   # after each step, packed [tokens, channels]


def _read_json(path: Path) -> dict[str, Any]:
    from .plugin import read_json_object

    data = read_json_object(path, "restore the pipeline's component configs")
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: not a JSON object", "restore the file from the pipeline")
    return data


class Cancel:
    """A request's way to stop its generation from another thread (a streaming client that went away): the running
    stage process is killed, so its memory goes at once, and the generating thread fails with EngineError."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self.cancelled = False

    def attach(self, proc: subprocess.Popen | None) -> None:
        with self._lock:
            self._proc = proc
            if proc is not None and self.cancelled:
                proc.kill()

    def cancel(self) -> None:
        with self._lock:
            self.cancelled = True
            if self._proc is not None and self._proc.poll() is None:
                self._proc.kill()


class Pipeline:
    """One pipeline directory: its configs read and checked, its engine binary known."""

    CLASS = "QwenImagePipeline"
    COMPONENTS = COMPONENTS
    DEFAULT_STEPS = 50           # __call__'s num_inference_steps default
    DEFAULT_GUIDANCE = 4.0       # __call__'s true_cfg_scale default
    TEXT_STAGE_ARGS: tuple[str, ...] = ()

    def __init__(self, model_dir: Path, engine: Path, threads: int | None = None, weights: str = "f32"):
        self.dir = Path(model_dir)
        self.engine = engine
        self.threads = threads or 0
        if weights not in WEIGHTS:
            raise UsageError(f"--weights {weights}: not a weight mode", f"use one of {', '.join(WEIGHTS)}")
        self.weights = weights
        self.stage_peaks: dict[str, int] = {}   # stage -> its peak RSS in bytes (the engine reports VmHWM)
        index = _read_json(self.dir / "model_index.json")
        cls = index.get("_class_name")
        if cls not in SUPPORTED:
            raise ConfigError(f"{self.dir / 'model_index.json'}: pipeline class {cls!r} is not supported; "
                              f"colibri-image runs {', '.join(SUPPORTED)}", "point --model at one of those")
        if cls != self.CLASS:
            raise ConfigError(f"{self.dir / 'model_index.json'}: a {cls}, not a {self.CLASS}",
                              "open it with colibri_image.pipeline.open_dir")
        self.index = index
        for name in self.COMPONENTS:
            if not (self.dir / name).is_dir():
                raise ConfigError(f"{self.dir / name}: component folder missing (model_index.json names it)",
                                  "download the whole pipeline directory")
        self.text_cfg = _read_json(self.dir / "text_encoder" / "config.json")
        self.dit_cfg = _read_json(self.dir / "transformer" / "config.json")
        self.vae_cfg = _read_json(self.dir / "vae" / "config.json")
        self.sched_cfg = _read_json(self.dir / "scheduler" / "scheduler_config.json")
        self.vae_scale = 2 ** len(self.vae_cfg.get("temperal_downsample", [False, True, True]))
        self.cancel: Cancel | None = None   # set per generation (generate's cancel=)

    # ------------------------------------------------------------------------------------------- stage args

    def text_args(self) -> list[str]:
        t = self.text_cfg.get("text_config", self.text_cfg)
        heads = int(t["num_attention_heads"])
        rope = t.get("rope_parameters") or {}
        theta = rope.get("rope_theta", t.get("rope_theta", 1000000.0))
        return [f"layers={t['num_hidden_layers']}", f"hidden={t['hidden_size']}", f"heads={heads}",
                f"kv_heads={t.get('num_key_value_heads', heads)}",
                f"head_dim={t.get('head_dim') or t['hidden_size'] // heads}",
                f"intermediate={t['intermediate_size']}", f"vocab={t['vocab_size']}", f"rope_theta={theta}",
                f"eps={t.get('rms_norm_eps', 1e-6)}", f"prefix={self._text_prefix()}", *self.TEXT_STAGE_ARGS]

    def _text_prefix(self) -> str:
        from colibri.checkpoint import TensorIndex
        from .plugin import _component_shards

        shards = _component_shards(self.dir / "text_encoder", "")
        names = TensorIndex((shards,)).tensors if shards else {}
        for prefix in ("model.language_model.", "model.", "language_model.model."):
            if f"{prefix}embed_tokens.weight" in names:
                return prefix
        raise ConfigError(f"{self.dir / 'text_encoder'}: no embed_tokens.weight under a known prefix",
                          "the text encoder must be a Qwen2.5-VL / Qwen3-VL checkpoint")

    def dit_args(self) -> list[str]:
        c = self.dit_cfg
        if c.get("guidance_embeds") or c.get("zero_cond_t") or c.get("use_additional_t_cond") \
                or c.get("use_layer3d_rope"):
            raise ConfigError(f"{self.dir / 'transformer' / 'config.json'}: guidance/zero_cond_t/layered variants "
                              "are not supported", "use a text-to-image Qwen-Image transformer")
        axes = list(c.get("axes_dims_rope", (16, 56, 56)))
        return [f"layers={c['num_layers']}", f"heads={c['num_attention_heads']}",
                f"head_dim={c['attention_head_dim']}", f"in_channels={c['in_channels']}",
                f"out_channels={c.get('out_channels') or c['in_channels']}",
                f"joint_dim={c['joint_attention_dim']}", f"axes0={axes[0]}", f"axes1={axes[1]}", f"axes2={axes[2]}"]

    def vae_args(self) -> list[str]:
        c = self.vae_cfg
        mult = list(c.get("dim_mult", [1, 2, 4, 4]))
        return [f"base_dim={c.get('base_dim', 96)}", f"z_dim={c.get('z_dim', 16)}",
                f"num_res_blocks={c.get('num_res_blocks', 2)}", f"levels={len(mult)}",
                *[f"mult{i}={m}" for i, m in enumerate(mult)]]

    # ------------------------------------------------------------------------------------------- checks

    def resolve(self, req: Request) -> Request:
        """The request with the pipeline's defaults for what it left unset (steps, guidance)."""
        return dataclasses.replace(req, steps=self.DEFAULT_STEPS if req.steps is None else req.steps,
                                   guidance=self.DEFAULT_GUIDANCE if req.guidance is None else req.guidance)

    def check(self, req: Request) -> None:
        req = self.resolve(req)
        # diffusers needs multiples of vae_scale * 2 (16 for Qwen-Image); 32 is what the models were trained on
        step = max(SIZE_STEP, self.vae_scale * 2)
        for name, value in (("width", req.width), ("height", req.height)):
            if value % step or not MIN_SIDE <= value <= MAX_SIDE:
                raise UsageError(f"--size {req.width}x{req.height}: the {name} must be a multiple of {step} "
                                 f"between {MIN_SIDE} and {MAX_SIDE}", "pass e.g. --size 1024x1024 or 768x512")
        if not 1 <= (req.steps or 0) <= 1000:
            raise UsageError(f"--steps {req.steps}: must be between 1 and 1000", "pass e.g. --steps 30")

    # ------------------------------------------------------------------------------------------- stages

    def encode(self, prompts: list[str]) -> list[np.ndarray]:
        from colibri.tokenizer import load_tokenizer_dir

        tok = load_tokenizer_dir(self.dir / "tokenizer", None)
        out = []
        with Stage(self, "text", "text_encoder", self.text_args()) as stage:
            for prompt in prompts:
                ids = tok.encode(PROMPT_TEMPLATE.format(prompt), add_special_tokens=False)
                ids = ids[:TOKENIZER_MAX + TEMPLATE_DROP]
                stage.send(struct.pack("<i", len(ids)) + np.asarray(ids, dtype="<i4").tobytes())
                n, dim = struct.unpack("<ii", stage.recv(8))
                hidden = np.frombuffer(stage.recv(4 * n * dim), dtype="<f4").reshape(n, dim)
                out.append(hidden[TEMPLATE_DROP:][:MAX_SEQUENCE].copy())
        return out

    def base_sigmas(self, steps: int) -> np.ndarray:
        """The sigmas the pipeline hands the scheduler, before its shift."""
        return np.linspace(1.0, 1 / steps, steps).astype(np.float32)

    def sigmas(self, steps: int, image_seq_len: int) -> np.ndarray:
        """FlowMatchEulerDiscreteScheduler.set_timesteps(sigmas=base_sigmas(n), mu=calculate_shift(...)),
        with the trailing zero."""
        c = self.sched_cfg
        base_len, max_len = c.get("base_image_seq_len", 256), c.get("max_image_seq_len", 4096)
        base_shift, max_shift = c.get("base_shift", 0.5), c.get("max_shift", 1.15)
        m = (max_shift - base_shift) / (max_len - base_len)
        mu = image_seq_len * m + (base_shift - m * base_len)
        sig = self.base_sigmas(steps)
        if c.get("use_dynamic_shifting"):
            if c.get("time_shift_type", "exponential") == "exponential":
                sig = np.float32(np.exp(mu)) / (np.float32(np.exp(mu)) + (1 / sig - 1) ** np.float32(1.0))
            else:
                sig = np.float32(mu) / (np.float32(mu) + (1 / sig - 1) ** np.float32(1.0))
        else:
            shift = np.float32(c.get("shift", 1.0))
            sig = shift * sig / (1 + (shift - 1) * sig)
        if c.get("shift_terminal"):
            one_minus = 1 - sig
            sig = 1 - one_minus / (one_minus[-1] / np.float32(1 - c["shift_terminal"]))
        if c.get("use_karras_sigmas") or c.get("use_exponential_sigmas") or c.get("use_beta_sigmas") \
                or c.get("invert_sigmas") or c.get("stochastic_sampling"):
            raise ConfigError(f"{self.dir / 'scheduler' / 'scheduler_config.json'}: karras/exponential/beta/"
                              "inverted/stochastic sigmas are not supported", "use Qwen-Image's scheduler config")
        return np.concatenate([sig.astype(np.float32), np.zeros(1, np.float32)])

    def initial_latents(self, req: Request) -> tuple[np.ndarray, int, int]:
        channels = int(self.dit_cfg["in_channels"]) // 4
        lh, lw = 2 * (req.height // (self.vae_scale * 2)), 2 * (req.width // (self.vae_scale * 2))
        noise = torch_randn(req.seed, channels * lh * lw).reshape(channels, lh // 2, 2, lw // 2, 2)
        packed = noise.transpose(1, 3, 0, 2, 4).reshape((lh // 2) * (lw // 2), channels * 4)
        return np.ascontiguousarray(packed), lh, lw

    DIT_STAGE = "dit"

    def dit_grid(self, lh: int, lw: int) -> tuple[int, int]:
        """The transformer's token grid for a latent of lh x lw (2x2 patches here)."""
        return lh // 2, lw // 2

    def guide(self, pred: np.ndarray, neg: np.ndarray, guidance: float) -> np.ndarray:
        """True CFG; Qwen-Image rescales the guided prediction to the conditional one's norm per token."""
        comb = neg + np.float32(guidance) * (pred - neg)
        cond_norm = np.linalg.norm(pred, axis=-1, keepdims=True)
        noise_norm = np.linalg.norm(comb, axis=-1, keepdims=True)
        return comb * (cond_norm / noise_norm)

    def denoise(self, req: Request, texts: list[np.ndarray], latents: np.ndarray, lh: int, lw: int,
                trace: Trace | None, progress: Callable[[int, int], None] | None) -> np.ndarray:
        assert req.steps is not None and req.guidance is not None
        sig = self.sigmas(req.steps, latents.shape[0])
        timesteps = (sig[:-1] * np.float32(1000)).astype(np.float32)
        cfg = len(texts) > 1
        with Stage(self, self.DIT_STAGE, "transformer", self.dit_args()) as stage:
            header = struct.pack("<iii", *self.dit_grid(lh, lw), len(texts))
            for t in texts:
                header += struct.pack("<i", t.shape[0]) + np.ascontiguousarray(t, dtype="<f4").tobytes()
            stage.send(header)
            for i, t in enumerate(timesteps):
                tt = np.float32(t) / np.float32(1000)
                pred = self._predict(stage, 0, tt, latents)
                if cfg:
                    pred = self.guide(pred, self._predict(stage, 1, tt, latents), req.guidance)
                latents = (latents + (sig[i + 1] - sig[i]) * pred).astype(np.float32)
                if trace is not None:
                    trace.latents.append(latents.copy())
                if progress is not None:
                    progress(i + 1, len(timesteps))
            stage.send(struct.pack("<i", 0))
        return latents

    def _predict(self, stage: "Stage", which: int, tt: np.float32, latents: np.ndarray) -> np.ndarray:
        stage.send(struct.pack("<iif", 1, which, float(tt)) + latents.astype("<f4").tobytes())
        width = self.pred_width()
        pred = np.frombuffer(stage.recv(4 * latents.shape[0] * width), dtype="<f4").reshape(latents.shape[0], width)
        return pred.copy()

    def pred_width(self) -> int:
        return 4 * int(self.dit_cfg.get("out_channels") or self.dit_cfg["in_channels"])

    def decode(self, latents: np.ndarray, lh: int, lw: int) -> np.ndarray:
        z = int(self.vae_cfg.get("z_dim", 16))
        x = latents.reshape(lh // 2, lw // 2, z, 2, 2).transpose(2, 0, 3, 1, 4).reshape(z, lh, lw)
        mean = np.asarray(self.vae_cfg["latents_mean"], np.float32).reshape(z, 1, 1)
        inv_std = (np.float32(1.0) / np.asarray(self.vae_cfg["latents_std"], np.float32)).reshape(z, 1, 1)
        x = (x / inv_std + mean).astype(np.float32)
        with Stage(self, "vae", "vae", self.vae_args()) as stage:
            stage.send(struct.pack("<ii", lh, lw) + np.ascontiguousarray(x, "<f4").tobytes())
            h, w = struct.unpack("<ii", stage.recv(8))
            img = np.frombuffer(stage.recv(4 * 3 * h * w), dtype="<f4").reshape(3, h, w)
        pixels = np.clip(img * np.float32(0.5) + np.float32(0.5), 0, 1)
        return np.round(pixels.transpose(1, 2, 0) * np.float32(255)).astype(np.uint8)

    def generate(self, req: Request, trace: Trace | None = None,
                 progress: Callable[[int, int], None] | None = None, cancel: Cancel | None = None) -> np.ndarray:
        """The image (height x width x 3, or x 4 for RGBA pipelines, uint8) for one request. ``cancel`` stops it
        from another thread (EngineError here)."""
        req = self.resolve(req)
        self.check(req)
        # a shallow copy carries this generation's Cancel (a server shares one Pipeline between requests; the copy
        # shares its configs and stage_peaks)
        run = copy.copy(self)
        run.cancel = cancel
        return run._generate(req, trace, progress)

    def _generate(self, req: Request, trace: Trace | None,
                  progress: Callable[[int, int], None] | None) -> np.ndarray:
        assert req.guidance is not None
        cfg = req.negative_prompt is not None and req.guidance > 1
        texts = self.encode([req.prompt] + ([req.negative_prompt or ""] if cfg else []))
        if trace is not None:
            trace.prompt_embeds = texts[0]
            trace.negative_embeds = texts[1] if cfg else None
        latents, lh, lw = self.initial_latents(req)
        latents = self.denoise(req, texts, latents, lh, lw, trace, progress)
        return self.decode(latents, lh, lw)


def open_dir(model_dir: Path, engine: Path, threads: int | None = None, weights: str = "f32") -> Pipeline:
    """The pipeline class model_index.json names, opened (a clear ConfigError for any other class)."""
    from .pipeline21 import Pipeline21
    from .plugin import read_model_index

    cls = read_model_index(Path(model_dir)).get("_class_name")
    chosen = Pipeline21 if cls == Pipeline21.CLASS else Pipeline
    return chosen(model_dir, engine, threads, weights)


PEAK_PREFIX = "peak_rss_kib="


class Stage:
    """One engine process for one component; its stderr kept in a file to explain a death."""

    def __init__(self, pipe: Pipeline, stage: str, component: str, args: list[str]):
        self.cmd = [str(pipe.engine), stage, str(pipe.dir / component), *args, f"threads={pipe.threads}",
                    f"int8={int(pipe.weights == 'int8')}"]
        self.name = f"{stage} stage ({component}/)"
        self.stage, self.pipe = stage, pipe

    def __enter__(self) -> "Stage":
        cancel = self.pipe.cancel
        if cancel is not None and cancel.cancelled:
            raise EngineError(f"the {self.name} was cancelled", "the client went away")
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(self.cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log)
        if cancel is not None:
            cancel.attach(self.proc)
        return self

    def send(self, data: bytes) -> None:
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write(data)
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            self._died()

    def recv(self, n: int) -> bytes:
        assert self.proc.stdout is not None
        data = self.proc.stdout.read(n)
        if len(data) != n:
            self._died()
        return data

    def _died(self) -> None:
        code = self.proc.wait()
        if self.pipe.cancel is not None and self.pipe.cancel.cancelled:
            raise EngineError(f"the {self.name} was cancelled", "the client went away")
        self.log.seek(0)
        lines = [ln for ln in self.log.read().decode("utf-8", "replace").splitlines() if ln.strip()
                 and ln.strip() != "ready" and not ln.startswith(PEAK_PREFIX)]
        why = lines[-1] if lines else f"exit status {code}"
        why = why[len("error: "):] if why.startswith("error: ") else why
        if why.startswith("out of memory"):
            raise EngineError(f"the engine's {self.name} ran out of memory: {why}",
                              "use a smaller --size, --weights int8, or free RAM")
        raise EngineError(f"the engine's {self.name} died: {why}", "see the message; rerun to retry")

    def __exit__(self, kind: Any, *exc: Any) -> None:
        if self.pipe.cancel is not None:
            self.pipe.cancel.attach(None)
        if kind is not None and self.proc.poll() is None:
            self.proc.kill()   # failed or cancelled mid-stage: do not wait for the stage to finish its work
        if self.proc.stdin:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
        code = self.proc.wait()
        try:
            if code != 0 and kind is None:   # answered everything, then failed (a sanitizer's report, say)
                self._died()
            self.log.seek(0)
            for line in self.log.read().decode("utf-8", "replace").splitlines():
                if line.startswith(PEAK_PREFIX) and line[len(PEAK_PREFIX):].isdigit():
                    peak = 1024 * int(line[len(PEAK_PREFIX):])
                    self.pipe.stage_peaks[self.stage] = max(peak, self.pipe.stage_peaks.get(self.stage, 0))
        finally:
            self.log.close()
