"""Fuzzing the checkpoint readers (Hypothesis, derandomized so CI sees the same examples every run; bounded in
examples and free of the example database): the safetensors header parser with the file checks behind it, and
config.json's size-like fields through the config validation and the readers families use.

The property is the same everywhere: the input is either accepted with every value in range, or refused with a
:class:`ColibriError` naming the file; never another exception, never a value that would size a table unbounded.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from colibri import configs, validation  # noqa: E402
from colibri.checkpoint import DTYPE_BYTES, MAX_DIM, MAX_DIMS, read_header  # noqa: E402
from colibri.errors import CheckpointError, ConfigError  # noqa: E402
from colibri.model import read_config  # noqa: E402

FUZZ = settings(max_examples=300, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

json_scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-2**80, max_value=2**80),
                         st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=8))
json_values = st.recursive(json_scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                                  st.dictionaries(st.text(max_size=6), inner,
                                                                                  max_size=4)), max_leaves=12)
# Values that look like what a header entry holds, and slightly off: sizes near the limits, negatives, floats.
numbers = st.one_of(st.integers(min_value=0, max_value=64), st.integers(min_value=-2**70, max_value=2**70),
                    st.sampled_from([MAX_DIM, MAX_DIM + 1, 2**63 - 1, 2**63, 2**64]), st.floats(0, 64))
entries = st.fixed_dictionaries({}, optional={
    "dtype": st.one_of(st.sampled_from(sorted(DTYPE_BYTES)), json_scalars),
    "shape": st.one_of(st.lists(numbers, max_size=MAX_DIMS + 1), json_values),
    "data_offsets": st.one_of(st.lists(numbers, min_size=2, max_size=2), json_values),
})
headers = st.dictionaries(st.text(min_size=1, max_size=6), st.one_of(entries, json_values), max_size=5)
metadata = st.one_of(st.none(), st.dictionaries(st.text(max_size=4), st.text(max_size=4), max_size=3), json_values)


def write_shard(path: Path, header_bytes: bytes, data_len: int) -> None:
    path.write_bytes(struct.pack("<Q", len(header_bytes)) + header_bytes + b"\0" * data_len)


def assert_parses_or_names_the_file(path: Path) -> None:
    try:
        header = read_header(path)
    except CheckpointError as exc:
        assert str(path) in exc.message and exc.hint
        return
    for t in header.tensors:
        assert isinstance(t.dtype, str) and len(t.shape) <= MAX_DIMS
        assert all(isinstance(d, int) and 0 <= d <= MAX_DIM for d in t.shape)
        assert header.data_start <= t.begin <= t.end
    checks = validation.file_checks([header])      # the checks behind info, run and convert
    assert all(str(path) in p for check in checks for p in check.problems)
    failed = any(c.status == validation.FAIL for c in checks)
    try:
        validation.require(checks)
    except CheckpointError as exc:
        assert failed and str(path) in exc.message
    else:
        assert not failed


@FUZZ
@given(header=headers, meta=metadata, data_len=st.integers(0, 256))
def test_fuzz_structured_headers(tmp_path, header, meta, data_len):
    if meta is not None:
        header = {**header, "__metadata__": meta}
    path = tmp_path / "model.safetensors"
    write_shard(path, json.dumps(header).encode(), data_len)
    assert_parses_or_names_the_file(path)


@FUZZ
@given(raw=st.binary(max_size=512), declared=st.one_of(st.none(), st.integers(0, 2**64 - 1)))
def test_fuzz_raw_bytes(tmp_path, raw, declared):
    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw) if declared is None else declared) + raw)
    assert_parses_or_names_the_file(path)


@settings(max_examples=20, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(depth=st.integers(1, 200_000), opener=st.sampled_from(["[", '{"a":']))
def test_fuzz_nesting_depth(tmp_path, depth, opener):
    closer = "]" if opener == "[" else "}"
    path = tmp_path / "model.safetensors"
    write_shard(path, ('{"t": ' + opener * depth + "1" + closer * depth + "}").encode(), 0)
    assert_parses_or_names_the_file(path)


# ---------------------------------------------------------------------------------------------- config.json

SIZE_FIELDS = sorted(configs.SIZE_BOUNDS)
FLOAT_FIELDS = sorted(configs.FLOAT_BOUNDS)
field_values = st.one_of(json_scalars, st.integers(0, 2**20), st.sampled_from([1e9, 1e5, 2**31, -1, 0.5, "x"]),
                         st.lists(st.integers(0, 4), max_size=3))
configs_ = st.dictionaries(st.sampled_from(SIZE_FIELDS + FLOAT_FIELDS + list(configs.BOOL_FIELDS)), field_values,
                           max_size=8)


@FUZZ
@given(fields=configs_, nested=st.booleans())
def test_fuzz_config_fields(tmp_path, fields, nested):
    config = {"model_type": "x", **({"text_config": fields} if nested else fields)}
    (tmp_path / "config.json").write_text(json.dumps(config))
    try:
        read = read_config(tmp_path)
    except ConfigError as exc:
        assert str(tmp_path / "config.json") in exc.message
        assert any(repr(name) in exc.message for name in fields), exc.message
        return
    cfg = configs.text_config(read)
    for name, top in configs.SIZE_BOUNDS.items():      # everything a family may size from is a bounded integer
        value = cfg.get(name)
        if value is not None:
            assert float(value).is_integer() and 0 <= value <= top
            assert configs.require_int(cfg, name) == int(value)
    for name in configs.FLOAT_BOUNDS:
        value = cfg.get(name)
        if value is not None:
            assert math.isfinite(configs.require_number(cfg, name, 1.0))
    experts, top_k = configs.first_of(cfg, *configs.EXPERT_COUNT_FIELDS), configs.first_of(cfg, *configs.TOP_K_FIELDS)
    if experts and top_k:
        assert top_k <= experts
