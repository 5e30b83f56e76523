"""The engine protocol's ``decide`` op on real engines: the scores are exactly the logits ``submit`` returns at
those rows, a pinned state is reused (a recurrent one from its checkpoint at the pin), and every bad field is a
``bad_request`` naming it, with the engine alive after it."""

from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from colibri import launch
from colibri.engine import EngineRequestError, Request
from colibri.model import resolve_model
from colibri.testing.parity import seeded_prompt

PROMPT = seeded_prompt(3, length=70)          # more than two prefill chunks of 32
MARKS = [5, 33, 70, 64]                       # unsorted, one at the chunk edge, one at the end
OPTIONS = [[7, 9], [100], [2, 3, 4, 511], [300, 7]]


@pytest.fixture(scope="module", params=[("olmoe", "colibri_olmoe"), ("qwen3_next", "colibri_qwen")])
def engine(request, tmp_path_factory):
    kind, package = request.param
    pytest.importorskip(package)
    from colibri.testing.tiny import tiny_model

    resolved = resolve_model(tiny_model(kind, tmp_path_factory.mktemp(f"decide-op-{kind}")).path)
    with launch.open_engine(resolved, ctx=256, slots=2, threads=2) as running:
        yield running


def test_scores_are_the_rows_submit_returns(engine):
    rows = np.asarray(engine.submit(PROMPT, slot=1, max_tokens=0, logits="f32").wait().logits)
    engine.reset(1)
    result = engine.decide(PROMPT, MARKS, OPTIONS, slot=1).wait()
    assert result.stats["reason"] == "decided" and result.tokens == []
    assert result.stats["prefilled_tokens"] == len(PROMPT)
    for mark, options, scores in zip(MARKS, OPTIONS, result.scores):
        # %.9g round-trips float32: the very values, not close ones
        assert [np.float32(v) for v in scores] == [rows[mark - 1][t] for t in options]


def test_a_pinned_state_is_reused_and_gives_the_same_scores(engine):
    pin = 40
    other = PROMPT[:pin] + seeded_prompt(9, length=20)
    engine.reset(0)
    first = engine.decide(PROMPT, [len(PROMPT)], [[5, 6]], slot=0, pin=pin).wait()
    second = engine.decide(other, [len(other)], [[5, 6]], slot=0, pin=pin).wait()
    assert second.accept["reused_tokens"] == pin and second.stats["prefilled_tokens"] == len(other) - pin
    # the first prompt again: the pinned state (not the second prompt's end) is what it continues from
    again = engine.decide(PROMPT, [len(PROMPT)], [[5, 6]], slot=0, pin=pin).wait()
    assert again.accept["reused_tokens"] >= pin and again.scores == first.scores
    engine.reset(1)
    fresh = engine.decide(other, [len(other)], [[5, 6]], slot=1).wait()
    assert fresh.scores == second.scores


@pytest.mark.parametrize("fields, words", [
    ({"options": OPTIONS}, '"marks" must be a non-empty array'),
    ({"marks": MARKS}, '"options" must be an array'),
    ({"marks": [0], "options": [[1]]}, '"marks"[0] must be a token count in [1, 70]'),
    ({"marks": [71], "options": [[1]]}, '"marks"[0]'),
    ({"marks": [3, 4], "options": [[1]]}, "one per mark"),
    ({"marks": [3], "options": [[]]}, '"options"[0] must be a non-empty array'),
    ({"marks": [3], "options": [[1, 512]]}, '"options"[0][1] is not a token id'),
    ({"marks": [3], "options": [[1]], "pin": 71}, '"pin" must be a token count'),
])
def test_bad_fields_are_named(engine, fields, words):
    rid = 10_000 + len(words)
    req = Request(engine, rid, 0)   # sent raw: Engine.decide always sends well-formed fields
    engine._register(req)
    engine._send({"op": "decide", "id": rid, "slot": 0, "prompt": PROMPT, **fields})
    with pytest.raises(EngineRequestError, match="bad_request") as refused:
        req.wait(timeout=30)
    assert words in str(refused.value)
    assert engine.decide(PROMPT[:8], [8], [[1, 2]]).wait().scores   # still serving
