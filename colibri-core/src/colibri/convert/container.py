"""The colibri-quant container: its stamp, its naming rules, and the reader that validates both.

A container is an ordinary sharded safetensors checkpoint (``model-0000k-of-0000n.safetensors`` plus
``model.safetensors.index.json``) whose every shard states its format in ``__metadata__``; docs/formats.md is the
normative description. The format is never inferred from byte counts or tensor names: a shard without the stamp
is a native checkpoint, and a stamp this code does not know is refused.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..checkpoint import ShardHeader, TensorInfo, default_shard_set, read_header, read_index
from ..errors import CheckpointError
from .schemes import COPY_SCHEME, FLOAT_SCHEMES, INT4, QUANT_SCHEMES, Scheme

CONTAINER_NAME = "colibri-quant"
CONTAINER_VERSION = "1"
KEY_CONTAINER = "colibri.container"
KEY_VERSION = "colibri.version"
KEY_SCHEMES = "colibri.schemes"
KEY_JOB = "colibri.job"              # index metadata only: digest of the source headers and the options
INDEX_NAME = "model.safetensors.index.json"
QWEIGHT_SUFFIX = ".qweight"
SCALES_SUFFIX = ".scales"
SCALES_DTYPE = "F16"


class ContainerError(CheckpointError):
    """A colibri-quant container whose stamp is unknown or disagrees with what the shard holds."""


def stored_base(logical: str) -> str:
    """``x.weight`` -> ``x``: the prefix of a quantized tensor's ``.qweight``/``.scales`` pair."""
    return logical[: -len(".weight")] if logical.endswith(".weight") else logical


def qweight_name(logical: str) -> str:
    return stored_base(logical) + QWEIGHT_SUFFIX


def scales_name(logical: str) -> str:
    return stored_base(logical) + SCALES_SUFFIX


def shard_metadata(schemes: dict[str, str]) -> dict[str, str]:
    """The ``__metadata__`` of one container shard (``format: pt`` keeps transformers' loaders content)."""
    return {
        "format": "pt",
        KEY_CONTAINER: CONTAINER_NAME,
        KEY_VERSION: CONTAINER_VERSION,
        KEY_SCHEMES: json.dumps(schemes, sort_keys=True, separators=(",", ":")),
    }


@dataclass(frozen=True)
class StoredTensor:
    """One logical (source) tensor as a container holds it."""

    name: str                           # the source name, e.g. "model.layers.0.mlp.experts.3.up_proj.weight"
    scheme: str                         # "int8-row", "int4-g64", "f32", "bf16" or "copy"
    shape: tuple[int, ...]              # the logical shape
    parts: tuple[TensorInfo, ...]       # (qweight, scales) when quantized, else (data,)

    @property
    def quant(self) -> Scheme | None:
        return QUANT_SCHEMES.get(self.scheme)

    @property
    def begin(self) -> int:
        return min(p.begin for p in self.parts)

    @property
    def end(self) -> int:
        return max(p.end for p in self.parts)

    @property
    def file(self) -> Path:
        return self.parts[0].file


@dataclass(frozen=True)
class Container:
    directory: Path
    version: str
    job: str
    tensors: dict[str, StoredTensor]
    headers: tuple[ShardHeader, ...]

    def extent(self, names: tuple[str, ...]) -> tuple[Path, int, int]:
        """The one byte range ``[begin, end)`` of one file that holds exactly these tensors (an expert's block).

        Raises :class:`ContainerError` when they are split across files or have foreign bytes between them.
        """
        parts = sorted((p for n in names for p in self._get(n).parts), key=lambda p: (str(p.file), p.begin))
        files = {p.file for p in parts}
        if len(files) != 1:
            raise ContainerError(f"{self.directory}: tensors {names[0]}... are split across {len(files)} shards",
                                 "reconvert the model with `coli convert`")
        for a, b in zip(parts, parts[1:]):
            if a.end != b.begin:
                raise ContainerError(f"{a.file}: {a.name} and {b.name} are not adjacent (bytes {a.end}..{b.begin})",
                                     "reconvert the model with `coli convert`")
        return parts[0].file, parts[0].begin, parts[-1].end

    def _get(self, name: str) -> StoredTensor:
        try:
            return self.tensors[name]
        except KeyError:
            raise ContainerError(f"{self.directory}: the container has no tensor {name!r}",
                                 "reconvert the model with `coli convert`") from None


def _shard_files(directory: Path) -> tuple[tuple[Path, ...], Path | None]:
    shard_set = default_shard_set(directory)
    if shard_set is None:
        return (), None
    return shard_set.files, shard_set.index_file


def is_stamped(header: ShardHeader) -> bool:
    return KEY_CONTAINER in header.metadata or KEY_VERSION in header.metadata or KEY_SCHEMES in header.metadata


def _check_stamp(header: ShardHeader) -> dict[str, str]:
    meta, path = header.metadata, header.file
    name = meta.get(KEY_CONTAINER)
    if name != CONTAINER_NAME:
        raise ContainerError(f"{path}: __metadata__ {KEY_CONTAINER}={name!r} is not a format colibri knows",
                             f"expected {CONTAINER_NAME!r}; convert the source checkpoint with `coli convert`")
    version = meta.get(KEY_VERSION)
    if version != CONTAINER_VERSION:
        raise ContainerError(f"{path}: {CONTAINER_NAME} version {version!r} is not supported "
                             f"(this colibri reads version {CONTAINER_VERSION})",
                             "upgrade colibri, or reconvert with this one")
    try:
        schemes = json.loads(meta.get(KEY_SCHEMES, ""))
    except json.JSONDecodeError:
        schemes = None
    if not isinstance(schemes, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                for k, v in schemes.items()):
        raise ContainerError(f"{path}: __metadata__ {KEY_SCHEMES} is not a JSON object of tensor -> scheme",
                             "the shard is corrupted; reconvert the model")
    return schemes


