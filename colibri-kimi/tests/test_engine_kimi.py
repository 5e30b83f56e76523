"""The Kimi K2 engine against transformers.

transformers has no kimi_k2 model class: Kimi K2 is the DeepSeek-V3 architecture under its own model_type, so the
tiny checkpoint is a transformers deepseek_v3 (16 experts top-4, n_group 4 / topk_group 2, one leading dense
layer, shared expert, randomized e_score_correction_bias) whose config.json says ``kimi_k2``, and the reference
is transformers' DeepseekV3ForCausalLM on the same weights. Tokens and prompt logits must match at expert-cache
capacity 1, 2 and all.
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

from colibri.builder import build_family  # noqa: E402
from colibri.engine import Engine  # noqa: E402
from colibri.errors import ConfigError  # noqa: E402
from colibri.model import read_config  # noqa: E402
from colibri.records import ResolvedModel  # noqa: E402
from colibri.testing.tiny import tiny_model  # noqa: E402

from colibri_kimi.plugin import engine_hparams, limits  # noqa: E402
from colibri.testing.parity import check_every_cache_size, pick_prompt, reference_run  # noqa: E402


# YaRN as DeepSeek-V3 / Kimi K2 ship it, shrunk so a 72-token sequence crosses the original context (16) and
# mscale != mscale_all_dim makes both the cos/sin factor and DeepSeek's softmax-scale adjustment differ from 1.
YARN = {"rope_theta": 10000.0, "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.707}

CASES = {
    "kimi_k2": {},
    "kimi_k2_yarn": dict(rope_parameters=YARN),
    "kimi_k2_qproj_halfsplit_tied": dict(q_lora_rank=None, rope_interleave=False, tie_word_embeddings=True),
}


@pytest.fixture(scope="session")
def engine_binary() -> Path:
    return build_family("kimi")


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("kimi-models")


def resolved(path: Path) -> ResolvedModel:
    cfg = read_config(path)
    return ResolvedModel(path, "kimi", cfg["model_type"], cfg)


def start(binary: Path, model_dir: Path, *, cap: int = 0) -> Engine:
    argv = [str(binary), "--model", str(model_dir), "--ctx", "128", "--slots", "1", "--cap", str(cap),
            "--threads", "2", *engine_hparams(resolved(model_dir))]
    return Engine(argv)


def load_reference(path: Path):
    """transformers' DeepSeek-V3 on the kimi_k2 checkpoint (its config read as a DeepseekV3Config)."""
    data = json.loads((path / "config.json").read_text())
    assert data["model_type"] == "kimi_k2"
    data["model_type"] = "deepseek_v3"
    config = transformers.DeepseekV3Config.from_dict(data)
    return transformers.DeepseekV3ForCausalLM.from_pretrained(path, config=config, dtype=torch.float32).eval()


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_transformers_at_every_cache_size(engine_binary, tiny_root, case):
    built = tiny_model("kimi_k2", tiny_root, seed=0, **CASES[case])
    cfg = read_config(built.path)
    assert cfg["n_routed_experts"] >= 16 and cfg["num_experts_per_tok"] == 4
    assert (cfg["n_group"], cfg["topk_group"]) == (4, 2)
    prompt, ref_logits, ref_tokens = pick_prompt(load_reference(built.path))
    check_every_cache_size(lambda cap: start(engine_binary, built.path, cap=cap), prompt, ref_logits, ref_tokens,
                           moe_layers=cfg["num_hidden_layers"] - 1, experts=cfg["n_routed_experts"])


def test_coli_run_json_matches_transformers(tiny_root):
    built = tiny_model("kimi_k2", tiny_root, seed=0)
    cmd = [sys.executable, "-c", "from colibri.cli import main; main()", "run", "Hello there, Kimi",
           "--model", str(built.path), "--temp", "0", "-n", "12", "--ctx", "128", "--threads", "2", "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["family"] == "kimi"
    _, ref_tokens, _ = reference_run(load_reference(built.path), data["prompt_ids"], len(data["generated_ids"]))
    assert data["generated_ids"] == ref_tokens


def test_unsupported_configs_are_refused(tiny_root):
    model = resolved(tiny_model("kimi_k2", tiny_root, seed=0).path)
    dynamic = {"rope_theta": 50000.0, "rope_type": "dynamic", "factor": 4.0}
    for change, match in ((dict(rope_parameters=dynamic), "dynamic"), (dict(scoring_func="softmax"), "scoring_func")):
        with pytest.raises(ConfigError, match=match):
            engine_hparams(ResolvedModel(model.path, "kimi", model.model_type, dict(model.config, **change)))
    assert limits(model).has_engine
