"""The C sampler's logits processors and log-probabilities, held to transformers on real engines.

Distributions, not sampled tokens: the submit's debug field ``dist`` makes the engine report, at each step, the
raw logits it sampled from and the final distribution after every processor. The same raw logits go through
transformers' processors (SequenceBias, RepetitionPenalty, Temperature, TopK, TopP, MinP; presence and
frequency penalties as OpenAI and vLLM define them: ``logit - frequency * count - presence * (count > 0)`` over
the generated tokens) and the two distributions must agree within 1e-4. Teacher forcing (``forced``) fixes the
history, so the penalties see the same tokens on both sides.

Log-probabilities: on a tiny random model of every text family, the top-20 the engine reports with each token
equal transformers' log-softmax of the same step within 1e-4.
"""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest

TOL = 1e-4
# one kind per family package, each with a transformers reference
FAMILIES = {"olmoe": "colibri_olmoe", "qwen3_moe": "colibri_qwen", "glm4_moe": "colibri_glm",
            "deepseek_v3": "colibri_deepseek_v4", "kimi_k2": "colibri_kimi"}
PROMPT = [5, 77, 301, 12, 450, 9, 33, 260]
FORCED = [77, 5, 77, 12, 400, 77]


def open_engine(path):
    from colibri import launch
    from colibri.model import resolve_model

    return launch.open_engine(resolve_model(str(path)), ctx=64, slots=1, threads=1)


def f32(text: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(text), "<f4").astype(np.float64)


def reference_probs(raw: np.ndarray, history: list[int], generated: list[int], case: dict) -> np.ndarray:
    """transformers' processors (and OpenAI's penalties) on one step's raw logits."""
    import torch
    from transformers.generation import logits_process as lp

    ids = torch.tensor([history])
    scores = torch.tensor(raw, dtype=torch.float32)[None]
    if case.get("logit_bias"):
        bias = lp.SequenceBiasLogitsProcessor({(t,): b for t, b in case["logit_bias"]})
        scores = bias(ids, scores)
    if case.get("repetition_penalty"):
        scores = lp.RepetitionPenaltyLogitsProcessor(case["repetition_penalty"])(ids, scores)
    counts = np.bincount(generated, minlength=raw.size) if generated else np.zeros(raw.size)
    penalty = case.get("frequency_penalty", 0.0) * counts + case.get("presence_penalty", 0.0) * (counts > 0)
    scores = scores - torch.tensor(penalty, dtype=torch.float32)[None]
    temperature = case.get("temperature", 1.0)
    if temperature == 0:
        out = np.zeros(raw.size)
        out[int(scores.argmax())] = 1.0
        return out
    scores = lp.TemperatureLogitsWarper(temperature)(ids, scores)
    if case.get("top_k"):
        scores = lp.TopKLogitsWarper(case["top_k"])(ids, scores)
    if case.get("top_p"):
        scores = lp.TopPLogitsWarper(case["top_p"])(ids, scores)
    if case.get("min_p"):
        scores = lp.MinPLogitsWarper(case["min_p"])(ids, scores)
    return torch.softmax(scores.double(), -1)[0].numpy()


CASES = {
    "min_p": {"temperature": 1.0, "min_p": 0.3},
    "repetition": {"temperature": 0.7, "repetition_penalty": 1.8},
    "presence_frequency": {"temperature": 1.0, "presence_penalty": 1.5, "frequency_penalty": 0.7},
    "logit_bias": {"temperature": 1.0, "logit_bias": [[7, 4.0], [77, -100.0], [300, 2.5]]},
    "warpers": {"temperature": 0.6, "top_k": 40, "top_p": 0.8, "min_p": 0.05},
    "everything": {"temperature": 1.3, "top_k": 100, "top_p": 0.95, "min_p": 0.02, "repetition_penalty": 1.3,
                   "presence_penalty": -0.5, "frequency_penalty": 0.4, "logit_bias": [[77, 3.0]]},
    "greedy_penalised": {"temperature": 0.0, "repetition_penalty": 5.0, "frequency_penalty": 2.0},
}


@pytest.fixture(scope="module")
def olmoe_engine(tiny_root):
    pytest.importorskip("colibri_olmoe")
    from colibri.testing.tiny import tiny_model

    with open_engine(tiny_model("olmoe", tiny_root).path) as engine:
        yield engine


