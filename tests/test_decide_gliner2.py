"""GLiNER2 classification natively: the ``colibri-gliner2`` engine (DeBERTa-v3 encoder + GLiNER2's classifier head
over the shared runtime) answers System One questions with the probabilities the ``gliner2`` package's own local
inference gives, through ``POST /v1/systemone`` and ``coli decide``.

The tiny checkpoint is built with gliner2's classes (random O(1) weights, a locally trained DeBERTa-v3-style
tokenizer) and saved by its own ``save_pretrained``. The reference asks gliner2's ``classify_text`` the same
questions as one schema (one classification task per question, as colibri_decision.gliner2 maps them); it reports
every label's softmax probability when the task is marked multi-label with ``class_act: softmax`` and threshold 0,
and the single-label call gives the same top label and confidence.
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
pytest.importorskip("gliner2")
pytest.importorskip("colibri_decision")

import httpx  # noqa: E402

from colibri import hooks, launch, plugins  # noqa: E402
from colibri.decision import parse_questions  # noqa: E402
from colibri.model import resolve_model  # noqa: E402
from colibri.server.codec import TokenizerCodec  # noqa: E402
from colibri.testing.checks import assert_answers_close as assert_close  # noqa: E402
from colibri.testing.checks import check_layout_against_checkpoint  # noqa: E402
from colibri_decision import gliner2 as g2  # noqa: E402
from colibri_decision import plugin  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "colibri-core" / "tests"))  # core's harnesses
from serve_harness import start_server  # noqa: E402

TOL = 1e-4
CTX = 512
QUESTIONS = {
    "refund": {"type": "noul", "instructions": "Is a refund requested?", "criteria": {"true": "money back"}},
    "team": {"type": "choice", "instructions": "Which team handles it?",
             "criteria": {"billing": None, "shipping": "parcels and couriers", "legal": {"cases": ["fraud"]}}},
    "urgency": {"type": "score", "instructions": "How urgent is it?", "criteria": ["can wait", "this week", "today"]},
}
# text (ends without punctuation: gliner2 appends "."), JSON, and text parts (joined)
STATES = {
    "text": "I was charged TWICE for order #4411, e-mail me at ann@example.com",
    "json": {"ticket": "Parcel lost in transit, courier says delivered.", "priority": "high"},
    "parts": [{"type": "text", "text": "Hello support,"}, {"type": "text", "text": " my refund never arrived!"}],
}


def gliner2_tasks(questions) -> dict:
    """The questions as gliner2 classification tasks (what colibri_decision.gliner2 encodes)."""
    tasks = {}
    for q in parse_questions(questions, g2.LABELS):
        labels = g2.task_labels(q)
        task = {"labels": labels}
        if q.instructions is not None:
            task["prompt"] = g2.content_text(q.instructions)
        described = {label: g2.content_text(d) for label, d in zip(labels, q.descriptions)
                     if d is not None and q.type != "score"}
        if described:
            task["label_descriptions"] = described
        tasks[q.name] = task
    return tasks


def reference(model, state, questions) -> dict:
    """gliner2's probabilities, as System One answers (Question.answer over them)."""
    text = g2.state_text(state)
    tasks = gliner2_tasks(questions)
    every = {name: {**t, "multi_label": True, "cls_threshold": 0.0, "class_act": "softmax"}
             for name, t in tasks.items()}
    probs = model.classify_text(text, every, include_confidence=True)
    top = model.classify_text(text, tasks, include_confidence=True)
    answers = {}
    for q in parse_questions(questions, g2.LABELS):
        by_label = {item["label"]: item["confidence"] for item in probs[q.name]}
        values = [by_label[label] for label in g2.task_labels(q)]
        best = max(range(len(values)), key=values.__getitem__)
        assert top[q.name]["label"] == g2.task_labels(q)[best]
        assert abs(top[q.name]["confidence"] - values[best]) < 1e-6
        answers[q.name] = q.answer(values)
    return answers


def gliner2_ids(model, state, questions) -> list[int]:
    schema = model._classification_schema(gliner2_tasks(questions)).build()
    return model.processor.collate_fn_inference([(g2.state_text(state), schema)]).input_ids[0].tolist()


def load_reference(path: Path):
    from gliner2 import GLiNER2

    return GLiNER2.from_pretrained(str(path)).eval()


@pytest.fixture(scope="module")
def checkpoint(tiny_root):
    from colibri.testing.tiny import tiny_model

    built = tiny_model("gliner2", tiny_root)
    plugins.reset()
    resolved = resolve_model(built.path)
    return built, resolved, hooks.load_tokenizer(resolved), load_reference(built.path)


@pytest.fixture(scope="module")
def server(checkpoint):
    _, resolved, tok, _ = checkpoint

    def start_engine():
        engine = launch.open_engine(resolved, ctx=CTX, slots=2, threads=2)
        assert engine.ready["abilities"] == ["decide"]
        return engine

    running = start_server(resolved.path, ctx=CTX, slots=2, factory=start_engine,
                           codec=TokenizerCodec(tok, model=resolved))
    yield running
    running.stop()


def post(server, body):
    return httpx.post(server.url + "/v1/systemone", json=body, timeout=120)


