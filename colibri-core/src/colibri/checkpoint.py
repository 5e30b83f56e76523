"""Reading safetensors checkpoints from their headers alone.

A safetensors file is an 8-byte little-endian header length, a JSON header mapping tensor names to
``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets relative to the end of the header), then the data.
Sharded checkpoints add ``model.safetensors.index.json`` whose ``weight_map`` names the shard of each tensor.

Nothing here reads weight bytes: ``info``, ``plan`` and ``doctor`` work on a 700 GB checkpoint in milliseconds.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from .errors import CheckpointError
from .records import ShardSet

DTYPE_BYTES: dict[str, float] = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
    "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "U16": 2, "U32": 4, "U64": 8, "F4": 0.5, "F6_E2M3": 0.75,
    "F6_E3M2": 0.75,
}

MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors reference implementation's own limit
LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")   # the HF decoder naming: model.layers.<i>.<...>
MAX_DIMS = 8                          # the C runtime's CB_MAX_DIMS
MAX_DIM = 1 << 40                     # per dimension, as the C runtime accepts
MAX_OFFSET = (1 << 63) - 1            # a file offset (off_t); larger is not a position in any file


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: file, dtype, shape and absolute byte range ``[begin, end)`` in the file."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    file: Path
    begin: int
    end: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class ShardHeader:
    """The parsed header of one safetensors file."""

    file: Path
    file_size: int
    data_start: int                       # absolute offset where tensor data begins
    tensors: tuple[TensorInfo, ...]
    metadata: dict[str, str]


def read_header(path: Path) -> ShardHeader:
    """Parse one safetensors header, raising :class:`CheckpointError` naming the file on anything malformed."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as fh:
            raw_len = fh.read(8)
            if len(raw_len) < 8:
                raise CheckpointError(f"{path}: file is {size} bytes, too short for a safetensors header",
                                      "the shard is truncated; download it again")
            (header_len,) = struct.unpack("<Q", raw_len)
            if header_len > MAX_HEADER_BYTES or 8 + header_len > size:
                raise CheckpointError(
                    f"{path}: header length {header_len} runs past the end of the {size}-byte file",
                    "the shard is truncated or not safetensors; download it again")
            header_bytes = fh.read(header_len)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read ({exc.strerror})", "check the path and permissions") from None
    try:
        header = json.loads(header_bytes.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: safetensors header is not valid JSON ({exc})",
                              "the shard is corrupted; download it again") from None
    except RecursionError:
        raise CheckpointError(f"{path}: safetensors header is nested too deeply to be a tensor table",
                              "the shard is corrupted; download it again") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: safetensors header is not a JSON object", "the shard is corrupted")
    data_start = 8 + header_len
    metadata = header.pop("__metadata__", None)
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointError(f"{path}: safetensors header's '__metadata__' is not an object of strings",
                              "the shard is corrupted; download it again")
    tensors = [_tensor_entry(path, name, entry, data_start) for name, entry in header.items()]
    return ShardHeader(Path(path), size, data_start, tuple(tensors), dict(metadata))


def _is_count(value: object, top: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= top


def _tensor_entry(path: Path, name: str, entry: object, data_start: int) -> TensorInfo:
    """One ``{"dtype", "shape", "data_offsets"}`` entry, its types and ranges checked: integers only (no floats,
    no booleans), dimensions and offsets within :data:`MAX_DIM` / :data:`MAX_OFFSET`. Whether the bytes fit the
    file, match shape x dtype or overlap is colibri.validation's business (doctor lists every such problem)."""
    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"{path}: tensor {name!r} has a malformed header entry ({what})",
                               "the shard is corrupted; download it again")

    if not isinstance(entry, dict):
        raise bad("not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or not dtype or len(dtype) > 32:
        raise bad("no dtype string")
    if not isinstance(shape, list) or len(shape) > MAX_DIMS or not all(_is_count(d, MAX_DIM) for d in shape):
        raise bad(f"'shape' must be a list of at most {MAX_DIMS} integers from 0 to {MAX_DIM}")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_count(o, MAX_OFFSET) for o in offsets):
        raise bad(f"'data_offsets' must be two integers from 0 to {MAX_OFFSET}")
    begin, end = offsets
    if end < begin:
        raise bad(f"'data_offsets' end {end} is before its begin {begin}")
    return TensorInfo(name, dtype, tuple(shape), Path(path), data_start + begin, data_start + end)


