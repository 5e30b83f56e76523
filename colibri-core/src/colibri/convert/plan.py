"""Deciding, from headers alone, every byte a conversion will write: shards, tensor order, dtypes, offsets.

The plan is a pure function of the source headers and the options, which is what makes a resumed conversion
byte-identical to an uninterrupted one: a rerun recomputes the same plan and rewrites only unfinished shards.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from .. import __version__
from ..checkpoint import DTYPE_BYTES, LAYER_INDEX, TensorIndex, TensorInfo
from ..errors import CheckpointError, UsageError
from ..records import ConverterSpec, TensorLayout
from . import fp8_source, int4_source
from .container import CONTAINER_VERSION, SCALES_DTYPE, qweight_name, scales_name, shard_metadata
from .schemes import BY_OPTION, COPY_SCHEME, FLOAT_SOURCE_DTYPES, INT4, INT8, Scheme

HEADER_ALIGN = 8


@dataclass(frozen=True)
class Part:
    """One tensor as written to an output shard."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return int(math.prod(self.shape) * DTYPE_BYTES[self.dtype])


@dataclass(frozen=True)
class Item:
    """One source tensor and how it is stored: a quantized pair (qweight, scales) or one float/copied tensor."""

    source: TensorInfo
    scheme: str                          # scheme-map value
    quant: Scheme | None
    parts: tuple[Part, ...]
    scale: TensorInfo | None = None      # an FP8 source's block scales: read dequantized (fp8_source.py), or
    packed_int4: bool = False            # with this, a packed int4 source's group scales (int4_source.py)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)


# A matrix the requested scheme cannot hold takes this one instead, for that tensor alone (as llama.cpp falls back
# per tensor): int8-row has one scale per row, so it fits any input width.
FALLBACK = {INT4.name: INT8}


@dataclass(frozen=True)
class Fallback:
    """One tensor stored with another scheme than the one asked for, and why."""

    name: str
    shape: tuple[int, int]
    wanted: str                          # scheme-map values, e.g. "int4-g64" -> "int8-row"
    used: str
    why: str


def summarize_fallbacks(fallbacks: list[Fallback]) -> list[str]:
    """One line per tensor role (layer and expert indices folded into ``*``), with its count, for the report."""
    groups: dict[tuple[str, tuple[int, int], str, str, str], int] = {}
    for f in fallbacks:
        key = (re.sub(r"(?<=\.)\d+(?=\.)", "*", f.name), f.shape, f.wanted, f.used, f.why)
        groups[key] = groups.get(key, 0) + 1
    return [f"{pattern} {list(shape)} x{n}: {used} instead of {wanted} ({why})"
            for (pattern, shape, wanted, used, why), n in sorted(groups.items())]


@dataclass
class ShardPlan:
    index: int                           # 1-based
    label: str                           # "globals" or "layer 7", for progress lines
    items: list[Item] = field(default_factory=list)
    file_name: str = ""

    @property
    def schemes(self) -> dict[str, str]:
        return {it.source.name: it.scheme for it in self.items}

    @property
    def source_bytes(self) -> int:
        return sum(it.source.nbytes for it in self.items)

    def header_bytes(self) -> bytes:
        """The complete safetensors header (length prefix included), padded with spaces to 8 bytes."""
        header: dict = {"__metadata__": shard_metadata(self.schemes)}
        offset = 0
        for it in self.items:
            for p in it.parts:
                header[p.name] = {"dtype": p.dtype, "shape": list(p.shape), "data_offsets": [offset, offset + p.nbytes]}
                offset += p.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
        raw += b" " * (-(8 + len(raw)) % HEADER_ALIGN)
        return len(raw).to_bytes(8, "little") + raw

    @property
    def data_bytes(self) -> int:
        return sum(it.nbytes for it in self.items)


@dataclass
class JobPlan:
    shards: list[ShardPlan]
    job: str                             # digest of source headers, config and options
    experts: str
    dense: str
    fallbacks: list[Fallback] = field(default_factory=list)

    @property
    def source_bytes(self) -> int:
        return sum(s.source_bytes for s in self.shards)

    def weight_map(self) -> dict[str, str]:
        return {p.name: s.file_name for s in self.shards for it in s.items for p in it.parts}

    def total_size(self) -> int:
        return sum(s.data_bytes for s in self.shards)


def _quant_item(t: TensorInfo, scheme: Scheme, role: str, flag: str, fallbacks: list[Fallback],
                scale: TensorInfo | None = None) -> Item:
    if (t.dtype not in FLOAT_SOURCE_DTYPES and scale is None) or len(t.shape) != 2:
        raise CheckpointError(f"{t.file}: {role} tensor {t.name!r} is {t.dtype}{list(t.shape)}; "
                              f"convert quantizes 2-D {'/'.join(FLOAT_SOURCE_DTYPES)} matrices only",
                              "this checkpoint's layout needs a family-specific converter")
    rows, cols = t.shape
    why = scheme.check_cols(cols)
    if why and scheme.name in FALLBACK:
        wanted, scheme = scheme, FALLBACK[scheme.name]
        fallbacks.append(Fallback(t.name, (rows, cols), wanted.name, scheme.name,
                                  f"input width {cols} is not a multiple of {wanted.group}"))
    elif why:
        raise UsageError(f"{flag} {scheme.option}: {t.name} {list(t.shape)}: {why}",
                         f"use {flag} int8 for this model")
    parts = (Part(qweight_name(t.name), scheme.qdtype, scheme.qweight_shape(rows, cols)),
             Part(scales_name(t.name), SCALES_DTYPE, scheme.scales_shape(rows, cols)))
    return Item(t, scheme.name, scheme, parts, scale)


