"""Safetensors header parsing (colibri.checkpoint): good files, sharded indexes, and every malformed case."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
from colibri.checkpoint import TensorIndex, default_shard_set, read_header, read_index
from colibri.errors import CheckpointError
from safetensors.numpy import save_file


@pytest.fixture
def shard(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file({"a": np.zeros((2, 3), np.float32), "b": np.ones(5, np.float16)}, str(path), metadata={"k": "v"})
    return path


def test_read_header(shard):
    header = read_header(shard)
    tensors = {t.name: t for t in header.tensors}
    assert tensors["a"].shape == (2, 3) and tensors["a"].dtype == "F32" and tensors["a"].nbytes == 24
    assert tensors["b"].numel == 5 and tensors["b"].nbytes == 10
    assert header.metadata == {"k": "v"}
    assert all(header.data_start <= t.begin <= t.end <= header.file_size for t in header.tensors)
    # the absolute offsets point at the real bytes
    raw = shard.read_bytes()
    assert np.frombuffer(raw[tensors["b"].begin:tensors["b"].end], np.float16).tolist() == [1.0] * 5


def write_raw(path, header_bytes: bytes, data: bytes = b"", declared: int | None = None):
    n = len(header_bytes) if declared is None else declared
    path.write_bytes(struct.pack("<Q", n) + header_bytes + data)


@pytest.mark.parametrize("make, fragment", [
    (lambda p: p.write_bytes(b"\x01\x02"), "too short"),
    (lambda p: write_raw(p, b"{}", declared=10**6), "runs past the end"),
    (lambda p: write_raw(p, b"{not json"), "not valid JSON"),
    (lambda p: write_raw(p, b"[1, 2]"), "not a JSON object"),
    (lambda p: write_raw(p, b'{"t": {"dtype": "F32", "shape": [2]}}'), "malformed header entry"),
    (lambda p: write_raw(p, b"\xff\xfe"), "not valid JSON"),
])
def test_malformed_headers(tmp_path, make, fragment):
    path = tmp_path / "bad.safetensors"
    make(path)
    with pytest.raises(CheckpointError) as err:
        read_header(path)
    assert fragment in err.value.message and str(path) in err.value.message
    assert err.value.hint


def test_sharded_index(tmp_path):
    save_file({"x": np.zeros(4, np.float32)}, str(tmp_path / "m-1.safetensors"))
    save_file({"y": np.zeros(2, np.float32)}, str(tmp_path / "m-2.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"x": "m-1.safetensors", "y": "m-2.safetensors"}}))
    shards = default_shard_set(tmp_path)
    assert shards.index_file.name == "model.safetensors.index.json" and len(shards.files) == 2
    index = TensorIndex((shards,))
    assert len(index) == 2 and index.total_bytes == 24 and index.dtypes == {"F32": 2}
    (tmp_path / "m-2.safetensors").unlink()
    with pytest.raises(CheckpointError, match="shard is missing"):
        TensorIndex((shards,))


def test_bad_index(tmp_path):
    index = tmp_path / "model.safetensors.index.json"
    index.write_text("{")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        read_index(index)
    index.write_text('{"weight_map": {"x": 3}}')
    with pytest.raises(CheckpointError, match="weight_map"):
        read_index(index)


@pytest.mark.parametrize("header, fragment", [
    (b'{"t": ' + b"[" * 50_000 + b"]" * 50_000 + b"}", "nested too deeply"),
    (b'{"__metadata__": [1, 2]}', "'__metadata__' is not an object of strings"),
    (b'{"__metadata__": {"k": 3}}', "'__metadata__' is not an object of strings"),
    (b'{"t": 7}', "not an object"),
    (b'{"t": {"dtype": 3, "shape": [1], "data_offsets": [0, 4]}}', "no dtype string"),
    (b'{"t": {"dtype": "F32", "shape": [1.0], "data_offsets": [0, 4]}}', "'shape' must be"),
    (b'{"t": {"dtype": "F32", "shape": [true], "data_offsets": [0, 4]}}', "'shape' must be"),
    (b'{"t": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}', "'shape' must be"),
    (b'{"t": {"dtype": "F32", "shape": [1099511627777], "data_offsets": [0, 4]}}', "'shape' must be"),
    (b'{"t": {"dtype": "F32", "shape": [1,1,1,1,1,1,1,1,1], "data_offsets": [0, 4]}}', "'shape' must be"),
    (b'{"t": {"dtype": "F32", "shape": [1], "data_offsets": [0]}}', "'data_offsets' must be"),
    (b'{"t": {"dtype": "F32", "shape": [1], "data_offsets": [-4, 0]}}', "'data_offsets' must be"),
    (b'{"t": {"dtype": "F32", "shape": [1], "data_offsets": [0, 1180591620717411303424]}}', "'data_offsets' must be"),
    (b'{"t": {"dtype": "F32", "shape": [1], "data_offsets": [8, 4]}}', "before its begin"),
])
def test_malformed_entries_name_file_and_tensor(tmp_path, header, fragment):
    path = tmp_path / "bad.safetensors"
    write_raw(path, header, b"\0" * 8)
    with pytest.raises(CheckpointError) as err:
        read_header(path)
    assert fragment in err.value.message and str(path) in err.value.message
    assert "'t'" in err.value.message or "__metadata__" in err.value.message or "nested" in err.value.message


def test_index_names_only_files_of_its_directory(tmp_path):
    index = tmp_path / "model.safetensors.index.json"
    index.write_text('{"weight_map": {"x": "../elsewhere.safetensors"}}')
    with pytest.raises(CheckpointError, match="not a shard file name"):
        read_index(index)
    index.write_text("[" * 50_000 + "]" * 50_000)
    with pytest.raises(CheckpointError, match="nested too deeply"):
        read_index(index)
