"""Bounded-memory tensor I/O: source rows by ``pread``, output bytes produced one row chunk at a time.

Nothing here maps a whole file or holds a whole tensor: memory stays near ``CHUNK_BYTES`` (plus a tensor's scales,
1/32 of its int4 bytes at most) whatever the model's size. ``pread`` is used rather than ``np.memmap`` because
pages touched through a mapping count toward the process's RSS until it is unmapped.
"""

from __future__ import annotations

import os
from typing import Iterator

import numpy as np

from ..checkpoint import DTYPE_BYTES, TensorInfo
from . import fp8_source, int4_source
from .plan import Item
from .schemes import f32_to_bf16_bits, quantize, to_f32

CHUNK_BYTES = 8 * 1024 * 1024


def pread_exact(fd: int, size: int, offset: int, path: object) -> bytes:
    data = os.pread(fd, size, offset)
    if len(data) != size:
        # Retry short reads (allowed by POSIX); a second short read means the file shrank.
        chunks = [data]
        got = len(data)
        while got < size:
            more = os.pread(fd, size - got, offset + got)
            if not more:
                raise OSError(f"{path}: file ended at byte {offset + got}, expected {offset + size}")
            chunks.append(more)
            got += len(more)
        data = b"".join(chunks)
    return data


def pread_rows_of(fd: int, weight: TensorInfo, companion: TensorInfo, r0: int, r1: int) -> bytes:
    """Rows ``[r0, r1)`` of a weight's companion tensor (its scales), read through ``fd`` when it lives in the
    weight's file, else through a descriptor opened for the read."""
    row = companion.nbytes // companion.shape[0]
    cfd = fd if companion.file == weight.file else os.open(companion.file, os.O_RDONLY)
    try:
        return pread_exact(cfd, (r1 - r0) * row, companion.begin + r0 * row, companion.file)
    finally:
        if cfd != fd:
            os.close(cfd)


def row_bytes(t: TensorInfo) -> int:
    cols = int(np.prod(t.shape[1:])) if len(t.shape) > 1 else 1
    return int(cols * DTYPE_BYTES[t.dtype])


def row_chunks(t: TensorInfo, chunk_bytes: int = CHUNK_BYTES) -> Iterator[tuple[int, int]]:
    """Row ranges ``[r0, r1)`` of about ``chunk_bytes`` source bytes each (at least one row)."""
    rows = t.shape[0] if t.shape else 1
    step = max(1, chunk_bytes // max(1, row_bytes(t)))
    for r0 in range(0, rows, step):
        yield r0, min(rows, r0 + step)


def read_rows(fd: int, t: TensorInfo, r0: int, r1: int) -> np.ndarray:
    """Rows ``[r0, r1)`` of a 2-D float tensor as float32."""
    rb = row_bytes(t)
    raw = pread_exact(fd, (r1 - r0) * rb, t.begin + r0 * rb, t.file)
    return to_f32(raw, t.dtype, (r1 - r0, t.shape[1]))


def produce(item: Item, fd: int, chunk_bytes: int = CHUNK_BYTES) -> Iterator[tuple[bytes, int]]:
    """The output bytes of one item in file order, as (bytes, source bytes consumed) pairs."""
    t = item.source
    if item.quant is not None:
        scales = []
        source_row_bytes = t.shape[1] // 2 if item.packed_int4 else row_bytes(t)
        for r0, r1 in row_chunks(t, chunk_bytes):
            if item.packed_int4 and item.scale is not None:
                rows = int4_source.read_rows(fd, t, item.scale, r0, r1)
            else:
                rows = fp8_source.read_rows(fd, t, item.scale, r0, r1) if item.scale else read_rows(fd, t, r0, r1)
            q, s = quantize(item.quant, rows)
            scales.append(s.astype("<f2").tobytes())
            yield q.tobytes(), (r1 - r0) * source_row_bytes
        yield b"".join(scales), 0
        return
    if item.scheme == "copy" or item.parts[0].dtype == t.dtype:
        for off in range(0, t.nbytes, chunk_bytes):
            size = min(chunk_bytes, t.nbytes - off)
            yield pread_exact(fd, size, t.begin + off, t.file), size
        return
    for r0, r1 in row_chunks(t, chunk_bytes):
        rb = row_bytes(t)
        raw = pread_exact(fd, (r1 - r0) * rb, t.begin + r0 * rb, t.file)
        x = to_f32(raw, t.dtype, (-1,))
        out = x.astype("<f4") if item.parts[0].dtype == "F32" else f32_to_bf16_bits(x).astype("<u2")
        yield out.tobytes(), len(raw)
