"""The coli CLI skeleton: one-line errors, --debug, --version, COLI_MODEL, --family, families and info."""

from __future__ import annotations

import io
import json
import math

import pytest

from colibri import __version__, hookimpl, plugins
from colibri.cli import app
from colibri.console import print_error
from colibri.records import Claim, FamilyDescriptor
from safetensors import safe_open
from typer.testing import CliRunner

runner = CliRunner()


def one_error_line(result) -> str:
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ")
    return lines[0]


# ------------------------------------------------------------------------------------------ errors and globals

def test_version():
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0
    assert __version__ in result.stdout


def test_no_model_says_how_to_pass_one(olmoe_family):
    for command in ("info", "plan", "doctor"):
        line = one_error_line(runner.invoke(app, [command]))
        assert "--model DIR" in line and "COLIBRI_MODEL" in line


def test_missing_directory_is_named(olmoe_family, tmp_path):
    line = one_error_line(runner.invoke(app, ["info", "--model", str(tmp_path / "nope")]))
    assert str(tmp_path / "nope") in line


def test_debug_shows_the_traceback(olmoe_family, tmp_path):
    result = runner.invoke(app, ["--debug", "info", "--model", str(tmp_path / "nope")])
    assert result.exit_code == 1
    assert "Traceback" in result.stderr
    assert result.stderr.rstrip().splitlines()[-1].startswith("error: ")


