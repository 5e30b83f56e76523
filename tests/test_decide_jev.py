"""JEV decision models on colibri-decision's native engine against transformers' ``JevForDecision``.

Tiny random models built with transformers' own classes (O(1)-scale weights re-drawn with a seed), in both
layouts: a saved ``JevForDecision`` (config.json model_type jev, decision.json with temperatures) and a
``qwen3_5_text`` checkpoint with a JEV head beside it (``head.safetensors`` with a bias and a softcap, or
``readout.safetensors`` with neither). ``/v1/systemone`` answers must equal ``JevForDecision.decide`` +
``Question.answer`` on transformers' own ``prepare_inputs`` within 1e-4, for the three question types and text,
JSON and multi-part states; a second request on the pinned state prefills only the questions, with the same answers.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("colibri_decision")

import httpx  # noqa: E402

from colibri import hooks, launch  # noqa: E402
from colibri.errors import FamilyError  # noqa: E402
from colibri.model import resolve_model  # noqa: E402
from colibri.records import Claim  # noqa: E402
from colibri.server.codec import TokenizerCodec  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "colibri-core" / "tests"))  # core's harnesses
from serve_harness import start_server  # noqa: E402
from decide_cases import QUESTIONS, STATES, check_states  # noqa: E402

CTX = 512
TOL = 1e-4
# kind, its builder's options: the saved layout (decision.json temperatures, the generic prompt of the chat
# template), the head beside the LM with head.safetensors (bias, softcap) and with readout.safetensors (neither)
# beside a sharded LM (its index does not name the head's file)
LAYOUTS = {
    "saved": ("jev", dict(decision={"temperature": {"noul": 0.5, "choice": 2.0}})),
    "beside": ("jev-beside", {}),
    "readout": ("jev-beside", dict(head_file="readout.safetensors", softcap=None, max_shard_size="150KB")),
}


def reference_answers(path: Path) -> dict[str, dict]:
    """transformers' answers: prepare_inputs, JevForDecision.decide, Question.answer (the pipeline's steps)."""
    model = transformers.JevForDecision.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    answers = {}
    with torch.no_grad():
        for name, state in STATES.items():
            answers[name] = {}
            for inputs, questions in model.decision_config.prepare_inputs({"state": state, "questions": QUESTIONS},
                                                                          tokenizer):
                scores = model.decide(**inputs, decision_questions=questions)
                answers[name] |= {q.name: q.answer(s.softmax(-1).tolist()) for q, s in zip(questions, scores)}
    return answers


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def jev_model(request, tmp_path_factory):
    from colibri.testing.tiny import tiny_model

    kind, options = LAYOUTS[request.param]
    path = tiny_model(kind, tmp_path_factory.mktemp(f"jev-{request.param}"), **options).path
    resolved = resolve_model(path)
    return request.param, resolved, hooks.load_tokenizer(resolved), reference_answers(path)


def test_systemone_matches_transformers_and_reuses_the_pinned_state(jev_model):
    _, resolved, tok, references = jev_model
    assert resolved.family == "decision" and resolved.model_type == "jev"
    decider = hooks.decider(resolved, tok)

    def start_engine():
        engine = launch.open_engine(resolved, ctx=CTX, slots=2, cap=0, threads=2)
        assert engine.ready["abilities"] == ["decide"]
        return engine

    server = start_server(resolved.path, ctx=CTX, slots=2, factory=start_engine,
                          codec=TokenizerCodec(tok, model=resolved))
    try:
        check_states(server.url, references, tok, decider.settings, decider.option_ids)
        # a choice with more options than the head has rows for its type is refused before it queues
        many = {"type": "choice", "instructions": "Which?", "criteria": {f"o{i}": None for i in range(17)}}
        refused = httpx.post(server.url + "/v1/systemone", json={"state": "x", "questions": {"many": many}})
        assert refused.status_code == 422 and refused.json()["error"]["param"] == "questions.many.criteria"
        # a decision model does not chat: its engine refuses generation
        chat = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                          json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert chat.status_code >= 400
    finally:
        server.stop()


def test_engine_scores_are_the_soft_capped_head_rows(jev_model):
    """The decide op itself: option ids are head rows, the engine returns their soft-capped scores."""
    _, resolved, tok, _ = jev_model
    check_head_rows(resolved, tok)


def test_a_wider_backbone_gets_a_head_of_its_width(tmp_path_factory):
    """The builder sizes the head to the backbone (the benchmark's ~300 M JEV widens every field)."""
    from colibri.testing.tiny import tiny_model

    wide = dict(hidden_size=96, num_attention_heads=2, head_dim=32, linear_key_head_dim=24,
                linear_value_head_dim=24, intermediate_size=160)
    path = tiny_model("jev", tmp_path_factory.mktemp("jev-wide"), **wide).path
    resolved = resolve_model(path)
    assert hooks.model_geometry(resolved).hidden_size == 96
    check_head_rows(resolved, hooks.load_tokenizer(resolved))


def check_head_rows(resolved, tok) -> None:
    decider = hooks.decider(resolved, tok)
    engine = launch.open_engine(resolved, ctx=CTX, slots=1, cap=0, threads=1)
    try:
        ids = tok.encode("[kind] noul\n[state] hello", add_special_tokens=False)
        rows = list(range(decider.head.rows))
        got = engine.decide(ids, [len(ids)], [rows]).wait().scores[0]
        model = transformers.JevForDecision.from_pretrained(resolved.path, dtype=torch.float32).eval()
        with torch.no_grad():
            hidden = model.model(input_ids=torch.tensor([ids])).last_hidden_state[0, -1]
            want = model.proj(hidden)
            if model.config.softcap is not None:
                want = model.config.softcap * torch.tanh(want / model.config.softcap)
        assert max(abs(a - b) for a, b in zip(got, want.tolist())) <= TOL
    finally:
        engine.close()


def test_head_files_decide_the_claim(tmp_path_factory, monkeypatch):
    from colibri.testing.tiny import tiny_model

    path = tiny_model("jev-beside", tmp_path_factory.mktemp("jev-claim")).path
    (path / "judge_config.json").rename(path / "judge_config.json.off")
    try:   # without the head's files the LM is not a JEV model (and no installed family runs a dense Qwen3.5)
        with pytest.raises(FamilyError):
            resolve_model(path)
    finally:
        (path / "judge_config.json.off").rename(path / "judge_config.json")
    # with them, a family claiming the LM by its model_type is outranked by the head's claim
    from colibri import model as model_module

    real = model_module.collect_claims
    monkeypatch.setattr(model_module, "collect_claims",
                        lambda d, c: [Claim("qwen", "qwen3_5_text", "model_type"), *real(d, c)])
    assert resolve_model(path).family == "decision"
    monkeypatch.setattr(model_module, "collect_claims",
                        lambda d, c: [Claim("qwen", "qwen3_5_text"), Claim("decision", "jev")])
    with pytest.raises(FamilyError, match="claimed by"):
        resolve_model(path)


# The CLI path is the same for every layout: the head-beside one, whose info has the most to say, stands for all.
@pytest.mark.parametrize("jev_model", ["beside"], indirect=True)
def test_coli_decide_and_info(jev_model):
    """``coli decide --json`` gives transformers' answers; ``coli info`` reports the head and the layout."""
    import json
    import subprocess

    _, resolved, _, _ = jev_model
    coli = [sys.executable, "-c", "from colibri.cli import main; main()"]
    spam = ["--question", "spam:noul:Is this spam?"]
    reference = transformers.JevForDecision.from_pretrained(resolved.path, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(resolved.path)
    request = {"state": STATES["text"], "questions": {"spam": {"type": "noul", "instructions": "Is this spam?"}}}
    with torch.no_grad():
        [(inputs, questions)] = reference.decision_config.prepare_inputs(request, tokenizer)
        want = questions[0].answer(reference.decide(**inputs, decision_questions=questions)[0].softmax(-1).tolist())
    out = subprocess.run([*coli, "decide", "--model", str(resolved.path), "--state", STATES["text"], *spam, "--ctx",
                          "512", "--threads", "2", "--json"], capture_output=True, text=True, timeout=300, check=True)
    assert abs(json.loads(out.stdout)["answers"]["spam"]["noul"] - want["noul"]) <= TOL
    info = json.loads(subprocess.run([*coli, "info", "--model", str(resolved.path), "--json"], capture_output=True,
                                     text=True, timeout=120, check=True).stdout)
    assert "24 verbalizers" in json.dumps(info)


def test_heads_the_engine_cannot_run_are_refused_naming_the_file(tmp_path_factory, tmp_path):
    import shutil

    from colibri.errors import ConfigError
    from colibri.testing.tiny import tiny_model

    built = tiny_model("jev-beside", tmp_path_factory.mktemp("jev-refused")).path
    path = tmp_path / "model"
    shutil.copytree(built, path)
    (path / "adapter").mkdir()
    with pytest.raises(ConfigError, match="adapter: the backbone's LoRA is not merged"):
        hooks.build_env(resolve_model(path), None)
    (path / "adapter").rmdir()
    (path / "calibration.json").write_text('{"per_kind": {"noul": -1}}')
    with pytest.raises(ConfigError, match="calibration.json: 'per_kind'"):
        hooks.decider(resolve_model(path), None)
    (path / "judge_config.json").write_text('{"slots": {"num_slots": 24, "ranges": {"noul": [0, 99]}}}')
    with pytest.raises(ConfigError, match="slots.ranges.noul"):
        hooks.model_geometry(resolve_model(path))
