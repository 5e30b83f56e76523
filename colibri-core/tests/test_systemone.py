"""``POST /v1/systemone`` refusals: every bad request is a 422 naming the question and field (or a 400 for a model
that cannot decide), before any engine work, never a 500. The answers themselves are checked against transformers
on every family in test_decide_families."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parent))  # the harness beside this file (importlib mode)
from serve_harness import build_tokenizer_dir, start_server

from colibri.records import ResolvedModel
from colibri.server.codec import TokenizerCodec
from colibri.tokenizer import load_tokenizer_dir

CTX = 128
GOOD = {"spam": {"type": "noul", "instructions": "Is this spam?"}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tokenizer_dir(tmp_path_factory.mktemp("systemone") / "tiny-chat")


@pytest.fixture(scope="module")
def server(model_dir):
    # the fake engine announces no abilities: it cannot decide, but every refusal comes before the engine
    codec = TokenizerCodec(load_tokenizer_dir(model_dir), model=ResolvedModel(model_dir, "fake", "fake", {}))
    running = start_server(model_dir, ctx=CTX, slots=2, codec=codec, api_key="sekret")
    yield running
    running.stop()


def post(server, body, key="sekret"):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(server.url + "/v1/systemone", json=body, headers=headers, timeout=30)


def many(n):
    return {f"q{i}": {"type": "noul", "instructions": f"Question {i}?"} for i in range(n)}


@pytest.mark.parametrize("body, field, words", [
    ({"state": "x", "questions": {}}, "questions", "1 to 64"),
    ({"state": "x", "questions": many(65)}, "questions", "65 questions"),
    ({"state": "x", "questions": {"q": {"type": "rank", "instructions": "?"}}}, "questions.q.type", "noul, choice"),
    ({"state": "x", "questions": {"q": {"type": "choice", "criteria": {"only": None}}}}, "questions.q.criteria",
     "at least 2 options"),
    ({"state": "x", "questions": {"q": {"type": "score", "criteria": "high"}}}, "questions.q.criteria", "2 levels"),
    ({"state": "x", "questions": {"q": {"type": "noul", "criteria": {"maybe": "?"}}}}, "questions.q.criteria.maybe",
     "'true' and 'false'"),
    ({"state": "x", "questions": {"q": {"type": "noul", "color": "red"}}}, "questions.q.color", "unknown field"),
    ({"state": "x", "questions": {"q": {"type": "noul", "instructions": 3}}}, "questions.q.instructions", "string"),
    ({"state": "x", "questions": {"q": "Is it?"}}, "questions.q", "object"),
    ({"state": "x", "questions": {"q": {"type": "choice", "criteria": dict.fromkeys("abcdefghijklmnopqrstuvwxyz!")}}},
     "questions.q.criteria", "at most 26"),
    ({"questions": GOOD}, "state", "required"),
    ({"state": 3, "questions": GOOD}, "state", "string, an object"),
    ({"state": [{"type": "image", "image": "x"}], "questions": GOOD}, "state[0]", "images"),
    ({"state": "y" * 5000, "questions": GOOD}, "state", "context holds 128"),
    ({"state": "x", "questions": GOOD, "cache_slot": 2}, "cache_slot", "between 0 and 1"),
    ({"state": "x", "questions": GOOD, "normalize": "yes"}, "normalize", "boolean"),
    ({"state": "x", "questions": GOOD, "stream": True}, "stream", "unknown field"),
    ({"state": "a\u0000b", "questions": GOOD}, "state", "NUL"),
])
def test_bad_requests_are_422_naming_the_field(server, body, field, words):
    reply = post(server, body)
    assert reply.status_code == 422, reply.text
    error = reply.json()["error"]
    assert error["param"] == field and words in error["message"], error


def test_a_model_that_cannot_decide_is_400(server):
    reply = post(server, {"state": "Buy now!", "questions": GOOD})
    assert reply.status_code == 400
    assert reply.json()["error"]["code"] == "model_cannot_decide"


def test_same_key_gate_as_the_other_routes(server):
    assert post(server, {"state": "x", "questions": GOOD}, key=None).status_code == 401
    assert httpx.get(server.url + "/v1/systemone", headers={"Authorization": "Bearer sekret"}).status_code == 405


def test_not_json_is_a_clean_400(server):
    reply = httpx.post(server.url + "/v1/systemone", content=b"{", headers={"Authorization": "Bearer sekret",
                                                                           "Content-Type": "application/json"})
    assert reply.status_code == 400 and reply.json()["error"]["code"] == "invalid_json"
