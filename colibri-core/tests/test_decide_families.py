"""System One decisions on real engines against transformers' ``DecisionPipeline`` (its ``decide`` path for plain
causal LMs: the label tokens' logits at each mark, the decision config's processors, ``Question.answer``).

One module parametrized over every text family's tiny recipe, like test_serve_families: the checks are the same for
every family. A family whose package is not installed is skipped. Each tiny checkpoint gets a decision.json with
single-token noul labels (the tiny tokenizers have no "Yes" token) and temperatures, so the settings path and the
logits processors are exercised too.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from colibri import hooks, launch  # noqa: E402
from colibri.decision import decide, load_settings  # noqa: E402
from colibri.model import resolve_model  # noqa: E402
from colibri.testing.parity import CACHE_SIZES  # noqa: E402

TOL = 1e-4
CTX = 512
# tiny recipe -> the package that serves it
FAMILIES = {
    "olmoe": "colibri_olmoe", "qwen2_moe": "colibri_qwen", "qwen3_moe": "colibri_qwen",
    "qwen3_next": "colibri_qwen", "qwen3_5_moe_text": "colibri_qwen", "glm4_moe": "colibri_glm",
    "glm4_moe_lite": "colibri_glm", "deepseek_v3": "colibri_deepseek_v4", "kimi_k2": "colibri_kimi",
    "kimi_linear": "colibri_kimi", "deepseek_v4": "colibri_deepseek_v4", "deepseek_v32": "colibri_deepseek_v4",
    "glm_moe_dsa": "colibri_glm", "qwen3_5_moe": "colibri_qwen",
}
# Sparse-attention recipes as their engine tests build them: 8 indexer heads (with the recipe's 2, keys often tie
# and torch breaks top-k ties in an unspecified order), index_topk well below the prompts' length.
OVERRIDES = {
    "deepseek_v32": dict(index_topk=8, index_n_heads=8), "glm_moe_dsa": dict(index_topk=8, index_n_heads=8),
    "deepseek_v4": dict(compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
                        index_n_heads=8),
}
# transformers has no class of its own for these: the architecture they are (as the families' engine tests load them)
REFERENCE_TYPE = {"kimi_k2": "deepseek_v3"}
SETTINGS = {"labels": {"noul": ["Y", "N"]}, "temperature": {"noul": 0.5, "choice": 2.0}}
QUESTIONS = {
    "spam": {"type": "noul", "instructions": "Is this spam?", "criteria": {"true": "ads", "false": None}},
    "tone": {"type": "choice", "instructions": "What is the tone?",
             "criteria": {"calm": None, "pushy": "Pressures the reader", "angry": {"signs": ["caps"]}}},
    "urgency": {"type": "score", "instructions": "How urgent is it?", "criteria": ["can wait", "this week", "today"]},
}
STATES = {
    "text": "WIN a FREE phone today, click here before midnight!",
    "json": {"message": "My card was charged twice, I want a refund.", "channel": "support"},
    "parts": [{"type": "text", "text": "Hello team,"}, {"type": "text", "text": " the build is red again."}],
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    pytest.importorskip(FAMILIES[request.param])
    from colibri.testing.tiny import tiny_model

    path = tiny_model(request.param, tmp_path_factory.mktemp(f"decide-{request.param}"),
                      **OVERRIDES.get(request.param, {})).path
    (path / "decision.json").write_text(json.dumps(SETTINGS))
    model = load_reference(path)
    pipe = transformers.pipeline("decision", model=model, tokenizer=transformers.AutoTokenizer.from_pretrained(path))
    with torch.no_grad():
        references = {name: pipe({"state": state, "questions": QUESTIONS}) for name, state in STATES.items()}
    del pipe, model
    resolved = resolve_model(path)
    return resolved, hooks.load_tokenizer(resolved), load_settings(path), references


def load_reference(path: Path):
    data = json.loads((path / "config.json").read_text())
    config = None
    if data["model_type"] in REFERENCE_TYPE:
        data["model_type"] = REFERENCE_TYPE[data["model_type"]]
        config = transformers.AutoConfig.for_model(**data)
    return transformers.AutoModelForCausalLM.from_pretrained(path, config=config, dtype=torch.float32).eval()


def assert_close(got, want, where=""):
    if isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), where
        for key in want:
            assert_close(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, float):
        assert abs(got - want) <= TOL, f"{where}: {got} vs {want}"
    else:
        assert got == want, where


@pytest.mark.parametrize("cap", CACHE_SIZES)
def test_answers_match_transformers_at_every_cache_size(family, cap):
    resolved, tok, settings, references = family
    with launch.open_engine(resolved, ctx=CTX, cap=cap, threads=2) as engine:
        assert engine.ready["abilities"] == ["chat", "decide"]
        for name, state in STATES.items():
            first = decide(engine, tok, settings, state, QUESTIONS, ctx=CTX)
            assert_close(first.answers, references[name], name)
            # the same state again on the slot: only the questions are prefilled, and nothing changes
            again = decide(engine, tok, settings, state, QUESTIONS, ctx=CTX)
            assert again.answers == first.answers
            assert first.shared_tokens > 0 and all(r >= first.shared_tokens for r in first.reused[1:])
            assert again.shared_tokens == first.shared_tokens
            assert all(r >= again.shared_tokens for r in again.reused)
            assert again.prefilled_tokens == again.input_tokens - again.cached_tokens
