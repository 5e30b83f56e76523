"""Native block-FP8 GLM-5 (glm_moe_dsa) checkpoints against transformers.

zai-org/GLM-5-FP8 ships its weights like DeepSeek-V3 (e4m3, 128x128 ``weight_scale_inv`` blocks,
``quantization_config`` {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], "activation_scheme":
"dynamic"}), the DSA indexer's ``wq_b`` and ``wk`` included, its ``weights_proj``, routers, embeddings and LM head
left BF16. The tiny glm_moe_dsa model is quantized here to that format (colibri.testing.fp8) with a dense width of
200 (two blocks, the second partial) and experts 136 wide; the reference is transformers in f32 on the dequantized
weights. Tokens and prompt logits must match at every cache size, one slot per layer included (every routed expert
evicted), with the indexer's top-8 sparse over the 72 positions.
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
from colibri.testing.fp8 import write_dequantized, write_fp8_checkpoint  # noqa: E402
from colibri.testing.parity import check_every_cache_size, pick_prompt  # noqa: E402
from colibri.testing.tiny import tiny_model  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from colibri_glm.plugin import engine_hparams, tensor_layout  # noqa: E402

# seed 1: at seed 0 with these widths the float checkpoint itself has a near-tie in the indexer's top-8 (the engine
# and transformers keep different keys), which would test DSA tie-breaking rather than fp8.
SEED = 1
OVERRIDES = {"intermediate_size": 200, "moe_intermediate_size": 136, "index_topk": 8, "index_n_heads": 8}


@pytest.fixture(scope="session")
def engine_binary() -> Path:
    return build_family("glm")


@pytest.fixture(scope="session")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("glm5-fp8")
    built = tiny_model("glm_moe_dsa", root / "tiny", seed=SEED, **OVERRIDES)
    fp8_dir = write_fp8_checkpoint(built.path, root / "fp8")
    return built, fp8_dir, write_dequantized(fp8_dir, root / "dequantized")


def resolved(path: Path, **change) -> ResolvedModel:
    cfg = dict(read_config(path), **change)
    return ResolvedModel(path, "glm", cfg["model_type"], cfg)


def start(binary: Path, model_dir: Path, cap: int) -> Engine:
    argv = [str(binary), "--model", str(model_dir), "--ctx", "128", "--slots", "1", "--cap", str(cap),
            "--threads", "2", *engine_hparams(resolved(model_dir))]
    return Engine(argv)


def test_fp8_glm5_matches_transformers_on_dequantized_weights(engine_binary, models):
    _, fp8_dir, deq_dir = models
    cfg = read_config(fp8_dir)
    assert cfg["model_type"] == "glm_moe_dsa" and cfg["quantization_config"]["quant_method"] == "fp8"
    reference = transformers.AutoModelForCausalLM.from_pretrained(deq_dir, dtype=torch.float32).eval()
    prompt, ref_logits, ref_tokens = pick_prompt(reference)
    moe_layers = cfg["num_hidden_layers"] - 1   # tiny: one leading dense layer
    runs = check_every_cache_size(lambda cap: start(engine_binary, fp8_dir, cap), prompt, ref_logits, ref_tokens,
                                  moe_layers=moe_layers, experts=cfg["n_routed_experts"])
    for cap, (_, stats) in runs.items():
        assert stats["reads"] == [2 * m for m in stats["misses"]], f"cap {cap}: weights' span + scales' span"


def test_fp8_glm5_equals_its_dequantized_copy_bit_for_bit(engine_binary, models):
    """The kernels form e4m3 * scale in f32 and sum as the float kernels do (indexer projections included)."""
    _, fp8_dir, deq_dir = models
    prompt = list(range(3, 40))
    runs = []
    for model_dir in (fp8_dir, deq_dir):
        with start(engine_binary, model_dir, 0) as engine:
            runs.append(engine.generate(prompt, max_tokens=8, logits=True))
    assert runs[0].tokens == runs[1].tokens and runs[0].logits == runs[1].logits


def test_info_counts_fp8_glm5_like_transformers(models):
    built, fp8_dir, _ = models
    result = CliRunner().invoke(app, ["info", "--json", "--model", str(fp8_dir)])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["parameters"]["total"] == built.num_parameters, "scales are not parameters"
    on_disk = sum(f.stat().st_size for f in fp8_dir.glob("*.safetensors"))
    assert 0 < on_disk - data["bytes"]["total"] < 64 * 1024, "every stored byte is counted"
    layout = tensor_layout(resolved(fp8_dir))
    assert all(len(x.tensors) == 6 for x in layout.experts), "an expert's bytes include its scales"
    assert "model.layers.1.self_attn.indexer.wk.weight_scale_inv" in layout.buffers
    assert "model.layers.1.self_attn.indexer.weights_proj.weight_scale_inv" not in layout.buffers
    result = CliRunner().invoke(app, ["doctor", "--model", str(fp8_dir)])
    assert result.exit_code == 0 and "\nfail" not in result.output, result.output


def test_other_quantization_configs_are_refused_for_glm5(models):
    _, fp8_dir, _ = models
    for qc, field in (({"quant_method": "awq"}, "quant_method"),
                      ({"quant_method": "fp8", "weight_block_size": [128, 64]}, "weight_block_size"),
                      ({"quant_method": "compressed-tensors", "format": "float-quantized"}, "format")):
        model = resolved(fp8_dir, quantization_config=qc)
        with pytest.raises(ConfigError, match=f"config.json: quantization_config.{field}"):
            engine_hparams(model)
        with pytest.raises(ConfigError, match=f"quantization_config.{field}"):
            tensor_layout(model)
