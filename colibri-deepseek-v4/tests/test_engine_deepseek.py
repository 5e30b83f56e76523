"""The DeepSeek engine against transformers: deepseek_v3 (MLA) and deepseek_v32 (MLA + DSA indexer).

Every model is a tiny random checkpoint from ``colibri.testing.tiny`` (16 experts top-4, n_group 4 / topk_group 2,
one leading dense layer, shared expert, randomized e_score_correction_bias). The engine is built by core's builder
and driven through ``colibri.engine.Engine`` exactly as ``coli`` drives it; tokens and prompt logits must match
transformers at expert-cache capacity 1, 2 and all.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from colibri.builder import build_family  # noqa: E402
from colibri.engine import Engine  # noqa: E402
from colibri.errors import ConfigError  # noqa: E402
from colibri.model import read_config  # noqa: E402
from colibri.records import ResolvedModel  # noqa: E402
from colibri.testing.tiny import tiny_model  # noqa: E402

from colibri_deepseek_v4.plugin import engine_hparams, limits  # noqa: E402
from colibri.testing.parity import check_every_cache_size, LOGIT_TOL, PROMPT_TOKENS, pick_prompt  # noqa: E402


# name -> (kind, tiny_model overrides). DSA: 8 indexer heads (with 2, keys often score exactly 0 on every head
# and top-k ties are broken by torch in an unspecified order). index_topk 128 >= the whole sequence (72 tokens)
# must equal dense MLA; index_topk 8 is well below it and must equal transformers' sparse selection.
# YaRN as DeepSeek-V3 / Kimi K2 ship it, shrunk so a 72-token sequence crosses the original context (16) and
# mscale != mscale_all_dim makes both the cos/sin factor and DeepSeek's softmax-scale adjustment differ from 1.
YARN = {"rope_theta": 10000.0, "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.707}

CASES = {
    "deepseek_v3": ("deepseek_v3", {}),
    "deepseek_v3_yarn": ("deepseek_v3", dict(rope_parameters=YARN)),
    "deepseek_v32_yarn_sparse": ("deepseek_v32", dict(index_topk=8, index_n_heads=8,
                                                      rope_parameters=dict(YARN, mscale_all_dim=1.0))),
    "deepseek_v3_qproj_halfsplit_bias": ("deepseek_v3", dict(q_lora_rank=None, rope_interleave=False,
                                                              attention_bias=True)),
    "deepseek_v32_dense": ("deepseek_v32", dict(index_topk=128, index_n_heads=8)),
    "deepseek_v32_sparse": ("deepseek_v32", dict(index_topk=8, index_n_heads=8)),
}


@pytest.fixture(scope="session")
def engine_binary() -> Path:
    return build_family("deepseek-v4")


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("deepseek-models")


def resolved(path: Path) -> ResolvedModel:
    cfg = read_config(path)
    return ResolvedModel(path, "deepseek-v4", cfg["model_type"], cfg)


def start(binary: Path, model_dir: Path, *, ctx: int = 128, cap: int = 0) -> Engine:
    """The engine with the eviction policy launch gives a partial cache by default (set dueling)."""
    argv = [str(binary), "--model", str(model_dir), "--ctx", str(ctx), "--slots", "1", "--cap", str(cap),
            "--threads", "2", "--pin", "duel" if cap else "off", *engine_hparams(resolved(model_dir))]
    return Engine(argv)


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_transformers_at_every_cache_size(engine_binary, tiny_root, case):
    kind, overrides = CASES[case]
    built = tiny_model(kind, tiny_root, seed=0, **overrides)
    cfg = read_config(built.path)
    assert cfg["n_routed_experts"] >= 16 and cfg["num_experts_per_tok"] == 4
    assert (cfg["n_group"], cfg["topk_group"]) == (4, 2)
    reference = transformers.AutoModelForCausalLM.from_pretrained(built.path, dtype=torch.float32).eval()
    prompt, ref_logits, ref_tokens = pick_prompt(reference)
    moe_layers = cfg["num_hidden_layers"] - 1          # tiny: one leading dense layer
    check_every_cache_size(lambda cap: start(engine_binary, built.path, cap=cap), prompt, ref_logits, ref_tokens,
                           moe_layers=moe_layers, experts=cfg["n_routed_experts"])


def test_dsa_sparse_selection_is_active(engine_binary, tiny_root):
    """Same weights, index_topk 8 vs 128: positions that hold <= 8 keys are bit-identical, later ones differ."""
    dense = tiny_model("deepseek_v32", tiny_root, seed=0, **CASES["deepseek_v32_dense"][1])
    sparse = tiny_model("deepseek_v32", tiny_root, seed=0, **CASES["deepseek_v32_sparse"][1])
    rng = random.Random(0)
    prompt = [rng.randrange(2, 512) for _ in range(PROMPT_TOKENS)]
    with start(engine_binary, dense.path) as engine:
        a = torch.tensor(engine.generate(prompt, max_tokens=1, logits=True).logits)
    with start(engine_binary, sparse.path) as engine:
        b = torch.tensor(engine.generate(prompt, max_tokens=1, logits=True).logits)
    assert torch.equal(a[:8], b[:8])
    assert (a[8:] - b[8:]).abs().amax(dim=-1).min().item() > 100 * LOGIT_TOL


def test_unsupported_configs_are_refused(tiny_root):
    model = resolved(tiny_model("deepseek_v3", tiny_root, seed=0).path)
    dynamic = {"rope_theta": 10000.0, "rope_type": "dynamic", "factor": 4.0}
    for change, match in ((dict(rope_parameters=dynamic), "dynamic"), (dict(scoring_func="softmax"), "scoring_func"),
                          (dict(topk_method="greedy"), "topk_method")):
        cfg = dict(model.config, **change)
        with pytest.raises(ConfigError, match=match):
            engine_hparams(ResolvedModel(model.path, "deepseek-v4", model.model_type, cfg))
    v4 = ResolvedModel(model.path, "deepseek-v4", "deepseek_v4", model.config)
    assert limits(v4).has_engine and not limits(v4).quant_schemes   # engine/deepseek_v4.c, its own tests
    assert limits(model).has_engine
