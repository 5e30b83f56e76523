"""Corrupted and hostile checkpoints against the checkpoint readers (``info``, ``doctor --deep``, ``run``,
``serve``, ``convert``), through the CLI application the ``coli`` script runs, in a child process under an address-space
limit and a time limit.

Every class ends in exit 1 and ONE ``error:`` line naming the file and the field or tensor at fault: no
traceback, no signal, no MemoryError, and ``convert`` writes nothing. ``info`` summarises what the headers say,
so it refuses the classes that make its numbers meaningless (config fields, header entries, byte ranges) and
leaves layout, shape and tokenizer classes to ``doctor --deep``, which ``convert`` obeys and ``run``/``serve``
share (a broken chat template is refused by ``run`` when it renders the prompt; ``serve`` answers it per request).
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("colibri_olmoe")

from colibri.testing.tiny import tiny_model

ADDRESS_SPACE = 2 << 30          # the whole child (interpreter, numpy, tokenizers) runs in 2 GiB of address space
TIMEOUT = 300                    # for every case and command together
ALL = ("info", "doctor", "run", "serve", "convert")
DEEP = ("doctor", "run", "serve", "convert")     # what info does not judge: roles, shapes, tokenizer
SHARD = "model.safetensors"
GATE = "model.layers.0.mlp.experts.3.gate_proj.weight"
NORM = "model.norm.weight"
PAST_END = "past the end|ends at byte"      # "a|b": either wording (doctor's shard check says the latter)


def edit_config(**fields):
    def apply(d: Path) -> None:
        config = json.loads((d / "config.json").read_text())
        config.update(fields)
        (d / "config.json").write_text(json.dumps(config))
    return apply


def split_shard(d: Path) -> tuple[dict, bytes]:
    raw = (d / SHARD).read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def write_shard(d: Path, header_bytes: bytes, data: bytes) -> None:
    header_bytes += b" " * (-len(header_bytes) % 8)
    (d / SHARD).write_bytes(struct.pack("<Q", len(header_bytes)) + header_bytes + data)


def edit_header(change):
    def apply(d: Path) -> None:
        header, data = split_shard(d)
        change(header)
        write_shard(d, json.dumps(header).encode(), data)
    return apply


def set_entry(name: str, **fields):
    return edit_header(lambda h: h[name].update(fields))


def drop_tensor(name: str):
    return edit_header(lambda h: h.pop(name))


def overlap(h: dict) -> None:
    h["model.layers.0.mlp.experts.1.up_proj.weight"]["data_offsets"] = list(h[GATE]["data_offsets"])


def transpose(h: dict) -> None:
    h[GATE]["shape"] = h[GATE]["shape"][::-1]


def nest_header(d: Path) -> None:
    _, data = split_shard(d)
    write_shard(d, b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", data)


def metadata_list(d: Path) -> None:
    header, data = split_shard(d)
    header["__metadata__"] = ["format", "pt"]
    write_shard(d, json.dumps(header).encode(), data)


def truncate_data(d: Path) -> None:
    shard = d / SHARD
    shard.write_bytes(shard.read_bytes()[:-4096])


def huge_header_length(d: Path) -> None:
    raw = (d / SHARD).read_bytes()
    (d / SHARD).write_bytes(struct.pack("<Q", 2**62) + raw[8:])


def write_file(name: str, text: str):
    return lambda d: (d / name).write_text(text)


def truncate_tokenizer(d: Path) -> None:
    text = (d / "tokenizer.json").read_text()
    (d / "tokenizer.json").write_text(text[: len(text) // 2])


def broken_template(d: Path) -> None:
    path = d / "tokenizer_config.json"
    data = json.loads(path.read_text())
    data["chat_template"] = "{% for m in messages %}{{ m['content'] }"
    path.write_text(json.dumps(data))


# (id, damage, commands that must refuse it, fragments the error line must hold)
CASES = [
    ("layers-1e9", edit_config(num_hidden_layers=1e9), ALL, ("config.json", "'num_hidden_layers'")),
    ("layers-1e5", edit_config(num_hidden_layers=100_000), ALL, ("config.json", "'num_hidden_layers'")),
    ("layers-past-disk", edit_config(num_hidden_layers=1000), ALL, ("config.json", "'num_hidden_layers'", "2 layers")),
    ("experts-past-disk", edit_config(num_experts=4096), ALL, ("config.json", "'num_experts'")),
    ("vocab-1e12", edit_config(vocab_size=10**12), ALL, ("config.json", "'vocab_size'")),
    ("heads-string", edit_config(num_attention_heads="4"), ALL, ("config.json", "'num_attention_heads'")),
    ("top-k-past-experts", edit_config(num_experts_per_tok=20), ALL, ("config.json", "'num_experts_per_tok'")),
    ("eps-string", edit_config(rms_norm_eps="x"), ALL, ("config.json", "'rms_norm_eps'")),
    ("tie-string", edit_config(tie_word_embeddings="no"), ALL, ("config.json", "'tie_word_embeddings'")),
    ("hidden-contradicts-shapes", edit_config(hidden_size=32), DEEP, (SHARD, "config.json", "shape")),
    ("vocab-contradicts-shapes", edit_config(vocab_size=256), DEEP, (SHARD, "model.embed_tokens.weight")),
    ("nested-header", nest_header, ALL, (SHARD, "nested too deeply")),
    ("metadata-not-object", metadata_list, ALL, (SHARD, "__metadata__")),
    ("overlapping-offsets", edit_header(overlap), ALL, (SHARD, "overlaps", GATE)),
    ("offset-2^70", set_entry(GATE, data_offsets=[2**70, 2**70 + 8192]), ALL, (SHARD, GATE, "data_offsets")),
    ("offset-past-end", set_entry(GATE, data_offsets=[10**9, 10**9 + 8192]), ALL, (SHARD, GATE, PAST_END)),
    ("negative-offset", set_entry(GATE, data_offsets=[-8, 8184]), ALL, (SHARD, GATE, "data_offsets")),
    ("end-before-begin", set_entry(GATE, data_offsets=[8192, 0]), ALL, (SHARD, GATE, "data_offsets")),
    ("float-shape", set_entry(GATE, shape=[32.0, 64]), ALL, (SHARD, GATE, "shape")),
    ("huge-dim", set_entry(GATE, shape=[2**50, 64]), ALL, (SHARD, GATE, "shape")),
    ("shape-not-list", set_entry(GATE, shape="32x64"), ALL, (SHARD, GATE, "shape")),
    ("unknown-dtype", set_entry(GATE, dtype="Q7"), ALL, (SHARD, GATE, "dtype")),
    ("size-mismatch", set_entry(NORM, shape=[65]), ALL, (SHARD, NORM, "bytes")),
    ("entry-not-object", edit_header(lambda h: h.update({NORM: 7})), ALL, (SHARD, NORM)),
    ("truncated-data", truncate_data, ALL, (SHARD, PAST_END)),
    ("huge-header-length", huge_header_length, ALL, (SHARD, "header length")),
    ("missing-norm", drop_tensor(NORM), DEEP, ("olmoe", NORM, "missing")),
    ("missing-router", drop_tensor("model.layers.1.mlp.gate.weight"), DEEP, ("model.layers.1.mlp.gate.weight",)),
    ("transposed-expert", edit_header(transpose), DEEP, (SHARD, GATE, "transposed")),
    ("tokenizer-garbage", write_file("tokenizer.json", "\x00garbage{{"), DEEP, ("tokenizer.json",)),
    ("tokenizer-empty", write_file("tokenizer.json", ""), DEEP, ("tokenizer.json",)),
    ("tokenizer-truncated", truncate_tokenizer, DEEP, ("tokenizer.json",)),
    ("chat-template-broken", broken_template, ("doctor", "convert", "run"), ("chat template",)),
]

DRIVER = r"""
import json, sys
from typer.testing import CliRunner
from colibri.cli import app