def _float_item(t: TensorInfo, scheme: str) -> Item:
    dtype = {"f32": "F32", "bf16": "BF16"}.get(scheme, t.dtype)
    return Item(t, scheme, None, (Part(t.name, dtype, t.shape),))


def _layer_of(name: str) -> int | None:
    m = LAYER_INDEX.search(name)
    return int(m.group(1)) if m else None


def _alignment_key(item: Item) -> tuple[int, int, str]:
    """Widest element first, so every float tensor of a shard starts aligned to its element size."""
    first = item.parts[0]
    return (-int(DTYPE_BYTES[first.dtype] * 8), 1 if item.quant else 0, item.source.name)


def job_digest(index: TensorIndex, config_bytes: bytes, experts: str, dense: str) -> str:
    digest = hashlib.sha256()
    digest.update(f"colibri {__version__} container {CONTAINER_VERSION} experts={experts} dense={dense}\n".encode())
    digest.update(config_bytes)
    for header in index.headers:
        with open(header.file, "rb") as fh:
            raw = fh.read(header.data_start)
        digest.update(header.file.name.encode() + b"\0" + header.file_size.to_bytes(8, "little") + raw)
    return digest.hexdigest()


def build_plan(index: TensorIndex, layout: TensorLayout, spec: ConverterSpec, experts: str, dense: str,
               config_bytes: bytes) -> JobPlan:
    """Assign every source tensor a scheme and a place; raise a clear error for anything not convertible."""
    expert_scheme = BY_OPTION[experts]
    dense_scheme = BY_OPTION.get(dense)          # None for the float schemes (f32, bf16)
    skipped = tuple(layout.skipped_prefixes)
    dense_names = set(spec.dense_matrices)
    known = {*layout.embeddings, *layout.norms, *(n for _, n in layout.routers), *layout.required}
    if layout.lm_head:
        known.add(layout.lm_head)

    fallbacks: list[Fallback] = []
    expert_items: dict[int, list[tuple[int, list[Item]]]] = {}
    expert_names: set[str] = set()
    for ex in layout.experts:
        items = []
        # scales (and int4 shapes) are read with their FP8 / packed weights, never written
        consumed = fp8_source.scales_of(index, ex.tensors) | int4_source.consumed_by(index, ex.tensors)
        expert_names |= consumed
        for name in ex.tensors:
            if name in consumed:
                continue
            packed = int4_source.source_of(index, name)
            if packed is not None:
                logical, scale = packed
                item = _quant_item(logical, expert_scheme, "routed-expert", "--experts", fallbacks, scale)
                items.append(Item(item.source, item.scheme, item.quant, item.parts, scale, packed_int4=True))
                expert_names.add(name)
                continue
            if name not in index:
                raise CheckpointError(f"{index.shard_sets[0].directory}: routed-expert tensor {name!r} "
                                      "named by the family's layout is missing",
                                      "the checkpoint is incomplete, or its family plugin does not match it")
            items.append(_quant_item(index[name], expert_scheme, "routed-expert", "--experts", fallbacks,
                                     fp8_source.scale_for(index, name)))
            expert_names.add(name)
        expert_items.setdefault(ex.layer, []).append((ex.expert, items))

    plain: dict[int | None, list[Item]] = {}
    for t in index:
        if t.name in expert_names:
            continue
        floaty = t.dtype in FLOAT_SOURCE_DTYPES
        if t.name.startswith(skipped) or t.name not in known or not floaty:
            item = _float_item(t, COPY_SCHEME)
        elif t.name in dense_names and len(t.shape) == 2:
            item = (_quant_item(t, dense_scheme, "dense", "--dense", fallbacks) if dense_scheme
                    else _float_item(t, dense))
        else:
            item = _float_item(t, "f32")
        plain.setdefault(_layer_of(t.name), []).append(item)

    shards: list[ShardPlan] = []
    if None in plain:
        shards.append(ShardPlan(0, "globals", sorted(plain.pop(None), key=_alignment_key)))
    for layer in sorted({k for k in plain if k is not None} | set(expert_items)):
        items = sorted(plain.get(layer, []), key=_alignment_key)
        for _, block in sorted(expert_items.get(layer, []), key=lambda e: e[0]):
            items.extend(block)
        shards.append(ShardPlan(0, f"layer {layer}", items))
    n = len(shards)
    for i, shard in enumerate(shards, start=1):
        shard.index = i
        shard.file_name = f"model-{i:05d}-of-{n:05d}.safetensors"
    return JobPlan(shards, job_digest(index, config_bytes, experts, dense), experts, dense, fallbacks)


def source_files(index: TensorIndex) -> list[Path]:
    return [h.file for h in index.headers]
