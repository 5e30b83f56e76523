"""PNG files from uint8 pixels with the standard library (zlib), written atomically."""

from __future__ import annotations

import os
import struct
import tempfile
import zlib
from pathlib import Path

import numpy as np


def encode_png(pixels: np.ndarray) -> bytes:
    """An 8-bit RGB (H x W x 3) or RGBA (H x W x 4) image as PNG bytes (filter 0 per row)."""
    if pixels.dtype != np.uint8 or pixels.ndim != 3 or pixels.shape[2] not in (3, 4):
        raise ValueError("encode_png takes an H x W x 3|4 uint8 array")
    h, w, c = pixels.shape
    raw = np.concatenate([np.zeros((h, 1), np.uint8), pixels.reshape(h, w * c)], axis=1).tobytes()

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", w, h, 8, 2 if c == 3 else 6, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 6)) + chunk(b"IEND", b"")


def write_png(path: Path, pixels: np.ndarray) -> None:
    """Write the PNG next to ``path`` and rename it into place, so no half-written file is ever seen."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=str(path.parent or Path(".")))
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(encode_png(pixels))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
