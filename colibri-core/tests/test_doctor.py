"""coli doctor: every named check passes on a good checkpoint and each kind of damage fails cleanly."""

from __future__ import annotations

import builtins
import json

import pytest
from colibri.cli import app
from colibri.doctor import FAIL, PASS, WARN, diagnose
from typer.testing import CliRunner

runner = CliRunner()


def doctor(model_dir, *extra):
    return runner.invoke(app, ["doctor", "--model", str(model_dir), *extra])


def assert_clean_failure(result, *fragments):
    """Exit 1, one ``error:`` line on stderr naming every fragment, and no traceback anywhere."""
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ")
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


def status_of(checks, name):
    return {c.name: c for c in checks}[name]


def test_good_checkpoint_passes_every_check(olmoe_family, tiny_olmoe):
    result = doctor(tiny_olmoe.path, "--deep", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["ok"] is True
    names = [c["name"] for c in data["checks"]]
    assert names == ["config", "family", "tokenizer", "chat template", "shards", "container", "config vs tensors",
                     "disk space", "engine", "dtypes", "tensor sizes", "offsets", "overlaps", "tensor roles",
                     "tensor shapes", "tokenizer loads", "chat template renders"]
    statuses = {c["name"]: c["status"] for c in data["checks"]}
    # The test family has no engine: that is a warning, never a failure.
    assert statuses.pop("engine") == WARN
    assert set(statuses.values()) == {PASS}


def test_text_output_lists_checks(olmoe_family, tiny_olmoe):
    result = doctor(tiny_olmoe.path)
    assert result.exit_code == 0
    assert "pass    shards" in result.stdout
    assert "tensor roles" not in result.stdout  # deep checks only with --deep


def test_sharded_checkpoint_passes(olmoe_family, olmoe_copy, surgery):
    surgery.shard(olmoe_copy, 3)
    checks = diagnose(olmoe_copy, deep=True)
    assert status_of(checks, "shards").status == PASS
    assert "3 file(s)" in status_of(checks, "shards").detail
    assert status_of(checks, "tensor roles").status == PASS


def test_truncated_shard_fails_without_deep(olmoe_family, olmoe_copy):
    shard = olmoe_copy / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    line = assert_clean_failure(doctor(olmoe_copy), "shards", str(shard), "truncated")
    assert "ends at byte" in line


def test_truncated_inside_header_fails(olmoe_family, olmoe_copy):
    shard = olmoe_copy / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:200])
    assert_clean_failure(doctor(olmoe_copy, "--deep"), str(shard), "header length")


def test_offsets_past_end_of_file_fail(olmoe_family, olmoe_copy, surgery):
    shard = olmoe_copy / "model.safetensors"
    victim = "model.layers.1.mlp.experts.7.up_proj.weight"

    def stretch(header):
        begin, end = header[victim]["data_offsets"]
        header[victim]["data_offsets"] = [begin + 10**6, end + 10**6]

    surgery.rewrite_header(shard, stretch)
    result = doctor(olmoe_copy, "--deep", "--json")
    assert result.exit_code == 1
    checks = {c["name"]: c for c in json.loads(result.stdout)["checks"]}
    assert checks["offsets"]["status"] == FAIL
    assert any(victim in p and "past the end" in p for p in checks["offsets"]["problems"])
    assert_clean_failure(doctor(olmoe_copy, "--deep"), victim, str(shard))


def test_overlapping_tensors_fail(olmoe_family, olmoe_copy, surgery):
    shard = olmoe_copy / "model.safetensors"
    a, b = "model.layers.0.mlp.experts.0.gate_proj.weight", "model.layers.0.mlp.experts.1.gate_proj.weight"

    def overlap(header):
        header[b]["data_offsets"] = list(header[a]["data_offsets"])

    surgery.rewrite_header(shard, overlap)
    assert doctor(olmoe_copy).exit_code == 0  # headers parse and nothing runs past the end: only --deep sees it
    line = assert_clean_failure(doctor(olmoe_copy, "--deep"), "overlaps", str(shard))
    assert a in line and b in line


def test_shard_listed_in_index_but_missing_fails(olmoe_family, olmoe_copy, surgery):
    files = surgery.shard(olmoe_copy, 2)
    files[1].unlink()
    assert_clean_failure(doctor(olmoe_copy), str(files[1]), "missing", "model.safetensors.index.json")


def test_index_naming_a_tensor_the_shard_lacks_fails(olmoe_family, olmoe_copy, surgery):
    files = surgery.shard(olmoe_copy, 2)
    victim = "model.norm.weight"
    index = olmoe_copy / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    other = next(f for f in files if f.name != data["weight_map"][victim])
    data["weight_map"][victim] = other.name
    index.write_text(json.dumps(data))
    assert_clean_failure(doctor(olmoe_copy), victim, str(other), "not in this shard's header")


