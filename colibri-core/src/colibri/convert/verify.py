"""``coli convert --verify``: re-read a container and check every tensor against its source.

Two independent checks per quantized tensor: the stored bits equal a fresh quantization of the source rows
(determinism), and every element's dequantization error is within the scheme's bound ``scale / 2`` (with the
stored F16 scale, which is the ideal scale rounded up: at most ``(1 + 2**-10) * ideal / 2``). Float tensors must
equal the source (F32: exactly; BF16: its round-to-nearest-even); copied tensors byte for byte. Every routed
expert must occupy one contiguous byte range. Memory stays bounded: rows are read in chunks.

What a stored tensor is checked against comes from the conversion plan: a quantized one against its source rows
read exactly as the converter reads them (``io.source_rows``: FP8 weights dequantized with their block scales,
packed int4 ones with their group scales), so a scale tensor the converter consumed is checked through the values
it scales, and it is expected to be absent from the container. The recomputation is the reference
``schemes.quantize``, not the converter's ``fast_quant``: verify stays an independent check of it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .. import hooks, int4_packed
from ..checkpoint import TensorIndex, TensorInfo
from ..records import ResolvedModel
from .container import Container, ContainerError, StoredTensor, open_container
from .io import pread_exact, row_bytes, row_chunks, source_rows
from .plan import Item, JobPlan, build_plan
from .schemes import FLOAT_SOURCE_DTYPES, f32_to_bf16_bits, max_bound_violation, quantize, to_f32

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
    def __init__(self, index: TensorIndex):
        self.index = index
        self.fds: dict[Path, int] = {}

    def fd(self, path: Path) -> int:
        if path not in self.fds:
            self.fds[path] = os.open(path, os.O_RDONLY)
        return self.fds[path]

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)


def _check_quant(files: _Files, st: StoredTensor, item: Item, result: VerifyResult) -> None:
    src = item.source
    scheme = st.quant
    assert scheme is not None, st.name    # called for quantized tensors only
    qw, sc = st.parts
    rows, cols = st.shape
    qrow = row_bytes(qw)
    groups = scheme.groups_per_row(cols)
    worst = result.max_ratio.get(st.scheme, 0.0)
    for r0, r1 in row_chunks(src):
        x = source_rows(item, files.fd(src.file), r0, r1)
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


def _check_packed_shape(files: _Files, item: Item) -> None:
    """A packed int4 weight's ``weight_shape`` tensor (consumed, never written) must state the shape converted."""
    shape = files.index[int4_packed.parts(item.source.name)[2]]
    raw = pread_exact(files.fd(shape.file), shape.nbytes, shape.begin, shape.file)
    got = tuple(int(v) for v in np.frombuffer(raw, dtype="<i4" if shape.dtype == "I32" else "<i8"))
    if got != tuple(item.source.shape):
        raise _fail(shape.file, f"source tensor {shape.name} says {list(got)}, the container holds "
                                f"{list(item.source.shape)}")


def source_plan(source: TensorIndex, model: ResolvedModel) -> JobPlan:
    """A plan of ``source`` for verifying a container made without one at hand: which source bytes (and scales)
    each stored tensor comes from does not depend on the schemes, which verify reads from the container itself."""
    layout, spec = hooks.tensor_layout(model), hooks.converter_spec(model)
    if layout is None or spec is None:
        raise ContainerError(f"{model.path}: family {model.family!r} cannot describe this checkpoint",
                             "verify the container with the family plugin that converted it")
    return build_plan(source, layout, spec, "int8", "bf16", b"")


def _stored_names(plan: JobPlan) -> dict[str, str]:
    """Source tensor name -> the container tensor it is stored as, for every tensor the plan writes (a packed
    int4 weight is read from its ``_packed`` tensor and stored under its logical name)."""
    out = {}
    for item in (it for shard in plan.shards for it in shard.items):
        name = item.source.name
        out[int4_packed.parts(name)[0] if item.packed_int4 else name] = name
    return out


def verify_container(out: Path, source: TensorIndex, model: ResolvedModel,
                     plan: JobPlan | None = None) -> VerifyResult:
    """Check the container at ``out`` against the source index; raise :class:`ContainerError` on any mismatch.

    :param plan: the plan the container was converted by (``run.make_plan``); without it one is made from the
        source headers (:func:`source_plan`)."""
    container: Container | None = open_container(out)
    if container is None:
        raise ContainerError(f"{out}: has no {'colibri-quant'} stamp", "reconvert the model with `coli convert`")
    if plan is None:
        plan = source_plan(source, model)
    # The plan names every source tensor the container must hold (a packed weight under its logical name); the
    # scale and shape tensors it consumed are read with their weights, never stored, so they are not expected.
    items = {it.source.name: it for shard in plan.shards for it in shard.items}
    stored_as = _stored_names(plan)
    missing = sorted(set(items) - set(container.tensors))
    if missing:
        raise _fail(out, f"source tensor {missing[0]!r} is not in the container")
    extra = sorted(set(container.tensors) - set(items))
    if extra:
        raise _fail(out, f"tensor {extra[0]!r} is not in the source")
    result = VerifyResult()
    files = _Files(source)
    try:
        for name, st in container.tensors.items():
            item = items[name]
            if st.quant is not None:
                if st.shape != item.source.shape:
                    raise _fail(st.file, f"{name} holds a {list(st.shape)} matrix, the source "
                                         f"{list(item.source.shape)}")
                if item.scale is None and item.source.dtype not in FLOAT_SOURCE_DTYPES:
                    raise _fail(st.file, f"{name} is stored {st.scheme}, but its source is {item.source.dtype} "
                                         "(a tensor convert copies)")
                if item.packed_int4:
                    _check_packed_shape(files, item)
                _check_quant(files, st, item, result)
            else:
                _check_float(files, st, item.source)
            result.tensors += 1
    finally:
        files.close()
    layout = hooks.tensor_layout(model)
    for ex in layout.experts if layout else ():
        # the source layout names consumed scales (and packed weights by their _packed tensors)
        container.extent(tuple(stored_as[n] for n in ex.tensors if n in stored_as))
        result.experts += 1
    return result

