"""Block-quantized FP8 checkpoints, as DeepSeek-V3/R1/V3.2 and Kimi K2 ship them (docs/formats.md).

config.json carries ``quantization_config: {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
"weight_block_size": [128, 128]}``. Every quantized linear ``X.weight`` is stored as F8_E4M3 [out, in] beside
``X.weight_scale_inv`` [ceil(out/128), ceil(in/128)]; the weight means ``e4m3 * scale`` of its block. Which tensors
are quantized is read from the checkpoint (a scale companion is present), never from a list of names: releases
differ in which small projections they leave in bf16.

The scale tensors are not parameters of the model (transformers counts the dequantized weights), so layouts list
them as buffers: loaded and counted in bytes, never in parameter counts.
"""

from __future__ import annotations

from pathlib import Path
from collections.abc import Iterable, Mapping
from typing import Any

from . import checkpoint
from .errors import ConfigError
from .records import ExpertTensors

BLOCK = 128
SCALE_SUFFIX = "_scale_inv"
WEIGHT_DTYPE = "F8_E4M3"
SCALE_DTYPES = ("F32", "BF16", "F8_E8M0")
_HINT = ('colibri reads quantization_config {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], '
         '"activation_scheme": "dynamic"} (DeepSeek-V3 / Kimi K2 releases), or an unquantized checkpoint')


def check_config(config: Mapping[str, Any], where: str) -> bool:
    """True for a block-FP8 checkpoint colibri reads, False for an unquantized one; any other
    ``quantization_config`` is refused with one line naming the field."""
    qc = config.get("quantization_config")
    if qc is None:
        return False
    if not isinstance(qc, Mapping):
        raise ConfigError(f"{where}: quantization_config must be an object", _HINT)
    method = qc.get("quant_method")
    if method != "fp8":
        raise ConfigError(f"{where}: quantization_config.quant_method {method!r} is not supported", _HINT)
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ConfigError(f"{where}: quantization_config.fmt {fmt!r} is not supported (fp8 weights must be e4m3)",
                          _HINT)
    block = qc.get("weight_block_size", [BLOCK, BLOCK])
    if not isinstance(block, (list, tuple)) or [b for b in block] != [BLOCK, BLOCK]:
        raise ConfigError(f"{where}: quantization_config.weight_block_size {block!r} is not supported "
                          f"(blocks must be [{BLOCK}, {BLOCK}])", _HINT)
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise ConfigError(f"{where}: quantization_config.activation_scheme {scheme!r} is not supported "
                          "(static activation scales are not read)", _HINT)
    return True


def scale_name(weight_name: str) -> str:
    """``a.b.weight`` -> ``a.b.weight_scale_inv``."""
    return weight_name + SCALE_SUFFIX


def tensor_names(model_dir: Path) -> frozenset[str]:
    """Every tensor name of the checkpoint, from its shard index or headers (no weight byte is read)."""
    shard_set = checkpoint.default_shard_set(Path(model_dir))
    if shard_set is None:
        return frozenset()
    if shard_set.index_file:
        return frozenset(checkpoint.read_index(shard_set.index_file))
    return frozenset(t.name for f in shard_set.files for t in checkpoint.read_header(f).tensors)


def companions(names: Iterable[str], present: frozenset[str]) -> dict[str, str]:
    """weight name -> its scale tensor, for the weights among ``names`` that have one in ``present``."""
    return {n: scale_name(n) for n in names if scale_name(n) in present}


def with_scales(present: frozenset[str], dense: Iterable[str],
                experts: Iterable[ExpertTensors]) -> tuple[list[ExpertTensors], list[str]]:
    """(experts with their scale companions appended, every scale name) for a block-FP8 checkpoint whose tensor
    names are ``present``: an expert's scales belong to its bytes (a cache slot holds them); scales are buffers."""
    out = [ExpertTensors(x.layer, x.expert, x.tensors + tuple(companions(x.tensors, present).values()))
           for x in experts]
    scales = list(companions(dense, present).values())
    scales += [n for x in out for n in x.tensors if n.endswith(SCALE_SUFFIX)]
    return out, scales
