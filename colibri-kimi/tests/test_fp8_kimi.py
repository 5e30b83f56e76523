"""Native block-FP8 Kimi K2 checkpoints against transformers.

Kimi K2 ships its weights like DeepSeek-V3 (e4m3, 128x128 ``weight_scale_inv`` blocks, ``quantization_config``).
The tiny kimi_k2 model is quantized here to that format (colibri.testing.fp8) with a dense width of 200 (two
blocks, the second partial) and experts 136 wide (two blocks); the reference is transformers' DeepSeek-V3 in f32 on
the dequantized weights. Tokens and prompt logits must match at expert-cache capacity 1 and all.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from colibri.builder import build_family  # noqa: E402
from colibri.cli import app  # noqa: E402
from colibri.engine import Engine  # noqa: E402
from colibri.errors import ConfigError  # noqa: E402
from colibri.model import read_config  # noqa: E402
from colibri.records import ResolvedModel  # noqa: E402
from colibri.testing import sources  # noqa: E402
from colibri.testing.fp8 import write_dequantized, write_fp8_checkpoint  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from colibri_kimi.plugin import engine_hparams, tensor_layout  # noqa: E402
from colibri.testing.parity import GREEDY_TOKENS, LOGIT_TOL, pick_prompt  # noqa: E402
from kimi_reference import load_reference  # noqa: E402

OVERRIDES = {"intermediate_size": 200, "moe_intermediate_size": 136}


@pytest.fixture(scope="session")
def engine_binary() -> Path:
    return build_family("kimi")


@pytest.fixture(scope="session")
def models(tmp_path_factory):
    return sources.quantized_pair(tmp_path_factory.mktemp("kimi-fp8"), "kimi_k2", write_fp8_checkpoint,
                                  write_dequantized, **OVERRIDES)


def resolved(path: Path, **change) -> ResolvedModel:
    return sources.resolved(path, "kimi", **change)


def start(binary: Path, model_dir: Path, cap: int) -> Engine:
    return sources.start_engine(binary, model_dir, "kimi", engine_hparams, cap)


def test_fp8_checkpoint_matches_transformers_on_dequantized_weights(engine_binary, models):
    _, fp8_dir, deq_dir = models
    cfg = read_config(fp8_dir)
    assert cfg["model_type"] == "kimi_k2" and cfg["quantization_config"]["quant_method"] == "fp8"
    prompt, ref_logits, ref_tokens = pick_prompt(load_reference(deq_dir))
    for cap in (1, 0):
        with start(engine_binary, fp8_dir, cap) as engine:
            result = engine.generate(prompt, max_tokens=GREEDY_TOKENS, logits=True)
            stats = engine.stats()
        assert result.tokens == ref_tokens, f"cap {cap}: greedy tokens differ from transformers"
        diff = (torch.tensor(result.logits) - ref_logits).abs().max().item()
        assert diff < LOGIT_TOL, f"cap {cap}: prompt logits differ by {diff}"
        assert stats["reads"] == [2 * m for m in stats["misses"]], "weights' span + scales' span per expert"
        if cap == 1:
            assert all(m > cfg["n_routed_experts"] for m in stats["misses"]), "one slot per layer must thrash"


def test_info_counts_fp8_like_transformers(models):
    built, fp8_dir, _ = models
    result = CliRunner().invoke(app, ["info", "--json", "--model", str(fp8_dir)])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["parameters"]["total"] == built.num_parameters, "scales are not parameters"
    on_disk = sum(f.stat().st_size for f in fp8_dir.glob("*.safetensors"))
    assert 0 < on_disk - data["bytes"]["total"] < 64 * 1024, "every stored byte is counted"
    layout = tensor_layout(resolved(fp8_dir))
    assert all(len(x.tensors) == 6 for x in layout.experts), "an expert's bytes include its scales"
    assert "model.layers.1.mlp.gate.weight_scale_inv" not in layout.buffers, "the router stays float"


def test_other_quantization_configs_are_refused(models):
    _, fp8_dir, _ = models
    for qc, field in (({"quant_method": "awq"}, "quant_method"),
                      ({"quant_method": "fp8", "weight_block_size": [128, 64]}, "weight_block_size")):
        model = resolved(fp8_dir, quantization_config=qc)
        with pytest.raises(ConfigError, match=f"config.json: quantization_config.{field}"):
            engine_hparams(model)