def test_the_plugin_claims_gliner2s_own_save(checkpoint):
    built, resolved, _, _ = checkpoint
    assert (resolved.family, resolved.model_type) == ("decision", "extractor")
    assert (resolved.path / g2.ENCODER_DIR / "config.json").is_file()   # not inside config.json
    geo = plugin.model_geometry(model=resolved)
    assert (geo.num_layers, geo.hidden_size, geo.max_context) == (2, 32, 512)
    assert geo.architecture == "GLiNER2-style extractor (deberta-v2 encoder)"
    check_layout_against_checkpoint(plugin.tensor_layout(model=resolved), built.path, built.num_parameters)
    assert plugin.limits(model=resolved).has_engine


@pytest.mark.parametrize("name", sorted(STATES))
def test_systemone_matches_gliner2(checkpoint, server, name):
    _, _, tok, model = checkpoint
    state = STATES[name]
    reply = post(server, {"state": state, "questions": QUESTIONS})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert_close(body["answers"], reference(model, state, QUESTIONS), name)
    assert list(body["answers"]) == list(QUESTIONS)
    # the engine read exactly gliner2's input: one encoder pass over every question and the text
    ids = gliner2_ids(model, state, QUESTIONS)
    assert g2.build_input(tok.backend, state, parse_questions(QUESTIONS, g2.LABELS)).ids == ids
    assert body["usage"]["input_tokens"] == body["usage"]["prefilled_tokens"] == len(ids)
    assert post(server, {"state": state, "questions": QUESTIONS}).json()["answers"] == body["answers"]


def test_one_question_alone_is_its_own_gliner2_schema(checkpoint, server):
    """gliner2 encodes every task of a schema together, so a question's answer depends on its companions."""
    _, _, _, model = checkpoint
    alone = {"team": QUESTIONS["team"]}
    body = post(server, {"state": STATES["text"], "questions": alone}).json()
    assert_close(body["answers"], reference(model, STATES["text"], alone))
    together = post(server, {"state": STATES["text"], "questions": QUESTIONS}).json()["answers"]["team"]
    assert abs(together["probabilities"]["billing"] - body["answers"]["team"]["probabilities"]["billing"]) > 1e-3
    # more options than any label vocabulary (26 letters) would hold: each is read at its own [L] marker
    many = {f"q{i}": {"type": "choice", "instructions": f"Pick {i}",
                      "criteria": {f"o{k}": None for k in range(30)}} for i in range(2)}
    reply = post(server, {"state": "short", "questions": many})
    assert reply.status_code == 200, reply.text
    assert_close(reply.json()["answers"], reference(model, "short", many))


@pytest.mark.parametrize("body, field", [
    ({"state": "x", "questions": {}}, "questions"),
    ({"state": "x", "questions": {f"q{i}": QUESTIONS["refund"] for i in range(65)}}, "questions"),
    ({"state": "x", "questions": {"q": {"type": "rank", "instructions": "?"}}}, "questions.q.type"),
    ({"state": "x", "questions": {"q": {"type": "choice", "criteria": {"only": None}}}}, "questions.q.criteria"),
    ({"state": " ".join(f"w{i}" for i in range(400)), "questions": QUESTIONS}, "state"),
    ({"state": 3, "questions": QUESTIONS}, "state"),
])
def test_bad_input_is_422_naming_the_field(server, body, field):
    reply = post(server, body)
    assert reply.status_code == 422, reply.text
    assert reply.json()["error"]["param"] == field


OTHER_ENCODERS = {
    # deberta-v2-style: separate position projections, plain (unbucketed) relative positions, c2p only,
    # absolute positions and token types added to the embeddings, no LayerNorm of the relative embeddings
    "v2": dict(share_att_key=False, position_buckets=-1, max_relative_positions=64, pos_att_type=["c2p"],
               position_biased_input=True, type_vocab_size=2, norm_rel_ebd="none"),
    # p2c only, and an embedding narrower than the hidden size (embed_proj)
    "p2c": dict(pos_att_type=["p2c"], embedding_size=16),
}


@pytest.mark.parametrize("variant", sorted(OTHER_ENCODERS))
def test_other_deberta_settings_match_gliner2(tiny_root, variant):
    from colibri.testing.tiny import tiny_model

    built = tiny_model("gliner2", tiny_root, seed=1, **OTHER_ENCODERS[variant])
    resolved = resolve_model(built.path)
    tok = hooks.load_tokenizer(resolved)
    model = load_reference(built.path)
    with launch.open_engine(resolved, ctx=CTX, threads=2) as engine:
        for state in STATES.values():
            got = hooks.decider(resolved, tok).decide(engine, state, QUESTIONS, ctx=CTX)
            assert_close(got.answers, reference(model, state, QUESTIONS), variant)


def test_coli_decide_prints_gliner2s_answers(checkpoint, tmp_path):
    built, _, _, model = checkpoint
    flags = ["--question", "spam:noul:Is this spam?", "--question", "tone:choice:What is the tone?:calm,pushy",
             "--question", "urgency:score:How urgent?:low,high"]
    questions = {"spam": {"type": "noul", "instructions": "Is this spam?"},
                 "tone": {"type": "choice", "instructions": "What is the tone?",
                          "criteria": {"calm": None, "pushy": None}},
                 "urgency": {"type": "score", "instructions": "How urgent?", "criteria": ["low", "high"]}}
    state = tmp_path / "state.json"
    state.write_text(json.dumps(STATES["json"]))
    done = subprocess.run([sys.executable, "-c", "from colibri.cli import main; main()", "decide", "--model",
                           str(built.path), "--state", str(state), *flags, "--ctx", str(CTX), "--threads", "2",
                           "--json"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert_close(json.loads(done.stdout)["answers"], reference(model, STATES["json"], questions))
