"""``coli convert --verify``: re-read a container and check every tensor against its source.

Two independent checks per quantized tensor: the stored bits equal a fresh quantization of the source rows
(determinism), and every element's dequantization error is within the scheme's bound ``scale / 2`` (with the
stored F16 scale, which is the ideal scale rounded up: at most ``(1 + 2**-10) * ideal / 2``). Float tensors must
equal the source (F32: exactly; BF16: its round-to-nearest-even); copied tensors byte for byte. Every routed
expert must occupy one contiguous byte range. Memory stays bounded: rows are read in chunks.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .. import hooks
from ..checkpoint import TensorIndex, TensorInfo
from ..records import ResolvedModel
from .container import Container, ContainerError, StoredTensor, open_container
from .io import pread_exact, read_rows, row_bytes, row_chunks
from .schemes import f32_to_bf16_bits, max_bound_violation, quantize, to_f32

# float64 arithmetic on the bound itself (x / scale, then rint) may land a hair past scale/2.
BOUND_SLACK = 1e-9


@dataclass
class VerifyResult:
    tensors: int = 0
    experts: int = 0
    max_ratio: dict[str, float] = field(default_factory=dict)   # scheme -> max |x - deq| / (scale / 2)


def _fail(path: Path, msg: str) -> ContainerError:
    return ContainerError(f"{path}: {msg}", "the container does not match its source; delete it and reconvert")


class _Files:
    def __init__(self):
        self.fds: dict[Path, int] = {}

    def fd(self, path: Path) -> int:
        if path not in self.fds:
            self.fds[path] = os.open(path, os.O_RDONLY)
        return self.fds[path]

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)


def _check_quant(files: _Files, st: StoredTensor, src: TensorInfo, result: VerifyResult) -> None:
    scheme = st.quant
    assert scheme is not None, st.name    # called for quantized tensors only
    qw, sc = st.parts
    rows, cols = st.shape
    qrow = row_bytes(qw)
    groups = scheme.groups_per_row(cols)
    worst = result.max_ratio.get(st.scheme, 0.0)
    for r0, r1 in row_chunks(src):
        x = read_rows(files.fd(src.file), src, r0, r1)
        q_stored = np.frombuffer(pread_exact(files.fd(qw.file), (r1 - r0) * qrow, qw.begin + r0 * qrow, qw.file),
                                 dtype=np.int8 if qw.dtype == "I8" else np.uint8).reshape(r1 - r0, -1)
        s_raw = pread_exact(files.fd(sc.file), (r1 - r0) * groups * 2, sc.begin + r0 * groups * 2, sc.file)
        s_stored = np.frombuffer(s_raw, dtype="<f2").reshape((r1 - r0, groups) if scheme.group else (r1 - r0,))
        q_fresh, s_fresh = quantize(scheme, x)
        if not np.array_equal(s_fresh.view(np.uint16), s_stored.view(np.uint16)):
            raise _fail(sc.file, f"{sc.name} rows {r0}..{r1} differ from a fresh quantization of the source")
        if not np.array_equal(q_fresh, q_stored):
            raise _fail(qw.file, f"{qw.name} rows {r0}..{r1} differ from a fresh quantization of the source")
        ratio = max_bound_violation(scheme, x, q_stored, s_stored)
        if ratio > 1.0 + BOUND_SLACK:
            raise _fail(qw.file, f"{st.name}: dequantization error reaches {ratio:.6g} x scale/2 (bound: 1)")
        worst = max(worst, ratio)
    result.max_ratio[st.scheme] = worst


def _check_float(files: _Files, st: StoredTensor, src: TensorInfo) -> None:
    (data,) = st.parts
    if data.shape != src.shape:
        raise _fail(data.file, f"{st.name} has shape {list(data.shape)}, the source {list(src.shape)}")
    same_dtype = data.dtype == src.dtype
    for r0, r1 in row_chunks(src):
        rb_src, rb_out = row_bytes(src), row_bytes(data)
        raw = pread_exact(files.fd(src.file), (r1 - r0) * rb_src, src.begin + r0 * rb_src, src.file)
        got = pread_exact(files.fd(data.file), (r1 - r0) * rb_out, data.begin + r0 * rb_out, data.file)
        if same_dtype:
            ok = raw == got
        else:
            x = to_f32(raw, src.dtype, (-1,))
            want = x.astype("<f4") if data.dtype == "F32" else f32_to_bf16_bits(x).astype("<u2")
            ok = want.tobytes() == got
        if not ok:
            raise _fail(data.file, f"{st.name} rows {r0}..{r1} differ from the source ({src.dtype} -> {data.dtype})")


def verify_container(out: Path, source: TensorIndex, model: ResolvedModel) -> VerifyResult:
    """Check the container at ``out`` against the source index; raise :class:`ContainerError` on any mismatch."""
    container: Container | None = open_container(out)
    if container is None:
        raise ContainerError(f"{out}: has no {'colibri-quant'} stamp", "reconvert the model with `coli convert`")
    missing = sorted(set(source.tensors) - set(container.tensors))
    if missing:
        raise _fail(out, f"source tensor {missing[0]!r} is not in the container")
    extra = sorted(set(container.tensors) - set(source.tensors))
    if extra:
        raise _fail(out, f"tensor {extra[0]!r} is not in the source")
    result = VerifyResult()
    files = _Files()
    try:
        for name, st in container.tensors.items():
            src = source[name]
            if st.quant is not None:
                if st.shape != src.shape:
                    raise _fail(st.file, f"{name} holds a {list(st.shape)} matrix, the source {list(src.shape)}")
                _check_quant(files, st, src, result)
            else:
                _check_float(files, st, src)
            result.tensors += 1
    finally:
        files.close()
    layout = hooks.tensor_layout(model)
    for ex in layout.experts if layout else ():
        container.extent(ex.tensors)
        result.experts += 1
    return result