def test_error_is_red_on_a_tty_and_plain_otherwise(monkeypatch):
    class Tty(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.delenv("NO_COLOR", raising=False)
    tty = Tty()
    monkeypatch.setattr("sys.stderr", tty)
    print_error("config.json: broken (restore it)")
    assert tty.getvalue() == "\x1b[1;31merror: config.json: broken (restore it)\x1b[0m\n"
    pipe = io.StringIO()
    monkeypatch.setattr("sys.stderr", pipe)
    print_error("two\nlines")
    assert pipe.getvalue() == "error: two lines\n"


def test_a_bad_flag_value_is_one_line(olmoe_family):
    result = runner.invoke(app, ["plan", "--ctx", "many"])
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: Invalid value for '--ctx'")
    assert "(see coli plan --help)" in lines[0]


def test_a_family_bug_is_one_line_without_debug(olmoe_family, family_class, tiny_olmoe):
    class Buggy(family_class):
        name = "buggy"

        @hookimpl
        def model_geometry(self, model):
            raise RuntimeError("geometry exploded\nsecond line")

    plugins.reset()
    plugins.register(Buggy(), "buggy")
    line = one_error_line(runner.invoke(app, ["info", "--model", str(tiny_olmoe.path)]))
    assert "family plugin 'buggy' ((registered in-process)) failed: RuntimeError: geometry exploded" in line
    assert "--debug" in line and "internal error" not in line


def test_a_core_bug_is_an_internal_error(olmoe_family, tiny_olmoe, monkeypatch):
    def broken(model):
        raise RuntimeError("planner exploded")

    monkeypatch.setattr("colibri.cli.inspect.load_facts", broken)
    line = one_error_line(runner.invoke(app, ["info", "--model", str(tiny_olmoe.path)]))
    assert "internal error: RuntimeError: planner exploded" in line and "--debug" in line


@pytest.mark.parametrize("variable", ["COLIBRI_MODEL", "COLI_MODEL"])
def test_model_environment_variable_and_its_old_alias(olmoe_family, tiny_olmoe, monkeypatch, variable):
    monkeypatch.setenv(variable, str(tiny_olmoe.path))
    result = runner.invoke(app, ["info", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["model"] == str(tiny_olmoe.path)


def test_the_new_name_wins_over_the_old_alias(olmoe_family, tiny_olmoe, monkeypatch, tmp_path):
    monkeypatch.setenv("COLI_MODEL", str(tmp_path / "elsewhere"))
    monkeypatch.setenv("COLIBRI_MODEL", str(tiny_olmoe.path))
    result = runner.invoke(app, ["info", "--json"])
    assert result.exit_code == 0, result.output


def test_model_option_beats_environment(olmoe_family, tiny_olmoe, monkeypatch, tmp_path):
    monkeypatch.setenv("COLI_MODEL", str(tmp_path / "elsewhere"))
    result = runner.invoke(app, ["info", "--json", "--model", str(tiny_olmoe.path)])
    assert result.exit_code == 0, result.output


# ------------------------------------------------------------------------------------------------- --family

class Rival:
    """A second family claiming OLMoE checkpoints, to make the claim ambiguous."""

    @hookimpl
    def describe_family(self):
        return FamilyDescriptor("rival", ("olmoe",))

    @hookimpl
    def detect_config(self, model_dir, config):
        return Claim("rival", "olmoe") if config and config.get("model_type") == "olmoe" else None


def test_ambiguous_claim_names_both_and_the_option(olmoe_family, tiny_olmoe):
    plugins.register(Rival(), "rival")
    line = one_error_line(runner.invoke(app, ["info", "--model", str(tiny_olmoe.path)]))
    assert "testolmoe" in line and "rival" in line and "--family" in line
    result = runner.invoke(app, ["info", "--json", "--family", "testolmoe", "--model", str(tiny_olmoe.path)])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["family"] == "testolmoe"


def test_family_that_does_not_exist_or_does_not_claim(olmoe_family, tiny_olmoe, tmp_path):
    line = one_error_line(runner.invoke(app, ["info", "--family", "nosuch", "--model", str(tiny_olmoe.path)]))
    assert "--family nosuch" in line and "testolmoe" in line

    class Shy:
        @hookimpl
        def detect_config(self, model_dir, config):
            return None

    plugins.register(Shy(), "shy")
    line = one_error_line(runner.invoke(app, ["info", "--family", "shy", "--model", str(tiny_olmoe.path)]))
    assert "--family shy does not claim" in line


def test_no_family_claims(no_installed_plugins, tiny_olmoe):
    line = one_error_line(runner.invoke(app, ["info", "--model", str(tiny_olmoe.path)]))
    assert "model_type 'olmoe' needs the family package colibri-olmoe, which is installed but not loaded" in line
    assert line.endswith("(check COLIBRI_LOAD_PLUGINS and COLIBRI_DISABLE_PLUGINS)")


def test_an_unknown_model_type_lists_the_installed_families(olmoe_family, tiny_olmoe, tmp_path):
    config = json.loads((tiny_olmoe.path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "nobody_runs_this"}))
    line = one_error_line(runner.invoke(app, ["info", "--model", str(tmp_path)]))
    assert "model_type 'nobody_runs_this' is not claimed" in line and "testolmoe" in line


# ------------------------------------------------------------------------------------------------- families

def test_families_lists_the_family_and_its_engine(olmoe_family):
    result = runner.invoke(app, ["families", "--json"])
    assert result.exit_code == 0, result.output
    rows = {r["family"]: r for r in json.loads(result.stdout)}
    row = rows["testolmoe"]
    assert row["model_types"] == ["olmoe"]
    assert row["package"] == "colibri-core-tests"
    assert row["status"] == "ok"
    assert row["engine_built"] is False and row["engine"]
    text = runner.invoke(app, ["families"])
    assert text.exit_code == 0
    assert "testolmoe" in text.stdout and "olmoe" in text.stdout


def test_families_calls_each_plugins_own_describe(olmoe_family):
    plugins.register(Rival(), "rival")
    rows = {r["family"]: r for r in json.loads(runner.invoke(app, ["families", "--json"]).stdout)}
    assert rows["rival"]["model_types"] == ["olmoe"]
    assert rows["testolmoe"]["description"] == "OLMoE, as core's tests see it"


def test_families_with_none_installed(no_installed_plugins):
    result = runner.invoke(app, ["families"])
    assert result.exit_code == 0
    assert "no colibri families installed" in result.stdout


# ----------------------------------------------------------------------------------------------------- info

def _tensor_sizes(path):
    sizes = {}
    with safe_open(str(path), "np") as fh:
        for key in fh.keys():
            sizes[key] = math.prod(fh.get_slice(key).get_shape())
    return sizes


def test_info_counts_match_transformers(olmoe_family, tiny_olmoe):
    result = runner.invoke(app, ["info", "--json", "--model", str(tiny_olmoe.path)])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    params = data["parameters"]
    assert params["total"] == tiny_olmoe.num_parameters
    sizes = _tensor_sizes(tiny_olmoe.path / "model.safetensors")
    routed = sum(n for k, n in sizes.items() if ".mlp.experts." in k)
    config = json.loads((tiny_olmoe.path / "config.json").read_text())
    k, e = config["num_experts_per_tok"], config["num_experts"]
    assert params["routed_experts"] == routed
    assert params["active_per_token"] == tiny_olmoe.num_parameters - routed + routed * k // e
    g = data["geometry"]
    assert (g["layers"], g["experts"], g["top_k"]) == (config["num_hidden_layers"], e, k)
    assert g["moe_layers"] == list(range(config["num_hidden_layers"]))
    b = data["bytes"]
    embed = sizes["model.embed_tokens.weight"] + sizes["lm_head.weight"]
    assert b["embeddings"] == embed * 4 and b["routed_experts"] == routed * 4
    assert b["dense"] + b["routed_experts"] + b["embeddings"] == sum(sizes.values()) * 4
    assert data["dtypes"] == {"F32": len(sizes)}


def test_info_text(olmoe_family, tiny_olmoe):
    result = runner.invoke(app, ["info", "--model", str(tiny_olmoe.path)])
    assert result.exit_code == 0
    assert f"({tiny_olmoe.num_parameters:,})" in result.stdout
    assert "active per token" in result.stdout and "routed experts" in result.stdout


def test_info_same_on_a_sharded_copy(olmoe_family, olmoe_copy, surgery, tiny_olmoe):
    surgery.shard(olmoe_copy, 3)
    data = json.loads(runner.invoke(app, ["info", "--json", "--model", str(olmoe_copy)]).stdout)
    assert data["parameters"]["total"] == tiny_olmoe.num_parameters
    assert data["files"] == 3


def test_info_counts_skipped_prefixes_apart(olmoe_family, family_class, tiny_olmoe):
    class SkipsLayer1(family_class):
        @hookimpl
        def tensor_layout(self, model):
            from dataclasses import replace

            return replace(super().tensor_layout(model), skipped_prefixes=("model.layers.1.",))

    plugins.reset()
    plugins.register(SkipsLayer1(), "testolmoe")
    data = json.loads(runner.invoke(app, ["info", "--json", "--model", str(tiny_olmoe.path)]).stdout)
    sizes = _tensor_sizes(tiny_olmoe.path / "model.safetensors")
    layer1 = sum(n for name, n in sizes.items() if name.startswith("model.layers.1."))
    assert data["parameters"]["skipped"] == layer1
    assert data["parameters"]["total"] == tiny_olmoe.num_parameters - layer1
    assert data["bytes"]["skipped"] == layer1 * 4


def test_info_leaves_buffers_out_of_parameter_counts(olmoe_family, family_class, tiny_olmoe):
    class WithBuffer(family_class):
        @hookimpl
        def tensor_layout(self, model):
            from dataclasses import replace

            return replace(super().tensor_layout(model), buffers=("model.norm.weight",))

    plugins.reset()
    plugins.register(WithBuffer(), "testolmoe")
    data = json.loads(runner.invoke(app, ["info", "--json", "--model", str(tiny_olmoe.path)]).stdout)
    hidden = json.loads((tiny_olmoe.path / "config.json").read_text())["hidden_size"]
    assert data["parameters"]["buffers"] == hidden
    assert data["parameters"]["total"] == tiny_olmoe.num_parameters - hidden
    assert data["bytes"]["total"] == (tiny_olmoe.path / "model.safetensors").stat().st_size - _data_start(
        tiny_olmoe.path / "model.safetensors")


def _data_start(path):
    return 8 + int.from_bytes(path.read_bytes()[:8], "little")


def test_info_on_a_broken_shard_is_one_line(olmoe_family, olmoe_copy):
    shard = olmoe_copy / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:4])
    line = one_error_line(runner.invoke(app, ["info", "--model", str(olmoe_copy)]))
    assert str(shard) in line
