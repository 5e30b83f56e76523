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
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import httpx  # noqa: E402

from colibri import hooks, launch  # noqa: E402
from colibri.decision import load_settings  # noqa: E402
from colibri.server.codec import TokenizerCodec  # noqa: E402
from colibri.model import resolve_model  # noqa: E402
from colibri.testing.parity import CACHE_SIZES  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "colibri-core" / "tests"))  # core's harnesses
from serve_harness import start_server  # noqa: E402
from decide_cases import QUESTIONS, STATES, check_states  # noqa: E402

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


@pytest.mark.parametrize("cap", CACHE_SIZES)
def test_systemone_matches_transformers_at_every_cache_size(family, cap):
    resolved, tok, settings, references = family

    def start_engine():
        engine = launch.open_engine(resolved, ctx=CTX, slots=2, cap=cap, threads=2)
        assert engine.ready["abilities"][:3] == ["chat", "decide", "kv_files"]   # + batched_decode where batched
        return engine

    server = start_server(resolved.path, ctx=CTX, slots=2, factory=start_engine,
                          codec=TokenizerCodec(tok, model=resolved))
    try:
        check_states(server.url, references, tok, settings)
        # a state that tokenizes past the context (the byte bound alone cannot tell)
        long_state = " ".join(f"w{i}" for i in range(400))
        refused = httpx.post(server.url + "/v1/systemone", json={"state": long_state, "questions": QUESTIONS})
        assert refused.status_code == 422 and refused.json()["error"]["param"] == "state"
    finally:
        server.stop()
