"""Bounded-memory tensor I/O: source rows by ``pread``, output bytes produced one row chunk at a time.

Nothing here maps a whole file or holds a whole tensor: memory stays near ``CHUNK_BYTES`` (plus a tensor's scales,
1/32 of its int4 bytes at most) whatever the model's size. ``pread`` is used rather than ``np.memmap`` because
pages touched through a mapping count toward the process's RSS until it is unmapped.
"""

from __future__ import annotations

import os
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Iterator

import numpy as np

from ..checkpoint import DTYPE_BYTES, TensorInfo
from . import fast_quant, fp8_source, int4_source
from .plan import Item
from .schemes import f32_to_bf16_bits, to_f32

CHUNK_BYTES = 8 * 1024 * 1024
# Quantized tensors go through in chunks of about this many values, each read, decoded and quantized by one worker
# thread (numpy and pread release the GIL) while the caller writes and hashes the chunks before it: small enough
# that a chunk's float copies stay in the core's cache and an expert matrix splits into enough chunks to keep every
# worker busy, large enough that the per-chunk Python work is noise.
QUANT_CHUNK_VALUES = 1 << 18
QUANT_WORKERS = max(1, min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else
                           (os.cpu_count() or 1)))
_pool: ThreadPoolExecutor | None = None


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


def _workers() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(QUANT_WORKERS, thread_name_prefix="coli-convert")
    return _pool


def source_rows(item: Item, fd: int, r0: int, r1: int) -> np.ndarray:
    """Rows ``[r0, r1)`` of a quantized item's source as the f32 values it stands for: a float source as is, an FP8
    one dequantized with its block scales, a packed int4 one with its group scales. The converter and
    ``--verify`` both read through here, so they agree on what the source holds."""
    t = item.source
    if item.packed_int4 and item.scale is not None:
        return int4_source.read_rows(fd, t, item.scale, r0, r1)
    return fp8_source.read_rows(fd, t, item.scale, r0, r1) if item.scale else read_rows(fd, t, r0, r1)


def _quant_chunk(item: Item, fd: int, r0: int, r1: int) -> tuple[bytes, bytes]:
    """(qweight bytes, scale bytes) of rows ``[r0, r1)`` of a quantized item."""
    rows = source_rows(item, fd, r0, r1)
    assert item.quant is not None
    q, s = fast_quant.quantize(item.quant, rows)
    return q.tobytes(), s.astype("<f2").tobytes()


def _quantized(item: Item, fd: int, chunk_bytes: int) -> Iterator[tuple[bytes, int]]:
    """A quantized item's qweight chunks in row order, then its scales: chunks computed ahead on the workers, at
    most two per worker in flight (bounded memory)."""
    t = item.source
    source_row_bytes = t.shape[1] // 2 if item.packed_int4 else row_bytes(t)
    step = max(1, min(chunk_bytes // max(1, row_bytes(t)), QUANT_CHUNK_VALUES // max(1, t.shape[1])))
    ranges = ((r0, min(t.shape[0], r0 + step)) for r0 in range(0, t.shape[0], step))
    pool = _workers()
    pending: deque[tuple[tuple[int, int], Future[tuple[bytes, bytes]]]] = deque()
    scales: list[bytes] = []
    try:
        while True:
            while len(pending) < 2 * QUANT_WORKERS:
                r = next(ranges, None)
                if r is None:
                    break
                pending.append((r, pool.submit(_quant_chunk, item, fd, *r)))
            if not pending:
                break
            (r0, r1), future = pending.popleft()
            q, s = future.result()
            scales.append(s)
            yield q, (r1 - r0) * source_row_bytes
    finally:
        # The consumer stopped early (an error): drop the work ahead, and let the chunks already running finish
        # before the caller closes the descriptor they read from.
        for _, future in pending:
            future.cancel()
        wait([future for _, future in pending])
    yield b"".join(scales), 0


def produce(item: Item, fd: int, chunk_bytes: int = CHUNK_BYTES) -> Iterator[tuple[bytes, int]]:
    """The output bytes of one item in file order, as (bytes, source bytes consumed) pairs."""
    t = item.source
    if item.quant is not None:
        yield from _quantized(item, fd, chunk_bytes)
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
