"""Hints that are right, through the installed ``coli`` script: a config without model_type says so, a known model
type whose family is not installed names the package, an engine's load error is said once, doctor's closing hint
fits the failure, and ``coli bench quality`` asks only for the positions the model's context holds."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("colibri_olmoe")

from colibri.builder import build_family
from colibri.testing.tiny import tiny_model
from test_cli_bad_input import coli, one_error_line

FAMILY_PACKAGES = Path(__file__).resolve().parents[1] / "colibri-core" / "src" / "colibri" / "family_packages.json"


@pytest.fixture(scope="module")
def short_model(tmp_path_factory) -> Path:
    """An OLMoE whose config allows 256 positions (the case where bench quality used to ask for 513)."""
    build_family("olmoe")
    return tiny_model("olmoe", tmp_path_factory.mktemp("hints"), seed=6, max_position_embeddings=256).path


def with_config(model: Path, directory: Path, **changes) -> Path:
    shutil.copytree(model, directory)
    config = json.loads((directory / "config.json").read_text())
    config.update(changes)
    for key in [k for k, v in changes.items() if v is None]:
        del config[key]
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def test_a_config_without_model_type_says_so(short_model, tmp_path):
    bare = with_config(short_model, tmp_path / "bare", model_type=None)
    done = coli("info", "--model", str(bare))
    line = one_error_line(done.stderr, done.returncode)
    assert "no model_type field" in line and "None" not in line
    doctor = json.loads(coli("doctor", "--json", "--model", str(bare)).stdout)["checks"]
    assert doctor[0]["detail"] == "config.json, no model_type field"


def test_a_known_model_type_without_its_family_names_the_package(short_model, tmp_path, monkeypatch):
    """Only the olmoe plugin is loaded (COLIBRI_LOAD_PLUGINS=olmoe): a qwen3_moe checkpoint needs colibri-qwen,
    which this venv has installed (so the hint is the plugin selection), and which a user without it installs."""
    other = with_config(short_model, tmp_path / "other", model_type="qwen3_moe")
    done = coli("run", "hi", "--model", str(other))
    line = one_error_line(done.stderr, done.returncode)
    assert "model_type 'qwen3_moe' needs the family package colibri-qwen, which is installed but not loaded" in line
    assert line.endswith("(check COLIBRI_LOAD_PLUGINS and COLIBRI_DISABLE_PLUGINS)")
    done = coli("doctor", "--model", str(other))
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and "re-download" not in done.stderr
    assert lines[-1].endswith("(check COLIBRI_LOAD_PLUGINS and COLIBRI_DISABLE_PLUGINS)"), done.stderr

    from typer.testing import CliRunner

    from colibri import model, plugins
    from colibri.cli import app

    monkeypatch.setenv("COLIBRI_LOAD_PLUGINS", "olmoe")
    monkeypatch.setattr(model, "_is_installed", lambda package: False)   # a machine without colibri-qwen
    plugins.reset()
    try:
        for command in ("run", "doctor"):
            result = CliRunner().invoke(app, [command, "--model", str(other), *(["hi"] if command == "run" else [])])
            assert result.exit_code == 1
            last = result.stderr.strip().splitlines()[-1]
            assert "needs the family package colibri-qwen, which is not installed" in last
            assert last.endswith("(pip install colibri-qwen)"), last
    finally:
        plugins.reset()


def test_the_package_table_knows_every_family_of_this_repository():
    """family_packages.json is help text, but it must be true: each family's model types map to its package."""
    from colibri import plugins

    table = json.loads(FAMILY_PACKAGES.read_text())["packages"]
    plugins.reset()
    try:
        declared = plugins.manager().hook.describe_family()
        for name, fam in plugins.families().items():
            if fam.package.startswith("colibri-") and not fam.error:
                types = next(d.model_types for d in declared if d.name == name)
                assert {t: table.get(t) for t in types} == {t: fam.package for t in types}, name
    finally:
        plugins.reset()


def test_a_file_problem_keeps_the_files_hint(short_model, tmp_path):
    broken = with_config(short_model, tmp_path / "broken")
    shard = broken / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    done = coli("doctor", "--model", str(broken))
    assert done.returncode == 1 and "fix or re-download the files named above" in done.stderr.splitlines()[-1]


def test_an_engine_load_error_is_said_once(short_model, tmp_path):
    # llama3 RoPE whose high-frequency factor does not exceed the low one: only the engine's RoPE block refuses it
    config = json.loads((short_model / "config.json").read_text())
    rope = dict(config.get("rope_parameters") or {"rope_theta": config.get("rope_theta", 10000.0)})
    rope.update(rope_type="llama3", factor=8.0, low_freq_factor=4.0, high_freq_factor=1.0,
                original_max_position_embeddings=64)
    bad = with_config(short_model, tmp_path / "bad-rope", rope_parameters=rope, rope_scaling=None)
    done = coli("run", "hi", "--model", str(bad), "--raw", "--max-tokens", "2")
    line = one_error_line(done.stderr, done.returncode)
    message = "rope_high_freq_factor must exceed rope_low_freq_factor"
    assert "failed while loading" in line and line.count(message) == 1 and "coli doctor --deep" in line


def test_bench_quality_fits_its_default_positions_to_the_context(short_model):
    done = coli("bench", "quality", "--model", str(short_model), "--reference", str(short_model), "--json",
                "--threads", "1")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["positions"] == 255 and report["top1_agreement"] == 1.0 and report["mean_kl"] == 0.0
    done = coli("bench", "quality", "--model", str(short_model), "--reference", str(short_model),
                "--positions", "600")
    line = one_error_line(done.stderr, done.returncode)
    assert "--positions 600: needs 601 tokens of context" in line and "pass --positions 255 or fewer" in line


def test_logits_rows_decode_from_binary_and_text():
    import base64

    from colibri.engine import logits_row

    row = np.array([1.5, -0.0, 3.4028235e38, 1e-45, -7.25], dtype="<f4")
    binary = {"ev": "logits", "pos": 0, "f32": base64.b64encode(row.tobytes()).decode()}
    assert np.array_equal(logits_row(binary), row) and logits_row(binary).dtype == np.float32
    assert np.array_equal(logits_row({"ev": "logits", "pos": 0, "values": row.tolist()}), row)