@pytest.mark.parametrize("name", sorted(CASES))
def test_filtered_distribution_equals_transformers_processors(olmoe_engine, name):
    case = CASES[name]
    request = olmoe_engine.submit(PROMPT, max_tokens=len(FORCED) + 1, seed=3, forced=FORCED, dist=True,
                                  **{"temperature": 1.0, "top_p": 1.0, "top_k": 0, **case})
    steps = [ev for ev in request if ev["ev"] == "dist"]
    assert [ev["step"] for ev in steps] == list(range(len(FORCED) + 1))
    for ev in steps:
        k = ev["step"]
        probs = f32(ev["probs"])
        expected = reference_probs(f32(ev["logits"]), PROMPT + FORCED[:k], FORCED[:k], case)
        assert np.abs(probs - expected).max() < TOL, (name, k)
        # the same tokens survive the filters (a -100 bias leaves e^-100: zero in float32, not in float64)
        assert ((probs > 1e-20) == (expected > 1e-20)).all(), (name, k)


def test_bad_processor_fields_are_refused_by_name(olmoe_engine):
    from colibri.engine import EngineRequestError

    for bad, field in (({"min_p": 1.5}, "min_p"), ({"repetition_penalty": 0}, "repetition_penalty"),
                       ({"logit_bias": [[512, 1.0]]}, "logit_bias"), ({"logprobs": 21}, "logprobs"),
                       ({"presence_penalty": 3}, "presence_penalty")):
        with pytest.raises(EngineRequestError, match=field):
            olmoe_engine.generate(PROMPT, max_tokens=1, **bad)


def test_the_mask_restricts_every_step_and_waits_for_each(olmoe_engine):
    """constrained: each step samples only among the allowed tokens, and only once its mask arrived."""
    words = (olmoe_engine.ready["vocab"] + 31) // 32
    allowed = [[3, 4], [300], [9, 10, 11]]

    def mask(tokens):
        bits = np.zeros(words, "<u4")
        for t in tokens:
            bits[t // 32] |= np.uint32(1 << (t % 32))
        return bits.tobytes()

    request = olmoe_engine.submit(PROMPT, max_tokens=3, temperature=1.5, seed=1, constrained=True)
    olmoe_engine.mask(request, mask(allowed[0]))
    got = []
    for ev in request:
        if ev["ev"] == "token":
            got.append(ev["tok"])
            if len(got) < len(allowed):
                olmoe_engine.mask(request, mask(allowed[len(got)]))
    assert [t in a for t, a in zip(got, allowed)] == [True] * 3
    assert request.stats["reason"] == "length"


def load_reference(path):
    """transformers' model of a tiny checkpoint (a renamed architecture read as the one transformers builds)."""
    import torch
    import transformers
    from colibri.testing.tiny import recipes

    data = json.loads((path / "config.json").read_text())
    kind = next(k for k, r in recipes().items() if getattr(r, "saved_model_type", None) == data["model_type"]
                or getattr(r, "model_type", None) == data["model_type"])
    data["model_type"] = recipes()[kind].model_type
    config = transformers.AutoConfig.for_model(**data)
    return transformers.AutoModelForCausalLM.from_pretrained(path, config=config, dtype=torch.float32).eval()


@pytest.mark.parametrize("kind", sorted(FAMILIES))
def test_top_logprobs_equal_transformers_log_softmax(tiny_root, kind):
    pytest.importorskip(FAMILIES[kind])
    import torch
    from colibri.testing.tiny import tiny_model

    path = tiny_model(kind, tiny_root).path
    with open_engine(path) as engine:
        events = [ev for ev in engine.submit(PROMPT, max_tokens=len(FORCED) + 1, forced=FORCED, logprobs=20)
                  if ev["ev"] == "token"]
    model = load_reference(path)
    ids = torch.tensor([PROMPT + FORCED])
    with torch.no_grad():
        logits = model(ids, attention_mask=torch.ones_like(ids)).logits[0].double()
    reference = torch.log_softmax(logits, -1).numpy()
    assert len(events) == len(FORCED) + 1
    for k, ev in enumerate(events):
        row = reference[len(PROMPT) - 1 + k]
        top = ev["top"]
        assert len(top) == 20
        assert abs(ev["logprob"] - row[ev["tok"]]) < TOL
        assert all(abs(lp - row[t]) < TOL for t, lp in top), (kind, k)
        assert np.abs(np.array([lp for _, lp in top]) - np.sort(row)[::-1][:20]).max() < TOL, (kind, k)
