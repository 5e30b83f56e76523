"""``coli run`` and ``coli chat`` show a reply's reasoning apart from its answer (through the family's
``parse_output`` parser): dimmed before the answer on a terminal; on stderr, leaving stdout the answer alone,
when stdout is a pipe. The fake engine writes a fixed reply with a reasoning block."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from colibri import plugins
from colibri.cli import app
from colibri.demo_tokenizer import stdlib_texts, train_bpe
from colibri.reasoning_view import DIM, RESET
from colibri.tokenizer import load_tokenizer_dir

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fakefamily import fake_model

REPLY = "<think>Weigh it.\nTwice.</think>\n\nThe answer is 4."


@pytest.fixture
def fake(tmp_path, monkeypatch):
    model = fake_model(tmp_path, monkeypatch, train_bpe(stdlib_texts(200_000), 700))
    monkeypatch.setenv("FAKE_REASONING", "1")
    tok = load_tokenizer_dir(model)
    reply = tok.encode(REPLY, add_special_tokens=False) + [tok.stop_ids[0]]
    monkeypatch.setenv("FAKE_ENGINE_FORCED", json.dumps(reply))
    yield model
    plugins.reset()


def invoke(*args, input=None):
    return CliRunner().invoke(app, [str(a) for a in args], input=input, catch_exceptions=False)


def test_run_piped_prints_the_answer_and_sends_reasoning_to_stderr(fake):
    res = invoke("run", "2+2?", "--model", fake, "--max-tokens", 64, "--temp", 0, "--ctx", 256)
    assert res.exit_code == 0, res.output
    assert res.stdout == "The answer is 4.\n"
    assert res.stderr.startswith("Weigh it.\nTwice.\n")


def test_run_on_a_terminal_dims_the_reasoning(fake, monkeypatch):
    monkeypatch.setattr("colibri.reasoning_view._wants_colour", lambda stream: True)
    res = invoke("run", "2+2?", "--model", fake, "--max-tokens", 64, "--temp", 0, "--ctx", 256)
    assert res.exit_code == 0, res.output
    assert res.stdout == f"{DIM}Weigh it.\nTwice.{RESET}\n\nThe answer is 4.\n"


def test_run_json_keeps_the_raw_text(fake):
    res = invoke("run", "2+2?", "--model", fake, "--max-tokens", 64, "--temp", 0, "--ctx", 256, "--json")
    assert json.loads(res.stdout)["text"] == REPLY


def test_chat_shows_each_turns_reasoning_apart(fake, monkeypatch):
    monkeypatch.setattr("colibri.reasoning_view._wants_colour", lambda stream: True)
    res = invoke("chat", "--model", fake, "--max-tokens", 64, "--temp", 0, "--ctx", 256, input="hi\nagain\n")
    assert res.exit_code == 0, res.output
    turn = f"{DIM}Weigh it.\nTwice.{RESET}\n\nThe answer is 4.\n"
    assert res.stdout == turn * 2
