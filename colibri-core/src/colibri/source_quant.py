"""What a quantized release's ``quantization_config`` means for a family's tensor layout (docs/formats.md).

Two shipped formats are read natively: block-FP8 (``colibri.fp8``: DeepSeek V3/R1/V3.2, Kimi K2, GLM-5-FP8) and
int4 compressed-tensors ``pack-quantized`` (``colibri.int4_packed``: Kimi K2-Thinking). Families whose engines
stream experts through the runtime's expert store call :func:`check_config` where they validate a config and
:func:`quantized_layout` where they build a layout; both work from names, so no family code knows a format.
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from . import fp8, int4_packed
from .records import ExpertTensors


def check_config(config: Mapping[str, Any], where: str) -> str | None:
    """``"fp8"``, ``"int4-packed"`` or None (unquantized); any other ``quantization_config`` is refused with one
    line naming the field."""
    qc = config.get("quantization_config")
    if isinstance(qc, Mapping) and qc.get("quant_method") == int4_packed.METHOD:
        int4_packed.check_config(qc, where)
        return "int4-packed"
    return "fp8" if fp8.check_config(config, where) else None


@dataclass(frozen=True)
class QuantizedLayout:
    experts: list[ExpertTensors]
    buffers: list[str]                 # scale (and shape) tensors: bytes, not parameters
    packed_int4: list[str]             # I32 tensors holding eight int4 values per element


def quantized_layout(config: Mapping[str, Any], where: str, model_dir: Path, dense: Sequence[str],
                     experts: Sequence[ExpertTensors]) -> QuantizedLayout:
    """The experts of a layout, and the buffers to add, as a quantized checkpoint stores them.

    :param dense: every non-expert matrix name (FP8 scales of the dense weights are found among them).
    :returns: FP8: each weight with a ``weight_scale_inv`` companion on disk gets it (an expert's scales belong to
        its bytes, so a cache slot holds them). int4 pack-quantized: each expert weight stored packed is named by
        its ``_packed`` tensor (eight values per I32), followed in the expert by its scales; the ``_shape``
        tensors are buffers the engine checks at load. Unquantized: unchanged."""
    kind = check_config(config, where)
    if kind is None:
        return QuantizedLayout(list(experts), [], [])
    present = fp8.tensor_names(model_dir)
    if kind == "fp8":
        fp8_experts, scales = fp8.with_scales(present, dense, experts)
        return QuantizedLayout(fp8_experts, scales, [])
    # Only routed experts are read packed (the release leaves everything else BF16); a packed dense weight is
    # missing under its layout name, so doctor and the engine name it.
    packed = set(int4_packed.packed_among([n for x in experts for n in x.tensors], present))
    out, buffers = [], []
    for x in experts:
        names = [int4_packed.parts(n) if n in packed else (n, None, None) for n in x.tensors]
        out.append(ExpertTensors(x.layer, x.expert, tuple(p for p, _, _ in names)
                                 + tuple(s for _, s, _ in names if s)))
        buffers += [n for _, s, shape in names if s and shape for n in (s, shape)]
    return QuantizedLayout(out, buffers, sorted(int4_packed.packed_name(n) for n in packed))
