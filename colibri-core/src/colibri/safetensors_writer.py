"""Writing safetensors files from numpy arrays, without torch (and without the safetensors package).

The format: an 8-byte little-endian header length, a JSON header of ``{name: {dtype, shape, data_offsets}}``
(padded with spaces to a multiple of 8 so tensor data stays aligned), then the raw little-endian bytes.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Iterable, Mapping

import numpy as np

DTYPE_NAMES = {np.dtype("float32"): "F32", np.dtype("float16"): "F16", np.dtype("int64"): "I64",
               np.dtype("int32"): "I32", np.dtype("uint8"): "U8"}
ALIGN = 8


def write_safetensors(path: Path, tensors: Iterable[tuple[str, np.ndarray]],
                      metadata: Mapping[str, str] | None = None) -> int:
    """Write ``tensors`` (in the given order) to ``path`` atomically; returns the file size."""
    items = [(name, np.ascontiguousarray(arr)) for name, arr in tensors]
    header: dict[str, object] = {}
    offset = 0
    for name, arr in items:
        dtype = DTYPE_NAMES.get(arr.dtype.newbyteorder("<") if arr.dtype.byteorder == ">" else arr.dtype)
        if dtype is None:
            raise ValueError(f"{name}: dtype {arr.dtype} has no safetensors name here")
        header[name] = {"dtype": dtype, "shape": list(arr.shape), "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
    if metadata:
        header["__metadata__"] = dict(metadata)
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % ALIGN)
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as fh:
            fh.write(struct.pack("<Q", len(raw)))
            fh.write(raw)
            for _, arr in items:
                fh.write(arr.astype(arr.dtype.newbyteorder("<"), copy=False).tobytes())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return 8 + len(raw) + offset