def test_config_not_json_fails(olmoe_family, olmoe_copy):
    (olmoe_copy / "config.json").write_text('{"model_type": "olmoe",')
    result = doctor(olmoe_copy)
    assert_clean_failure(result, "config.json", "not valid JSON")
    assert "fail    config" in result.stdout


def test_moe_layer_missing_an_expert_fails(olmoe_family, olmoe_copy, surgery):
    shard = olmoe_copy / "model.safetensors"
    prefix = "model.layers.1.mlp.experts.5."

    def drop(header):
        for name in [n for n in header if n.startswith(prefix)]:
            del header[name]

    surgery.rewrite_header(shard, drop)
    line = assert_clean_failure(doctor(olmoe_copy, "--deep"), "tensor roles", "layer 1 expert 5", prefix)
    assert "missing" in line


def test_missing_router_and_lm_head_are_named(olmoe_family, olmoe_copy, surgery):
    def drop(header):
        del header["model.layers.0.mlp.gate.weight"]
        del header["lm_head.weight"]

    surgery.rewrite_header(olmoe_copy / "model.safetensors", drop)
    checks = diagnose(olmoe_copy, deep=True)
    roles = status_of(checks, "tensor roles")
    assert roles.status == FAIL
    assert any("layer 0 router" in p and "mlp.gate.weight" in p for p in roles.problems)
    assert any("lm_head.weight" in p for p in roles.problems)


def test_wrong_byte_length_and_unknown_dtype_fail(olmoe_family, olmoe_copy, surgery):
    def damage(header):
        header["model.norm.weight"]["shape"] = [65]
        header["model.layers.0.input_layernorm.weight"]["dtype"] = "Q7"

    surgery.rewrite_header(olmoe_copy / "model.safetensors", damage)
    checks = diagnose(olmoe_copy, deep=True)
    assert "model.norm.weight" in status_of(checks, "tensor sizes").detail
    assert "'Q7'" in status_of(checks, "dtypes").detail


def test_missing_tokenizer_fails_and_missing_template_warns(olmoe_family, olmoe_copy):
    (olmoe_copy / "tokenizer.json").unlink()
    tok_config = olmoe_copy / "tokenizer_config.json"
    data = json.loads(tok_config.read_text())
    data.pop("chat_template")
    tok_config.write_text(json.dumps(data))
    checks = diagnose(olmoe_copy)
    assert status_of(checks, "tokenizer").status == FAIL
    assert status_of(checks, "chat template").status == WARN
    (olmoe_copy / "chat_template.jinja").write_text("{{ messages }}")
    assert status_of(diagnose(olmoe_copy), "chat template").status == PASS


def test_unclaimed_model_fails_family_check(olmoe_family, olmoe_copy):
    config = json.loads((olmoe_copy / "config.json").read_text())
    config["model_type"] = "mystery_moe"
    (olmoe_copy / "config.json").write_text(json.dumps(config))
    assert_clean_failure(doctor(olmoe_copy), "family", "mystery_moe")


def test_doctor_reads_headers_only(olmoe_family, tiny_olmoe, monkeypatch, surgery):
    """Every byte doctor reads from a shard lies in its 8-byte length or JSON header."""
    shard = tiny_olmoe.path / "model.safetensors"
    header_end = 8 + int.from_bytes(shard.read_bytes()[:8], "little")
    read_from_shard = []
    real_open = builtins.open

    class Spy:
        def __init__(self, fh):
            self.fh = fh

        def read(self, n=-1):
            data = self.fh.read(n)
            read_from_shard.append(self.fh.tell())
            return data

        def __getattr__(self, name):
            return getattr(self.fh, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.fh.close()

    def spy_open(file, mode="r", *args, **kwargs):
        fh = real_open(file, mode, *args, **kwargs)
        return Spy(fh) if str(file).endswith(".safetensors") else fh

    monkeypatch.setattr(builtins, "open", spy_open)
    checks = diagnose(tiny_olmoe.path, deep=True)
    assert status_of(checks, "shards").status == PASS
    assert read_from_shard, "the spy saw no reads: the test would prove nothing"
    assert max(read_from_shard) <= header_end


@pytest.mark.parametrize("deep", [False, True])
def test_doctor_json_is_machine_readable_on_failure(olmoe_family, olmoe_copy, deep):
    (olmoe_copy / "model.safetensors").unlink()
    args = ["--json"] + (["--deep"] if deep else [])
    result = doctor(olmoe_copy, *args)
    assert result.exit_code == 1
    data = json.loads(result.stdout)
    assert data["ok"] is False
    assert {c["name"]: c["status"] for c in data["checks"]}["shards"] == FAIL


# ------------------------------------------------------------------- the shared validation's checks, by class

def _transpose_expert(surgery, model_dir):
    name = "model.layers.1.mlp.experts.5.down_proj.weight"
    surgery.rewrite_header(model_dir / "model.safetensors", lambda h: h[name].update(shape=h[name]["shape"][::-1]))
    return name


def _edit_config(model_dir, **fields):
    path = model_dir / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))