def default_shard_set(directory: Path, prefix: str = "") -> ShardSet | None:
    """The shard set of a plain HF directory: its ``*.safetensors.index.json``, else its ``*.safetensors``."""
    indexes = sorted(directory.glob("*.safetensors.index.json"))
    if indexes:
        index_file = indexes[0]
        weight_map = read_index(index_file)
        files = tuple(directory / f for f in dict.fromkeys(sorted(set(weight_map.values()))))
        return ShardSet(directory, files, index_file, prefix)
    files = tuple(sorted(directory.glob("*.safetensors")))
    return ShardSet(directory, files, None, prefix) if files else None


def read_index(index_file: Path) -> dict[str, str]:
    """The ``weight_map`` of a sharded checkpoint's index file."""
    try:
        if index_file.stat().st_size > MAX_HEADER_BYTES:
            raise CheckpointError(f"{index_file}: larger than {MAX_HEADER_BYTES} bytes, not an index",
                                  "restore the index file")
        data = json.loads(index_file.read_text(encoding="utf-8"))
    except OSError as exc:
        raise CheckpointError(f"{index_file}: cannot read ({exc.strerror})", "check the path") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{index_file}: not valid JSON ({exc})", "restore the index file") from None
    except RecursionError:
        raise CheckpointError(f"{index_file}: JSON nested too deeply", "restore the index file") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{index_file}: has no 'weight_map' of tensor name -> shard file",
                              "restore the index file")
    for name, file in weight_map.items():
        if not file or "/" in file or "\\" in file or file.startswith("."):
            raise CheckpointError(f"{index_file}: weight_map[{name!r}] is {file!r}, not a shard file name in the "
                                  "directory", "restore the index file")
    return weight_map


class TensorIndex:
    """Every tensor of a checkpoint (all shard sets), by name, read from the headers only."""

    def __init__(self, shard_sets: tuple[ShardSet, ...]):
        self.shard_sets = shard_sets
        self.headers: list[ShardHeader] = []
        self.tensors: dict[str, TensorInfo] = {}
        self.index_maps: list[tuple[ShardSet, dict[str, str]]] = []
        for shard_set in shard_sets:
            weight_map = read_index(shard_set.index_file) if shard_set.index_file else None
            if weight_map is not None:
                self.index_maps.append((shard_set, weight_map))
            for file in shard_set.files:
                if not file.exists():
                    where = f" (listed in {shard_set.index_file.name})" if shard_set.index_file else ""
                    raise CheckpointError(f"{file}: shard is missing{where}",
                                          "download the missing shard or restore the index")
                header = read_header(file)
                self.headers.append(header)
                for t in header.tensors:
                    name = shard_set.prefix + t.name
                    if name in self.tensors:
                        raise CheckpointError(f"{file}: tensor {t.name!r} also appears in {self.tensors[name].file}",
                                              "remove the duplicate shard")
                    self.tensors[name] = TensorInfo(name, t.dtype, t.shape, t.file, t.begin, t.end)

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def __getitem__(self, name: str) -> TensorInfo:
        return self.tensors[name]

    def __iter__(self) -> Iterator[TensorInfo]:
        return iter(self.tensors.values())

    def __len__(self) -> int:
        return len(self.tensors)

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    @property
    def dtypes(self) -> dict[str, int]:
        """Tensor count per dtype."""
        out: dict[str, int] = {}
        for t in self.tensors.values():
            out[t.dtype] = out.get(t.dtype, 0) + 1
        return out
