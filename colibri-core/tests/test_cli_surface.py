"""The CLI's surface as the installed ``coli`` script shows it: every command's --help, every option documented,
and usage errors (at the top level too) as one line without a box or a traceback."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest
import typer.main
from colibri.cli import app

COMMANDS = typer.main.get_command(app).commands      # discovered, so a new command is covered without an edit
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "COLUMNS": "200", "NO_COLOR": "1", "TERM": "dumb"}


def coli(*args: str) -> subprocess.CompletedProcess:
    script = shutil.which("coli", path=os.path.dirname(sys.executable)) or shutil.which("coli")
    argv = [script, *args] if script else [sys.executable, "-c", "from colibri.cli import main; main()", *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, env=ENV, check=False)


def test_every_command_is_listed():
    assert {"families", "info", "plan", "doctor", "run", "chat", "serve", "build", "demo"} <= set(COMMANDS)


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_help_exits_0_and_documents_every_option(name):
    result = coli(name, "--help")
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    text = re.sub(r"\s+", " ", result.stdout)
    for param in COMMANDS[name].params:
        if param.param_type_name != "option" or param.hidden:
            continue
        assert (param.help or "").strip(), f"coli {name}: option {param.opts[0]} has no help text"
        assert param.opts[0] in text, f"coli {name} --help does not show {param.opts[0]}"
    assert (COMMANDS[name].help or "").strip(), f"coli {name} has no description"


def test_serve_help_names_its_security_and_scheduling_options():
    text = coli("serve", "--help").stdout
    for flag in ("--host", "--port", "--api-key", "--kv-slots", "--max-queue", "--queue-timeout", "--cors"):
        assert flag in text, flag


@pytest.mark.parametrize("args, needle", [
    (["--bogus"], "No such option: --bogus"),
    (["bogus"], "No such command 'bogus'"),
    (["info", "--bogus"], "No such option: --bogus"),
    (["plan", "--ram", "lots"], "--ram"),
])
def test_usage_errors_are_one_line(args, needle):
    result = coli(*args)
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ") and needle in lines[0] and "--help" in lines[0]
    assert "Traceback" not in result.stderr and "╭" not in result.stderr and result.stdout == ""


def test_bare_coli_shows_the_help():
    result = coli()
    assert "Usage" in result.stdout + result.stderr and "error:" not in result.stderr