def test_transposed_expert_fails_the_shape_check(olmoe_family, olmoe_copy, surgery):
    name = _transpose_expert(surgery, olmoe_copy)
    shapes = status_of(diagnose(olmoe_copy, deep=True), "tensor shapes")
    assert shapes.status == FAIL and name in shapes.detail and "transposed" in shapes.detail
    assert str(olmoe_copy / "model.safetensors") in shapes.detail


def test_config_contradicting_the_shapes_fails(olmoe_family, olmoe_copy):
    _edit_config(olmoe_copy, intermediate_size=48)
    shapes = status_of(diagnose(olmoe_copy, deep=True), "tensor shapes")
    assert shapes.status == FAIL and "mlp.experts.0.gate_proj.weight" in shapes.detail and "[48, 64]" in shapes.detail


def test_config_claiming_more_than_disk_fails_before_the_layout(olmoe_family, olmoe_copy):
    _edit_config(olmoe_copy, num_hidden_layers=5000)
    checks = diagnose(olmoe_copy, deep=True)
    counts = status_of(checks, "config vs tensors")
    assert counts.status == FAIL and "'num_hidden_layers' is 5000" in counts.detail and "2 layers" in counts.detail
    roles = status_of(checks, "tensor roles")          # the layout was never sized from 5000 layers
    assert roles.status == WARN and "not checked" in roles.detail


@pytest.mark.parametrize("content", ["", "{not json", "\x00\x01garbage"])
def test_unloadable_tokenizer_fails(olmoe_family, olmoe_copy, content):
    (olmoe_copy / "tokenizer.json").write_text(content)
    assert status_of(diagnose(olmoe_copy), "tokenizer").status == PASS     # present: only --deep loads it
    loads = status_of(diagnose(olmoe_copy, deep=True), "tokenizer loads")
    assert loads.status == FAIL and "tokenizer.json" in loads.detail


def test_truncated_tokenizer_fails(olmoe_family, olmoe_copy):
    text = (olmoe_copy / "tokenizer.json").read_text()
    (olmoe_copy / "tokenizer.json").write_text(text[: len(text) * 2 // 3])
    assert status_of(diagnose(olmoe_copy, deep=True), "tokenizer loads").status == FAIL


def test_tokenizer_larger_than_the_embedding_fails(olmoe_family, olmoe_copy, surgery):
    _edit_config(olmoe_copy, vocab_size=100)
    loads = status_of(diagnose(olmoe_copy, deep=True), "tokenizer loads")
    assert loads.status == FAIL and "'vocab_size' is 100" in loads.detail


@pytest.mark.parametrize("template, fragment", [
    ("{% for m in messages %}{{ m['content'] }", "does not parse"),
    ("{{ raise_exception('no') }}", "refused"),
])
def test_broken_chat_template_fails(olmoe_family, olmoe_copy, template, fragment):
    path = olmoe_copy / "tokenizer_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "chat_template": template}))
    renders = status_of(diagnose(olmoe_copy, deep=True), "chat template renders")
    assert renders.status == FAIL and fragment in renders.detail


DAMAGES = {
    "missing norm": lambda d, s: s.rewrite_header(d / "model.safetensors", lambda h: h.pop("model.norm.weight")),
    "missing router": lambda d, s: s.rewrite_header(d / "model.safetensors",
                                                    lambda h: h.pop("model.layers.0.mlp.gate.weight")),
    "overlapping offsets": lambda d, s: s.rewrite_header(
        d / "model.safetensors", lambda h: h["model.norm.weight"].update(
            data_offsets=[h["lm_head.weight"]["data_offsets"][0], h["lm_head.weight"]["data_offsets"][0] + 256])),
    "transposed expert": lambda d, s: _transpose_expert(s, d),
    "config contradicts shapes": lambda d, s: _edit_config(d, hidden_size=32),
    "config contradicts disk": lambda d, s: _edit_config(d, num_experts=900),
    "garbage tokenizer": lambda d, s: (d / "tokenizer.json").write_text("garbage"),
    "broken template": lambda d, s: (d / "chat_template.jinja").write_text("{% if %}"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_convert_refuses_what_doctor_deep_fails(olmoe_family, olmoe_copy, surgery, tmp_path, damage):
    from colibri.convert.run import convert
    from colibri.errors import CheckpointError
    from colibri.model import resolve_model

    DAMAGES[damage](olmoe_copy, surgery)
    failed = [c for c in diagnose(olmoe_copy, deep=True) if c.status == FAIL]
    assert failed, f"{damage}: doctor --deep should fail"
    out = tmp_path / "out"
    with pytest.raises(CheckpointError) as err:
        convert(resolve_model(olmoe_copy), out)
    assert f"not converted: {failed[0].name}" in err.value.message
    assert not out.exists()