def _resolve_shard(header: ShardHeader, schemes: dict[str, str]) -> list[StoredTensor]:
    path = header.file
    stored = {t.name: t for t in header.tensors}
    used: set[str] = set()
    out = []

    def bad(msg: str) -> ContainerError:
        return ContainerError(f"{path}: {msg}", "the shard is corrupted or hand-edited; reconvert the model")

    def take(name: str, logical: str) -> TensorInfo:
        if name not in stored:
            raise bad(f"tensor {logical!r} is marked {schemes[logical]!r} but {name!r} is missing")
        if name in used:
            raise bad(f"tensor {name!r} is claimed twice by the scheme map")
        used.add(name)
        return stored[name]

    for logical, scheme_name in sorted(schemes.items()):
        quant = QUANT_SCHEMES.get(scheme_name)
        if quant is not None:
            qw, sc = take(qweight_name(logical), logical), take(scales_name(logical), logical)
            if qw.dtype != quant.qdtype or len(qw.shape) != 2:
                raise bad(f"{qw.name} is {qw.dtype}{list(qw.shape)}, scheme {scheme_name} stores 2-D {quant.qdtype}")
            rows, qcols = qw.shape
            cols = qcols * 2 if quant is INT4 else qcols
            if quant.check_cols(cols) or sc.dtype != SCALES_DTYPE or sc.shape != quant.scales_shape(rows, cols):
                raise bad(f"{sc.name} is {sc.dtype}{list(sc.shape)}, scheme {scheme_name} on a [{rows}, {cols}] "
                          f"matrix stores {SCALES_DTYPE}{list(quant.scales_shape(rows, cols))}")
            out.append(StoredTensor(logical, scheme_name, (rows, cols), (qw, sc)))
        elif scheme_name in FLOAT_SCHEMES or scheme_name == COPY_SCHEME:
            data = take(logical, logical)
            want = FLOAT_SCHEMES.get(scheme_name)
            if want is not None and data.dtype != want:
                raise bad(f"{logical} is {data.dtype} but its scheme {scheme_name!r} stores {want}")
            out.append(StoredTensor(logical, scheme_name, data.shape, (data,)))
        else:
            raise ContainerError(f"{path}: tensor {logical!r} has unknown scheme {scheme_name!r}",
                                 "upgrade colibri, or reconvert with this one")
    strays = sorted(set(stored) - used)
    if strays:
        raise bad(f"tensor {strays[0]!r} is not named in the {KEY_SCHEMES} map")
    return out


def open_container(directory: Path) -> Container | None:
    """Validate and describe the container in ``directory``; ``None`` for a native (unstamped) checkpoint.

    Raises :class:`ContainerError` for an unknown or inconsistent stamp, or a mix of stamped and plain shards.
    """
    directory = Path(directory)
    files, index_file = _shard_files(directory)
    headers = tuple(read_header(f) for f in files)
    stamped = [h for h in headers if is_stamped(h)]
    if not stamped:
        return None
    if len(stamped) != len(headers):
        plain = next(h for h in headers if not is_stamped(h))
        raise ContainerError(f"{plain.file}: shard has no {CONTAINER_NAME} stamp while {stamped[0].file.name} has",
                             "the directory mixes a container with plain shards; reconvert into an empty directory")
    tensors: dict[str, StoredTensor] = {}
    for header in headers:
        for t in _resolve_shard(header, _check_stamp(header)):
            if t.name in tensors:
                raise ContainerError(f"{header.file}: tensor {t.name!r} also appears in {tensors[t.name].file}",
                                     "remove the duplicate shard")
            tensors[t.name] = t
    job = ""
    if index_file is not None:
        index_meta = _index_metadata(index_file)
        if index_meta.get(KEY_CONTAINER) != CONTAINER_NAME or index_meta.get(KEY_VERSION) != CONTAINER_VERSION:
            raise ContainerError(f"{index_file}: metadata does not carry the {CONTAINER_NAME} "
                                 f"version {CONTAINER_VERSION} stamp its shards carry",
                                 "the index is from another checkpoint; reconvert the model")
        job = str(index_meta.get(KEY_JOB, ""))
        weight_map = read_index(index_file)
        for header in headers:
            for info in header.tensors:
                if weight_map.get(info.name) != header.file.name:
                    raise ContainerError(f"{index_file}: weight_map puts {info.name!r} in "
                                         f"{weight_map.get(info.name)!r}, it is in {header.file.name}",
                                         "the index is stale; reconvert the model")
    return Container(directory, CONTAINER_VERSION, job, tensors, headers)


def _index_metadata(index_file: Path) -> dict:
    try:
        data = json.loads(index_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ContainerError(f"{index_file}: cannot read ({exc})", "restore the index file") from None
    meta = data.get("metadata") if isinstance(data, dict) else None
    return meta if isinstance(meta, dict) else {}
