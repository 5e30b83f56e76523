"""Laya decision models on colibri's engine against the ``laya`` package's own inference.

A tiny random Laya checkpoint built with laya's classes (colibri_decision.tiny: a 3-layer ModernBERT with global and
sliding-window layers, a 2-layer decision head, calibrated temperatures per type and per option-count bucket):

- the sequences colibri builds are laya's (``Agent._encode_state``) and the engine's head scores are laya's
  ``DecisionModel`` logits within 1e-4;
- ``/v1/systemone`` and ``coli decide`` answer every question type laya supports with laya's probabilities
  (``Agent.predict``, rounded to 4 places there) within 1e-4, for text, JSON and text-part states and for states
  laya cuts to its sequence budget (the start kept, or the end of a list);
- bad input is a 422 naming the question and field; the engine refuses generation.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

torch = pytest.importorskip("torch")
laya = pytest.importorskip("laya")
pytest.importorskip("colibri_decision")

import httpx  # noqa: E402

from colibri import hooks, launch  # noqa: E402
from colibri.model import resolve_model  # noqa: E402
from colibri.server.codec import TokenizerCodec  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "colibri-core" / "tests"))  # core's harnesses
from serve_harness import start_server  # noqa: E402

TOL = 1e-4
CTX = 128
COLI = [sys.executable, "-c", "from colibri.cli import main; main()"]
QUESTIONS = {
    "spam": {"type": "noul", "instructions": "Is this spam?", "criteria": {"true": "ads", "false": None}},
    "real": {"type": "noul", "instructions": {"ask": "Is it from a person?"}},
    "tone": {"type": "choice", "instructions": "What is the tone?",
             "criteria": {"calm": None, "pushy": "Pressures the reader", "angry": {"signs": ["caps"]}}},
    "lang": {"type": "choice", "instructions": "Which language?", "criteria": {"en": None, "fr": ""}},
    "urgency": {"type": "score", "instructions": "How urgent is it?", "criteria": ["can wait", "this week", "today"]},
    "wide": {"type": "score", "instructions": "Rate it", "criteria": [f"level {i}" for i in range(7)]},
}
LONG = " ".join(f"word{i} and more" for i in range(60))
STATES = {
    "text": "WIN a FREE phone today, click here before midnight!",
    "json": {"message": "My card was charged twice, I want a refund.", "channel": "support"},
    "parts": [{"type": "text", "text": "Hello team,"}, {"type": "text", "text": " the build is red again."}],
    "long": LONG,                                          # cut to max_len: laya keeps its start
    "long_list": [{"type": "text", "text": LONG}, "and the newest turn"],   # a list: laya keeps its end
}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from colibri.testing.tiny import tiny_model

    path = tiny_model("laya", tmp_path_factory.mktemp("laya"), num_hidden_layers=3, head_layers=2).path
    agent = laya.Agent(str(path), device="cpu")
    with torch.no_grad():
        references = {name: agent.predict(state, QUESTIONS)["answers"] for name, state in STATES.items()}
    resolved = resolve_model(path)
    return resolved, agent, references


@pytest.fixture(scope="module")
def engine(model):
    with launch.open_engine(model[0], ctx=CTX, threads=2) as running:
        yield running


def probabilities(answer):
    if answer["type"] == "noul":
        return {"true": answer["noul"]}
    return answer["probabilities"]


def assert_answers(got, want, where):
    assert list(got) == list(want), where
    for name, answer in want.items():
        assert got[name]["type"] == answer["type"]
        for option, p in probabilities(answer).items():
            assert abs(probabilities(got[name])[option] - p) <= TOL, f"{where}.{name}.{option}"
        if answer["type"] == "score":
            assert abs(got[name]["score"] - answer["score"]) <= TOL
        if answer["type"] == "choice":
            assert got[name]["choice"] == answer["choice"]


def test_sequences_and_head_scores_are_layas(model, engine):
    resolved, agent, _ = model
    decider = hooks.decider(resolved, None)
    assert engine.ready["abilities"] == ["decide"]
    ids = list(QUESTIONS)
    internal = {q: agent._to_internal(QUESTIONS[q]) for q in ids}
    for name, state in STATES.items():
        items = agent._encode_state(state, ids, internal)
        prompts = decider.prompts(state, decider.check(QUESTIONS))
        assert [p.ids for p in prompts] == [it["ids"] for it in items], name
        assert [p.markers for p in prompts] == [it["markers"] for it in items], name
        with torch.no_grad():
            logits, _ = agent._forward(laya.common.collate_items([items], agent.tok.pad_token_id))
        for row, (prompt, item) in enumerate(zip(prompts, items)):
            kind = laya.common.QTYPES[prompt.question.type]
            scores = engine.decide(prompt.ids, [m + 1 for m in prompt.markers], [[kind]] * len(prompt.markers)).wait()
            want = logits[row, :len(item["markers"])]
            assert max(abs(s[0] - float(w)) for s, w in zip(scores.scores, want)) <= TOL, (name, prompt.question.name)
    assert any(it["state_stats"]["truncated"] for it in agent._encode_state(LONG, ids, internal))


def test_systemone_matches_laya(model):
    resolved, _, references = model
    tok = hooks.load_tokenizer(resolved)

    def start_engine():
        return launch.open_engine(resolved, ctx=CTX, threads=2)

    server = start_server(resolved.path, ctx=CTX, factory=start_engine, codec=TokenizerCodec(tok, model=resolved))
    try:
        for name, state in STATES.items():
            reply = httpx.post(server.url + "/v1/systemone", json={"state": state, "questions": QUESTIONS}, timeout=120)
            assert reply.status_code == 200, reply.text
            assert_answers(reply.json()["answers"], references[name], name)
            usage = reply.json()["usage"]
            assert usage["input_tokens"] == usage["prefilled_tokens"] > 0 and usage["output_tokens"] == 0
        huge = " ".join(f"sentence {i} of a very long email." for i in range(2000))   # ~60 KB, far past ctx
        reply = httpx.post(server.url + "/v1/systemone", json={"state": huge, "questions": QUESTIONS}, timeout=120)
        assert reply.status_code == 200, reply.text
        assert_answers(reply.json()["answers"], model[1].predict(huge, QUESTIONS)["answers"], "huge")
        joined = httpx.post(server.url + "/v1/systemone", timeout=120, json={
            "state": STATES["parts"], "questions": QUESTIONS, "normalize": True}).json()
        assert_answers(joined["answers"], model[1].predict("Hello team, the build is red again.", QUESTIONS)["answers"],
                       "normalized")
        for body, field in bad_requests():
            refused = httpx.post(server.url + "/v1/systemone", json=body, timeout=60)
            assert refused.status_code == 422, (field, refused.text)
            assert refused.json()["error"]["param"] == field, refused.text
        chat = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
        assert chat.status_code == 400 and "only decides" in chat.text
    finally:
        server.stop()


def bad_requests():
    one = {"type": "noul", "instructions": "Is it?"}
    many = {f"o{i}": f"an option described at quite some length, number {i}" for i in range(40)}
    return [
        ({"state": "x", "questions": {}}, "questions"),
        ({"state": "x", "questions": {f"q{i}": one for i in range(65)}}, "questions"),
        ({"state": "x", "questions": {"q": {"type": "rank", "instructions": "?"}}}, "questions.q.type"),
        ({"state": "x", "questions": {"q": {"type": "choice", "instructions": "?", "criteria": {"a": None}}}},
         "questions.q.criteria"),
        ({"state": "x", "questions": {"q": {"type": "noul", "instructions": "  "}}}, "questions.q.instructions"),
        ({"state": "x", "questions": {"q": {"type": "choice", "instructions": "?", "criteria": many}}},
         "questions.q.criteria"),
        ({"state": 3, "questions": {"q": one}}, "state"),
    ]


def test_state_past_a_small_context_is_refused(model):
    resolved = model[0]
    decider = hooks.decider(resolved, None)
    from colibri.decision import DecisionInputError

    with launch.open_engine(resolved, ctx=32, threads=1) as small:
        with pytest.raises(DecisionInputError) as refused:
            decider.decide(small, LONG, {"q": {"type": "noul", "instructions": "Is it?"}}, ctx=32)
    assert refused.value.field == "state" and "context holds 32" in str(refused.value)


def test_coli_decide_matches_laya(model, tmp_path):
    resolved, _, references = model
    state = tmp_path / "state.json"
    state.write_text(json.dumps(STATES["json"]))
    questions = tmp_path / "questions.json"
    questions.write_text(json.dumps(QUESTIONS))
    done = subprocess.run([*COLI, "decide", "--model", str(resolved.path), "--state", str(state), "--questions",
                           str(questions), "--threads", "2", "--json"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert_answers(json.loads(done.stdout)["answers"], references["json"], "coli decide")
    flags = subprocess.run([*COLI, "decide", "--model", str(resolved.path), "--state", "Buy now!", "--question",
                            "tone:choice:What is the tone?:calm,pushy", "--question", "spam:noul:Is this spam?"],
                           capture_output=True, text=True, timeout=300)
    assert flags.returncode == 0 and "tone" in flags.stdout and "spam" in flags.stdout, flags.stderr
    bad = subprocess.run([*COLI, "decide", "--model", str(resolved.path), "--state", "x", "--question", "q:noul: "],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 1 and "questions.q.instructions" in bad.stderr and "Traceback" not in bad.stderr
