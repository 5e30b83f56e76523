"""The GLM engine against transformers: glm4_moe (GQA), glm4_moe_lite (MLA) and glm_moe_dsa (MLA + DSA).

Every model is a tiny random checkpoint from ``colibri.testing.tiny`` (16 experts top-4, n_group 4 / topk_group 2,
one leading dense layer, shared expert, e_score_correction_bias drawn at 0.25 so it changes which experts win).
The engine is built by core's builder and driven through ``colibri.engine.Engine`` exactly as ``coli`` drives it.
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
transformers = pytest.importorskip("transformers")

from colibri import launch  # noqa: E402
from colibri.builder import build_family  # noqa: E402
from colibri.engine import Engine  # noqa: E402
from colibri.errors import ConfigError  # noqa: E402
from colibri.model import read_config, resolve_model  # noqa: E402
from colibri.records import ResolvedModel  # noqa: E402
from colibri.testing.tiny import tiny_model  # noqa: E402

from colibri_glm.plugin import engine_hparams, model_geometry  # noqa: E402
from colibri.testing.parity import (  # noqa: E402
    check_every_cache_size, LOGIT_TOL, pick_prompt, reference_run, seeded_prompt,
)

F32 = 4

# YaRN shrunk so the 72-token sequence runs well past the original context (16): with the tiny models' rotary
# widths the lowest frequencies are interpolated (divided by 4), the highest kept, and cos/sin scaled by
# 0.1 ln 4 + 1 (transformers' _compute_yarn_parameters with no attention_factor / mscale given).
YARN = {"rope_theta": 10000.0, "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
YARN_MSCALE = dict(YARN, mscale=1.0, mscale_all_dim=0.707)

# name -> (kind, tiny_model overrides). The DSA indexer uses 8 heads: with 2, a key often scores exactly 0 on
# every head (relu), and exact ties at the top-k boundary are broken by torch.topk in an unspecified order.
# Real GLM-5 has 32 indexer heads. DSA keys are kept when index_topk >= the sequence (prompt + generated = 72):
# that must equal dense MLA; index_topk 8 is well below it and must equal transformers' sparse selection.
CASES = {
    "glm4_moe": ("glm4_moe", {}),                                   # qkv bias + per-head q/k norm, partial RoPE
    # head_dim 16 x 0.3125 = 5 rotary dims: transformers rotates 2 * ceil(5 / 2) = 6, frequencies over 5.
    "glm4_moe_odd_rotary": ("glm4_moe", dict(partial_rotary_factor=0.3125)),
    "glm4_moe_plain_tied": ("glm4_moe", dict(use_qk_norm=False, attention_bias=False, tie_word_embeddings=True)),
    "glm4_moe_lite": ("glm4_moe_lite", {}),                         # q_a/q_b LoRA, interleaved RoPE
    "glm4_moe_lite_qproj_halfsplit_bias": ("glm4_moe_lite",
                                           dict(q_lora_rank=None, rope_interleave=False, attention_bias=True)),
    "glm_moe_dsa_dense": ("glm_moe_dsa", dict(index_topk=128, index_n_heads=8)),
    "glm_moe_dsa_sparse": ("glm_moe_dsa", dict(index_topk=8, index_n_heads=8)),
    "glm_moe_dsa_sparse_shared": ("glm_moe_dsa", dict(index_topk=8, index_n_heads=8, num_layers=4,
                                                      indexer_types=["full", "shared", "full", "shared"])),
    # bf16 weights (router and bias stay f32, as transformers keeps them): the absorbed key half of kv_b_proj is
    # transposed in the stored dtype. transformers runs f32 on the same bf16 values, so the f32 tolerance holds.
    "glm_moe_dsa_sparse_bf16": ("glm_moe_dsa", dict(index_topk=8, index_n_heads=8, dtype="bfloat16")),
    # YaRN (see YARN below). glm4_moe: half the head rotates, and only that half takes the cos/sin factor.
    "glm4_moe_yarn": ("glm4_moe", dict(rope_parameters=dict(YARN, partial_rotary_factor=0.5))),
    # The MLA types also scale the softmax by mscale(factor, mscale_all_dim)^2; mscale != mscale_all_dim makes
    # that and the cos/sin factor both differ from 1. The DSA indexer rotates only part of its key, and only that
    # part takes the cos/sin factor (1.14 here), or its sparse selection would differ from transformers'.
    "glm4_moe_lite_yarn": ("glm4_moe_lite", dict(rope_parameters=YARN_MSCALE)),
    "glm_moe_dsa_yarn_sparse": ("glm_moe_dsa", dict(index_topk=8, index_n_heads=8, rope_parameters=YARN)),
}


@pytest.fixture(scope="session")
def engine_binary() -> Path:
    return build_family("glm")


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("glm-models")


def resolved(path: Path) -> ResolvedModel:
    cfg = read_config(path)
    return ResolvedModel(path, "glm", cfg["model_type"], cfg)


def start(binary: Path, model_dir: Path, *, ctx: int = 128, slots: int = 1, cap: int = 0) -> Engine:
    argv = [str(binary), "--model", str(model_dir), "--ctx", str(ctx), "--slots", str(slots), "--cap", str(cap),
            "--threads", "2", *engine_hparams(resolved(model_dir))]
    return Engine(argv)


def load_reference(path: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_transformers_at_every_cache_size(engine_binary, tiny_root, case):
    kind, overrides = CASES[case]
    built = tiny_model(kind, tiny_root, seed=0, **overrides)
    cfg = read_config(built.path)
    prompt, ref_logits, ref_tokens = pick_prompt(load_reference(built.path))
    moe_layers = sum(1 for i in range(cfg["num_hidden_layers"]) if i >= 1)   # tiny: one leading dense layer
    check_every_cache_size(lambda cap: start(engine_binary, built.path, cap=cap), prompt, ref_logits, ref_tokens,
                           moe_layers=moe_layers, experts=cfg["n_routed_experts"])


def test_dsa_sparse_selection_is_active(engine_binary, tiny_root):
    """Same weights, index_topk 8 vs 128: positions that hold <= 8 keys are bit-identical, later ones differ."""
    dense = tiny_model("glm_moe_dsa", tiny_root, seed=0, **CASES["glm_moe_dsa_dense"][1])
    sparse = tiny_model("glm_moe_dsa", tiny_root, seed=0, **CASES["glm_moe_dsa_sparse"][1])
    prompt = seeded_prompt(0)
    with start(engine_binary, dense.path) as engine:
        a = torch.tensor(engine.generate(prompt, max_tokens=1, logits=True).logits)
    with start(engine_binary, sparse.path) as engine:
        b = torch.tensor(engine.generate(prompt, max_tokens=1, logits=True).logits)
    assert torch.equal(a[:8], b[:8])
    assert (a[8:] - b[8:]).abs().amax(dim=-1).min().item() > 100 * LOGIT_TOL


@pytest.mark.parametrize("case", ["glm4_moe", "glm4_moe_lite", "glm_moe_dsa_sparse_shared"])
def test_batched_prefill_is_bit_identical_to_one_token_at_a_time(engine_binary, tiny_root, case):
    kind, overrides = CASES[case]
    built = tiny_model(kind, tiny_root, seed=0, **overrides)
    prompt = seeded_prompt(7, length=37)
    with start(engine_binary, built.path, cap=2) as engine:
        batched = engine.generate(prompt, max_tokens=1, logits=True).logits
        engine.reset(0)
        single = []
        for i in range(1, len(prompt) + 1):
            r = engine.generate(prompt[:i], max_tokens=1, logits=True)
            assert r.accept["reused_tokens"] == i - 1
            single.append(r.logits[0])
    assert single == batched  # %.9g round-trips f32 exactly: bit equality


@pytest.mark.parametrize("kind", ["glm4_moe", "glm4_moe_lite", "glm_moe_dsa"])
def test_plan_kv_bytes_equal_the_engines_allocation(tiny_root, kind):
    built = tiny_model(kind, tiny_root, seed=0)
    model = resolve_model(str(built.path))
    cfg, n = model.config, model.config["num_hidden_layers"]
    per_token = model_geometry(model).kv_bytes_per_token
    if kind == "glm4_moe":
        assert per_token == 2 * cfg["num_key_value_heads"] * cfg["head_dim"] * F32 * n
    else:
        # The compressed cache: latent + shared RoPE key per token and layer (+ the DSA indexer's key).
        width = cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"] + (cfg["index_head_dim"] if kind == "glm_moe_dsa" else 0)
        assert per_token == width * n * F32
    spec = launch.prepare(model, ctx=96, slots=2, threads=2, ram_gib=4)
    assert spec.plan.kv_bytes == per_token * 96 * 2
    with launch.start(spec) as engine:
        assert engine.ready["kv_bytes"] == spec.plan.kv_bytes


def test_coli_run_json_matches_transformers(tiny_root):
    built = tiny_model("glm4_moe_lite", tiny_root, seed=0)
    cmd = [sys.executable, "-c", "from colibri.cli import main; main()", "run", "Hello there, GLM",
           "--model", str(built.path), "--temp", "0", "-n", "12", "--ctx", "128", "--threads", "2", "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["family"] == "glm" and data["mode"] == "chat"
    _, ref_tokens, _ = reference_run(load_reference(built.path), data["prompt_ids"], len(data["generated_ids"]))
    assert data["generated_ids"] == ref_tokens


def test_bad_indexer_and_rope_configs_are_refused(tiny_root):
    built = tiny_model("glm_moe_dsa", tiny_root, seed=0)
    model = resolved(built.path)
    cfg = dict(model.config, indexer_types=["shared", "full", "full"])
    with pytest.raises(ConfigError, match="indexer_types"):
        engine_hparams(ResolvedModel(model.path, "glm", model.model_type, cfg))
    cfg = dict(model.config, rope_parameters={"rope_theta": 10000.0, "rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ConfigError, match="yarn rope scaling needs 'original_max_position_embeddings'"):
        engine_hparams(ResolvedModel(model.path, "glm", model.model_type, cfg))
    cfg = dict(model.config, rope_parameters={"rope_theta": 10000.0, "rope_type": "dynamic", "factor": 4.0})
    with pytest.raises(ConfigError, match="rope type 'dynamic'"):
        engine_hparams(ResolvedModel(model.path, "glm", model.model_type, cfg))


def test_yarn_hparams_follow_transformers_conventions(tiny_root):
    """The cos/sin factor and the MLA softmax scale, as transformers derives them for each GLM type."""
    import math

    def hparams(kind: str, rope: dict) -> dict[str, str]:
        model = resolved(tiny_model(kind, tiny_root, seed=0).path)
        cfg = dict(model.config, rope_parameters=rope)
        args = engine_hparams(ResolvedModel(model.path, "glm", kind, cfg))
        return dict(a.split("=", 1) for a in args[1::2])

    plain = hparams("glm4_moe", dict(YARN, partial_rotary_factor=0.5))
    assert math.isclose(float(plain["rope_attention_factor"]), 0.1 * math.log(4) + 1)
    assert "attention_scale" not in plain          # glm4_moe keeps head_dim^-0.5
    lite = hparams("glm4_moe_lite", YARN_MSCALE)
    mscale = 0.1 * 0.707 * math.log(4) + 1
    assert math.isclose(float(lite["rope_attention_factor"]), (0.1 * math.log(4) + 1) / mscale)
    assert math.isclose(float(lite["attention_scale"]), (16 + 8) ** -0.5 * mscale ** 2)
    assert lite["rope_original_max_position"] == "16" and float(lite["rope_factor"]) == 4.0
