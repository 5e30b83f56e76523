"""What a shell user expects of ``coli``, through the installed script with the real OLMoE engine: a prompt on
stdin, output ending in a newline, flags refused with their range, help without ``<bool>``, shell completion,
``COLIBRI_`` environment variables, ``/commands`` in chat, and hints that fit the model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("colibri_olmoe")

from colibri.builder import build_family
from colibri.testing.tiny import tiny_model
from test_cli_bad_input import coli, one_error_line

GREEDY = ("--raw", "--temp", "0", "--max-tokens", "6")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    build_family("olmoe")      # built before the cases, so none of them pays for (or races) a compile
    return tiny_model("olmoe", tmp_path_factory.mktemp("habits"), seed=4).path


def test_run_reads_the_prompt_from_stdin_and_ends_with_a_newline(model_dir):
    given = coli("run", "def fibonacci(n):", "--model", str(model_dir), *GREEDY)
    assert given.returncode == 0, given.stderr
    assert given.stdout.endswith("\n") and given.stdout.strip()
    piped = coli("run", "--model", str(model_dir), *GREEDY, stdin="def fibonacci(n):")
    assert piped.returncode == 0, piped.stderr
    dash = coli("run", "--prompt-file", "-", "--model", str(model_dir), *GREEDY, stdin="def fibonacci(n):")
    assert dash.returncode == 0, dash.stderr
    assert piped.stdout == dash.stdout == given.stdout


def test_empty_stdin_is_no_prompt(model_dir):
    done = coli("run", "--model", str(model_dir), *GREEDY)
    line = one_error_line(done.stderr, done.returncode)
    assert "no prompt given" in line and "stdin" in line


@pytest.mark.parametrize("flag, value, expected", [
    ("--cap", "17", "--cap 17: out of range"),
    ("--threads", "0", "--threads 0: must be at least 1"),
    ("--temp", "2.5", "--temp 2.5: out of range (pass --temp 0 (greedy) to 2)"),
    ("--temp", "-1", "--temp -1: out of range"),
])
def test_out_of_range_flags_are_refused_with_the_range(model_dir, flag, value, expected):
    experts = json.loads((model_dir / "config.json").read_text())["num_experts"]
    for command in (["run", "hi"], ["chat"]):
        done = coli(*command, "--model", str(model_dir), flag, value)
        line = one_error_line(done.stderr, done.returncode)
        assert expected in line, line
        if flag == "--cap":
            assert f"has {experts} experts per MoE layer" in line and f"pass --cap 1 to {experts}" in line


def test_chat_answers_an_unknown_command_with_the_list(model_dir):
    done = coli("chat", "--model", str(model_dir), "--temp", "0", stdin="/sttas\n/exit\n")
    assert done.returncode == 0, done.stderr
    assert done.stdout == ""                                     # nothing went to the model
    line = next(ln for ln in done.stderr.splitlines() if "unknown command" in ln)
    assert line.startswith("error: unknown command /sttas") and "/reset" in line and "/stats" in line
    escaped = coli("chat", "--model", str(model_dir), "--temp", "0", "--max-tokens", "4", stdin="//sttas\n/exit\n")
    assert escaped.returncode == 0 and escaped.stdout.strip()     # "//" sends "/sttas" to the model
    assert "unknown command" not in escaped.stderr


@pytest.mark.parametrize("command", [["run"], ["chat"], ["serve"], ["doctor"], ["families"], ["bench", "quality"],
                                     []])
def test_help_shows_no_bool_placeholder(command):
    done = coli(*command, "--help", COLUMNS="200")
    assert done.returncode == 0, done.stderr
    assert "--help" in done.stdout and "<bool>" not in done.stdout


def test_bench_without_a_subcommand_shows_help_and_no_empty_error():
    done = coli("bench", COLUMNS="200")
    assert done.returncode == 2
    assert "error:" not in done.stderr and "quality" in done.stdout + done.stderr


def test_shell_completion_installs(tmp_path):
    done = coli("--install-completion", HOME=str(tmp_path), SHELL="/bin/bash")
    assert done.returncode == 0, done.stderr
    script = tmp_path / ".bash_completions" / "coli.sh"
    assert script.is_file() and str(script) in (tmp_path / ".bashrc").read_text()
    # what the installed script asks coli for when the user presses TAB after "coli ru"
    asked = coli(COMP_WORDS="coli ru", COMP_CWORD="1", _COLI_COMPLETE="complete_bash")
    assert asked.stdout.split() == ["run"]


@pytest.mark.parametrize("variable", ["COLIBRI_MODEL", "COLI_MODEL"])
def test_model_from_the_environment_under_both_names(model_dir, variable):
    done = coli("info", "--json", **{variable: str(model_dir)})
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["model"] == str(model_dir)


@pytest.mark.parametrize("variable", ["COLIBRI_DEBUG", "COLI_DEBUG"])
def test_debug_from_the_environment_under_both_names(tmp_path, variable):
    (tmp_path / "config.json").write_text("{")
    done = coli("info", "--model", str(tmp_path), **{variable: "1"})
    assert done.returncode == 1 and "Traceback" in done.stderr


@pytest.fixture(scope="module")
def short_model(tmp_path_factory) -> Path:
    """An OLMoE whose config allows 64 positions at most."""
    return tiny_model("olmoe", tmp_path_factory.mktemp("short"), seed=3, max_position_embeddings=64).path


def test_a_too_long_prompt_never_suggests_a_ctx_above_the_models_maximum(short_model):
    prompt = "a b c d " * 5                                       # more than 16, fewer than 64 tokens
    done = coli("run", prompt, "--model", str(short_model), "--raw", "--ctx", "16", "-n", "500")
    line = one_error_line(done.stderr, done.returncode)
    assert "--ctx 16 leaves no room" in line and "pass --ctx 64 (the model's maximum)" in line
    done = coli("run", prompt * 8, "--model", str(short_model), "--raw", "--ctx", "64")
    line = one_error_line(done.stderr, done.returncode)
    assert "shorten the prompt below 64 tokens" in line and "--ctx 6" not in line.split("(", 1)[1]


def test_environment_names_share_one_prefix():
    """Every variable colibri reads starts with COLIBRI_; the old COLI_ names are aliases only."""
    from colibri import envvars

    assert all(name.startswith("COLIBRI_") for name in envvars.ALIASES)
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    for new, old in envvars.ALIASES.items():
        assert new in readme and old in readme, (new, old)


def test_a_too_long_chat_message_never_suggests_a_ctx_above_the_models_maximum(short_model):
    message = "a b c d " * 40 + "\n"                              # more than 64 tokens with the template
    for ctx, hint in (("64", "(send a shorter message (64 is the model's maximum context))"),
                      ("32", "(send a shorter message or restart with a larger --ctx (at most 64))")):
        done = coli("chat", "--model", str(short_model), "--ctx", ctx, "--temp", "0", stdin=message)
        errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
        assert done.returncode == 0 and len(errors) == 1 and errors[0].endswith(hint), done.stderr
