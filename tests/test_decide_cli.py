"""``coli decide``: the answers of ``/v1/systemone`` from the command line, as a table or ``--json``; bad flags are one
line and exit 1 before any engine starts."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("colibri_olmoe")

COLI = [sys.executable, "-c", "from colibri.cli import main; main()"]
QUESTIONS = ["spam:noul:Is this spam?", "tone:choice:What is the tone?:calm,pushy",
             "urgency:score:How urgent?:low,high"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from colibri.testing.tiny import tiny_model

    path = tiny_model("olmoe", tmp_path_factory.mktemp("decide-cli")).path
    (path / "decision.json").write_text(json.dumps({"labels": {"noul": ["Y", "N"]}}))
    return path


def coli(*args, check=True):
    return subprocess.run([*COLI, *args], capture_output=True, text=True, timeout=300, check=check)


def test_json_answers_equal_the_library_and_the_table_shows_them(model_dir, tmp_path):
    from colibri import hooks, launch
    from colibri.decision import decide, load_settings
    from colibri.model import resolve_model

    state = tmp_path / "state.json"
    state.write_text('{"message": "WIN a FREE phone", "from": "unknown"}')
    flags = [a for q in QUESTIONS for a in ("--question", q)]
    out = json.loads(coli("decide", "--model", str(model_dir), "--state", str(state), *flags, "--ctx", "512",
                          "--threads", "2", "--json").stdout)
    resolved = resolve_model(model_dir)
    with launch.open_engine(resolved, ctx=512, threads=2) as engine:
        want = decide(engine, hooks.load_tokenizer(resolved), load_settings(model_dir),
                      {"message": "WIN a FREE phone", "from": "unknown"},
                      {"spam": {"type": "noul", "instructions": "Is this spam?"},
                       "tone": {"type": "choice", "instructions": "What is the tone?",
                                "criteria": {"calm": None, "pushy": None}},
                       "urgency": {"type": "score", "instructions": "How urgent?", "criteria": ["low", "high"]}})
    assert out["answers"] == want.answers and out["usage"]["input_tokens"] == want.input_tokens
    table = coli("decide", "--model", str(model_dir), "--state", "Buy now!", *flags, "--ctx", "512").stdout
    assert all(name in table for name in ("spam", "tone", "urgency")) and "probabilities" in table


@pytest.mark.parametrize("flag, words", [
    ("nocolons", "expected ID:TYPE:INSTRUCTIONS"),
    ("tone:choice:What is the tone?", "needs its options after a last ':'"),
    ("tone:choice:Tone?:calm", "questions.tone.criteria: a choice question needs at least 2 options"),
    ("x:rank:Rank it", "questions.x.type"),
])
def test_bad_questions_are_one_line(model_dir, flag, words):
    done = coli("decide", "--model", str(model_dir), "--state", "x", "--question", flag, check=False)
    assert done.returncode == 1 and words in done.stderr and "Traceback" not in done.stderr
    assert done.stderr.startswith("error: ")
