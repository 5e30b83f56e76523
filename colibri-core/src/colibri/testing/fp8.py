"""Block-quantized FP8 copies of tiny checkpoints, in the format DeepSeek-V3/R1/V3.2 and Kimi K2 ship (colibri.fp8).

    from colibri.testing.fp8 import write_fp8_checkpoint, write_dequantized

    fp8_dir = write_fp8_checkpoint(built.path, tmp / "fp8")          # e4m3 weights + 128x128 weight_scale_inv
    ref_dir = write_dequantized(fp8_dir, tmp / "dequantized")         # the f32 values those stand for

Every 2-D ``*.weight`` the predicate accepts is quantized per 128x128 block (scale = block absmax / 448, the
e4m3 maximum; partial blocks at the edges are scaled on their own elements) and stored as F8_E4M3 beside its
F32 ``weight_scale_inv``; everything else is copied unchanged. config.json gets the ``quantization_config`` of
the real releases. ``write_dequantized`` writes ``e4m3 * scale`` in f32 (torch's product, one rounding) under the
original names and the original config: the checkpoint transformers runs as the reference.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .. import fp8

E4M3_MAX = 448.0
QUANTIZATION_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                       "weight_block_size": [fp8.BLOCK, fp8.BLOCK]}


def released_choice(name: str, tensor: torch.Tensor) -> bool:
    """What DeepSeek's release quantizes: linear projections; not embeddings, the LM head, routers (``mlp.gate``)
    or the DSA indexer's head weights."""
    if tensor.ndim != 2 or not name.endswith(".weight"):
        return False
    excluded = ("embed_tokens.", "lm_head.", "mlp.gate.weight", "indexer.weights_proj.")
    return not any(part in name for part in excluded)


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(F8_E4M3 weight, F32 scale_inv [ceil(rows/128), ceil(cols/128)]) for a 2-D float tensor."""
    w = weight.detach().to(torch.float32)
    rows, cols = w.shape
    b = fp8.BLOCK
    br, bc = -(-rows // b), -(-cols // b)
    padded = torch.zeros(br * b, bc * b, dtype=torch.float32)
    padded[:rows, :cols] = w
    amax = padded.reshape(br, b, bc, b).abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    full = scale.repeat_interleave(b, 0).repeat_interleave(b, 1)[:rows, :cols]
    q = (w / full).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale.contiguous()


def dequantize(q: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """e4m3 * the scale of its block, as one f32 product (what transformers' dequantization computes)."""
    rows, cols = q.shape
    b = fp8.BLOCK
    full = scale_inv.to(torch.float32).repeat_interleave(b, 0).repeat_interleave(b, 1)[:rows, :cols]
    return q.to(torch.float32) * full


def _copy_side_files(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
            shutil.copy2(f, dst / f.name)


def _load_all(src: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(f))
    return tensors


def write_fp8_checkpoint(src: Path, dst: Path,
                         choose: Callable[[str, torch.Tensor], bool] = released_choice) -> Path:
    """Copy checkpoint ``src`` to ``dst`` with every weight ``choose`` accepts block-quantized to FP8."""
    src, dst = Path(src), Path(dst)
    _copy_side_files(src, dst)
    out: dict[str, torch.Tensor] = {}
    for name, t in _load_all(src).items():
        if choose(name, t):
            out[name], out[fp8.scale_name(name)] = quantize(t)
        else:
            out[name] = t.contiguous()
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text(encoding="utf-8"))
    cfg["quantization_config"] = dict(QUANTIZATION_CONFIG)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2), encoding="utf-8")
    return dst


def write_dequantized(fp8_dir: Path, dst: Path) -> Path:
    """The f32 checkpoint an FP8 one stands for: every quantized weight as e4m3 * scale, scales dropped, and
    config.json without ``quantization_config``."""
    fp8_dir, dst = Path(fp8_dir), Path(dst)
    _copy_side_files(fp8_dir, dst)
    tensors = _load_all(fp8_dir)
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name.endswith(fp8.SCALE_SUFFIX):
            continue
        scale = tensors.get(fp8.scale_name(name))
        out[name] = dequantize(t, scale) if scale is not None else t.contiguous()
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((fp8_dir / "config.json").read_text(encoding="utf-8"))
    cfg.pop("quantization_config", None)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2), encoding="utf-8")
    return dst