runner = CliRunner()
results = []
for args in json.load(sys.stdin):
    r = runner.invoke(app, args)
    crash = r.exception if r.exception is not None and not isinstance(r.exception, SystemExit) else None
    results.append({"code": r.exit_code, "stderr": r.stderr, "crash": repr(crash) if crash else None})
print(json.dumps(results))
"""


def command_args(command: str, directory: Path, out: Path) -> list[str]:
    return {"info": ["info", "--model", str(directory)],
            "doctor": ["doctor", "--deep", "--model", str(directory)],
            "run": ["run", "Hello", "--model", str(directory), "--max-tokens", "2"],
            # the engine is prepared (and refused) before the port is bound; port 1 is never reached
            "serve": ["serve", "--model", str(directory), "--port", "1"],
            "convert": ["convert", "--model", str(directory), "--out", str(out)]}[command]


def limit_address_space() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    """Every (case, command) run once in one child process under the limits: {(case, command): result}."""
    root = tmp_path_factory.mktemp("hostile")
    source = tiny_model("olmoe", root / "tiny", seed=5).path
    jobs, keys = [], []
    for case_id, damage, commands, _ in CASES:
        directory = root / case_id / "olmoe"
        shutil.copytree(source, directory)
        damage(directory)
        for command in commands:
            jobs.append(command_args(command, directory, root / case_id / f"out-{command}"))
            keys.append((case_id, command))
    empty_cache = root / "cache"
    empty_cache.mkdir()
    # No compiler and an empty build cache: a run that wrongly got past validation fails naming COLIBRI_CC
    # instead of building an engine.
    env = {**os.environ, "COLIBRI_LOAD_PLUGINS": "olmoe", "COLIBRI_CC": "/nonexistent", "NO_COLOR": "1",
           "COLIBRI_CACHE": str(empty_cache), "HF_HUB_OFFLINE": "1", "COLUMNS": "400"}
    env.pop("COLI_DEBUG", None)
    proc = subprocess.run([sys.executable, "-c", DRIVER], input=json.dumps(jobs), capture_output=True, text=True,
                          env=env, timeout=TIMEOUT, preexec_fn=limit_address_space, check=False)
    assert proc.returncode == 0, f"the readers' child died (rc {proc.returncode}): {proc.stderr[-2000:]}"
    return root, dict(zip(keys, json.loads(proc.stdout)))


@pytest.mark.parametrize("case_id, command, fragments",
                         [(c, cmd, f) for c, _, cmds, f in CASES for cmd in cmds])
def test_hostile_checkpoint_is_refused_in_one_line(outcomes, case_id, command, fragments):
    root, results = outcomes
    result = results[(case_id, command)]
    assert result["crash"] is None, result
    assert result["code"] == 1, result
    lines = [line for line in result["stderr"].splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result["stderr"]
    assert "Traceback" not in result["stderr"] and "internal error" not in lines[0], lines[0]
    for fragment in fragments:
        assert any(f in lines[0] for f in fragment.split("|")), (fragment, lines[0])
    if command == "convert":
        out = root / case_id / "out-convert"
        assert not out.exists() or not any(out.iterdir()), f"convert wrote into {out}"


# ---------------------------------------------------------------------------------------------- config fuzzing

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

OLMOE_FIELDS = ("num_hidden_layers", "num_experts", "num_experts_per_tok", "hidden_size", "intermediate_size",
                "vocab_size", "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
                "rms_norm_eps", "tie_word_embeddings", "norm_topk_prob", "clip_qkv", "rope_theta")
field_values = st.one_of(st.none(), st.booleans(), st.integers(-2, 2**40), st.sampled_from([1e9, 1e5, 0.5, "x", []]),
                         st.floats(allow_nan=True, allow_infinity=True), st.integers(0, 2048))


@pytest.fixture(scope="module")
def olmoe_source(tmp_path_factory):
    return tiny_model("olmoe", tmp_path_factory.mktemp("fuzz-config"), seed=5).path


@settings(max_examples=150, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(fields=st.dictionaries(st.sampled_from(OLMOE_FIELDS), field_values, min_size=1, max_size=4))
def test_fuzz_config_fields_through_the_olmoe_readers(olmoe_source, tmp_path_factory, monkeypatch, fields):
    """Whatever the size-like fields say, info's, run's and the engine arguments' readers refuse in one line or
    accept a config the tensors agree with; the layout they build stays the size of what is on disk."""
    from colibri import plugins
    from colibri.errors import ColibriError
    from colibri.inventory import load_facts
    from colibri.model import resolve_model
    from colibri.validation import require_sound_tensors
    from colibri_olmoe.plugin import engine_hparams

    monkeypatch.setenv("COLIBRI_LOAD_PLUGINS", "olmoe")
    plugins.reset()
    directory = tmp_path_factory.mktemp("case")
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        os.symlink(olmoe_source / name, directory / name)
    config = {**json.loads((olmoe_source / "config.json").read_text()), **fields}
    (directory / "config.json").write_text(json.dumps(config))
    try:
        model = resolve_model(directory)
        facts = load_facts(model)
        require_sound_tensors(model, facts.geometry, facts.layout, facts.tensors)
        engine_hparams(model)
    except ColibriError as exc:
        assert "config.json" in exc.message or "model.safetensors" in exc.message, exc.message
        return
    finally:
        plugins.reset()
    assert facts.geometry.num_layers == 2 and facts.geometry.num_experts == 16     # what the tensors say
    assert len(facts.layout.experts) == 32


@pytest.mark.parametrize("kind, family", [("qwen3_moe", "qwen"), ("deepseek_v3", "deepseek-v4")])
def test_transposed_expert_of_a_family_stating_no_shapes(kind, family, tmp_path_factory, monkeypatch):
    """A family whose layout states no expert shapes still gets a lone transposed expert matrix refused: each
    expert is held to the shape of the other experts of its layer (doctor --deep, and so convert)."""
    from colibri import plugins
    from colibri.doctor import FAIL, diagnose

    monkeypatch.setenv("COLIBRI_LOAD_PLUGINS", family)
    plugins.reset()
    root = tmp_path_factory.mktemp(f"transposed-{kind}")
    directory = root / "model"
    shutil.copytree(tiny_model(kind, root / "tiny", seed=1).path, directory)
    header, data = split_shard(directory)
    victim = next(n for n in sorted(header) if ".experts.2." in n and n.endswith("down_proj.weight"))
    header[victim]["shape"] = header[victim]["shape"][::-1]
    write_shard(directory, json.dumps(header).encode(), data)
    try:
        shapes = {c.name: c for c in diagnose(directory, deep=True)}["tensor shapes"]
    finally:
        plugins.reset()
    assert shapes.status == FAIL and victim in shapes.detail and "transposed" in shapes.detail, shapes
