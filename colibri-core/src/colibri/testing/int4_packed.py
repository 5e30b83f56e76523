"""int4 compressed-tensors (pack-quantized) copies of tiny checkpoints, in the format Kimi K2-Thinking ships.

    from colibri.testing.int4_packed import write_int4_checkpoint, write_dequantized

    int4_dir = write_int4_checkpoint(built.path, tmp / "int4")     # routed experts: weight_packed/_scale/_shape
    ref_dir = write_dequantized(int4_dir, tmp / "dequantized")     # the f32 values those stand for

Every routed-expert matrix (``.mlp.experts.``) is quantized symmetric per group of ``group`` input columns as
compressed-tensors' minmax observer does (scale = group absmax / 7.5 in BF16, ``q = clamp(round(w / scale), -8,
7)``), packed eight values per I32 (value k in bits 4k.., stored as q + 8) beside its BF16 ``weight_scale`` and I32
``weight_shape``; everything else is copied unchanged (the release leaves attention, shared experts, dense layers,
routers, embeddings and the LM head BF16). config.json gets the release's ``quantization_config``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from .. import int4_packed
from .fp8 import _copy_side_files, _load_all

GROUP = 32
QUANTIZATION_CONFIG: dict[str, Any] = {
    "quant_method": int4_packed.METHOD, "format": int4_packed.FORMAT, "quantization_status": "compressed",
    "config_groups": {"group_0": {
        "targets": ["Linear"], "input_activations": None, "output_activations": None,
        "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": GROUP,
                    "dynamic": False, "actorder": None, "observer": "minmax", "observer_kwargs": {}}}},
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"],
    "kv_cache_scheme": None,
}


def routed_expert(name: str, tensor: torch.Tensor) -> bool:
    return tensor.ndim == 2 and name.endswith(".weight") and ".mlp.experts." in name


def quantize(weight: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """(I32 packed [rows, cols / 8], BF16 scale [rows, cols / group]) of a 2-D float tensor."""
    w = weight.detach().to(torch.float32)
    rows, cols = w.shape
    g = w.reshape(rows, cols // group, group)
    scale = (g.abs().amax(dim=2) / 7.5).to(torch.bfloat16)
    s = scale.to(torch.float32).clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(2)
    q = torch.clamp(torch.round(g / s), -8, 7).to(torch.int64).reshape(rows, cols)
    u = (q + int4_packed.OFFSET).reshape(rows, cols // 8, 8)
    words = (u << (4 * torch.arange(8, dtype=torch.int64))).sum(dim=2)
    packed = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return packed.contiguous(), scale.contiguous()


def dequantize(packed: torch.Tensor, scale: torch.Tensor, cols: int) -> torch.Tensor:
    """(u - 8) * the group's scale, one f32 product per element (compressed-tensors' unpack_from_int32 order)."""
    words = packed.to(torch.int64) & 0xFFFFFFFF
    u = (words.unsqueeze(2) >> (4 * torch.arange(8, dtype=torch.int64))) & 15
    q = (u.reshape(packed.shape[0], -1)[:, :cols] - int4_packed.OFFSET).to(torch.float32)
    group = cols // scale.shape[1]
    return q * scale.to(torch.float32).repeat_interleave(group, dim=1)


def write_int4_checkpoint(src: Path, dst: Path, group: int = GROUP) -> Path:
    """Copy checkpoint ``src`` to ``dst`` with every routed-expert matrix int4 pack-quantized."""
    src, dst = Path(src), Path(dst)
    _copy_side_files(src, dst)
    out: dict[str, torch.Tensor] = {}
    for name, t in _load_all(src).items():
        if routed_expert(name, t):
            packed, scale, shape = int4_packed.parts(name)
            out[packed], out[scale] = quantize(t, group)
            out[shape] = torch.tensor(list(t.shape), dtype=torch.int32)
        else:
            out[name] = t.contiguous()
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text(encoding="utf-8"))
    qc = json.loads(json.dumps(QUANTIZATION_CONFIG))
    qc["config_groups"]["group_0"]["weights"]["group_size"] = group
    cfg["quantization_config"] = qc
    (dst / "config.json").write_text(json.dumps(cfg, indent=2), encoding="utf-8")
    return dst


def write_dequantized(int4_dir: Path, dst: Path) -> Path:
    """The f32 checkpoint an int4 one stands for: every packed weight as (u - 8) * scale under its ``.weight``
    name, and config.json without ``quantization_config``."""
    int4_dir, dst = Path(int4_dir), Path(dst)
    _copy_side_files(int4_dir, dst)
    tensors = _load_all(int4_dir)
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name.endswith(int4_packed.SCALE_SUFFIX) or name.endswith(int4_packed.SHAPE_SUFFIX):
            continue
        if name.endswith(int4_packed.PACKED_SUFFIX):
            weight = name[:-len(int4_packed.PACKED_SUFFIX)]
            _, scale, shape = int4_packed.parts(weight)
            out[weight] = dequantize(t, tensors[scale], int(tensors[shape][1]))
        else:
            out[name] = t.contiguous()
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((int4_dir / "config.json").read_text(encoding="utf-8"))
    cfg.pop("quantization_config", None)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2), encoding="utf-8")
    return dst
