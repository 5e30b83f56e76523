"""Native int4 compressed-tensors Kimi K2-Thinking checkpoints against transformers.

Kimi K2-Thinking ships its routed experts int4 in compressed-tensors' ``pack-quantized`` format (``weight_packed``
I32, eight values per word; ``weight_scale`` BF16 per group of 32 input columns; ``weight_shape``; symmetric) and
everything else BF16 (colibri.int4_packed). The tiny kimi_k2 model is quantized here to that format
(colibri.testing.int4_packed); the reference is transformers' DeepSeek-V3 in f32 on the dequantized weights. The
engine streams the packed experts as they are (the expert store reads words + scales, the kernels form (u - 8) *
scale in f32), so tokens and prompt logits must match at every cache size, one slot per layer included (every
routed expert evicted), and the engine on the int4 checkpoint equals the engine on its dequantized copy bit for bit.
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
from colibri.testing.int4_packed import write_dequantized, write_int4_checkpoint  # noqa: E402
from colibri.testing.parity import check_every_cache_size, pick_prompt  # noqa: E402
from colibri.testing.tiny import tiny_model  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from colibri_kimi.plugin import engine_hparams, tensor_layout  # noqa: E402


@pytest.fixture(scope="session")
def engine_binary() -> Path:
    return build_family("kimi")


@pytest.fixture(scope="session")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("kimi-int4")
    built = tiny_model("kimi_k2", root / "tiny", seed=0)
    int4_dir = write_int4_checkpoint(built.path, root / "int4")
    return built, int4_dir, write_dequantized(int4_dir, root / "dequantized")


def resolved(path: Path, **change) -> ResolvedModel:
    cfg = dict(read_config(path), **change)
    return ResolvedModel(path, "kimi", cfg["model_type"], cfg)


def start(binary: Path, model_dir: Path, cap: int) -> Engine:
    argv = [str(binary), "--model", str(model_dir), "--ctx", "128", "--slots", "1", "--cap", str(cap),
            "--threads", "2", *engine_hparams(resolved(model_dir))]
    return Engine(argv)


def load_reference(path: Path):
    """transformers' DeepSeek-V3 on the kimi_k2 checkpoint (its config read as a DeepseekV3Config)."""
    data = json.loads((path / "config.json").read_text())
    data["model_type"] = "deepseek_v3"
    config = transformers.DeepseekV3Config.from_dict(data)
    return transformers.DeepseekV3ForCausalLM.from_pretrained(path, config=config, dtype=torch.float32).eval()


def test_int4_checkpoint_matches_transformers_on_dequantized_weights(engine_binary, models):
    _, int4_dir, deq_dir = models
    cfg = read_config(int4_dir)
    assert cfg["quantization_config"]["format"] == "pack-quantized"
    prompt, ref_logits, ref_tokens = pick_prompt(load_reference(deq_dir))
    moe_layers = sum(1 for i in range(cfg["num_hidden_layers"]) if i >= cfg.get("first_k_dense_replace", 0))
    runs = check_every_cache_size(lambda cap: start(engine_binary, int4_dir, cap), prompt, ref_logits, ref_tokens,
                                  moe_layers=moe_layers, experts=cfg["n_routed_experts"])
    for cap, (_, stats) in runs.items():
        # safetensors orders a shard by dtype, then name: each packed I32 matrix sits beside its I32 weight_shape,
        # so the words do not tile one span; the scales (BF16) do not either once shapes split them: six reads
        assert stats["reads"] == [6 * m for m in stats["misses"]], f"cap {cap}: three matrices + three scales"


def test_int4_checkpoint_equals_its_dequantized_copy_bit_for_bit(engine_binary, models):
    _, int4_dir, deq_dir = models
    prompt = list(range(5, 41))
    runs = []
    for model_dir in (int4_dir, deq_dir):
        with start(engine_binary, model_dir, 1) as engine:
            runs.append(engine.generate(prompt, max_tokens=8, logits=True))
    assert runs[0].tokens == runs[1].tokens and runs[0].logits == runs[1].logits


def test_info_counts_int4_like_transformers(models):
    built, int4_dir, _ = models
    result = CliRunner().invoke(app, ["info", "--json", "--model", str(int4_dir)])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["parameters"]["total"] == built.num_parameters, "eight values per I32; scales are not parameters"
    on_disk = sum(f.stat().st_size for f in int4_dir.glob("*.safetensors"))
    assert 0 < on_disk - data["bytes"]["total"] < 64 * 1024, "every stored byte is counted"
    layout = tensor_layout(resolved(int4_dir))
    ex = layout.experts[0]
    assert [n.rsplit(".", 1)[1] for n in ex.tensors] == ["weight_packed"] * 3 + ["weight_scale"] * 3
    cfg = read_config(int4_dir)
    inter, hidden = cfg["moe_intermediate_size"], cfg["hidden_size"]
    per_expert = 3 * inter * hidden // 2 + 3 * inter * hidden // 32 * 2   # nibbles + one BF16 scale per 32
    assert data["bytes"]["per_expert"] == per_expert, "an expert streams its nibbles and scales"
    result = CliRunner().invoke(app, ["doctor", "--model", str(int4_dir)])
    assert result.exit_code == 0 and "\nfail" not in result.output, result.output


@pytest.mark.parametrize("change, field", [
    ({"format": "int-quantized"}, "format"),
    ({"quantization_status": "frozen"}, "quantization_status"),
    ({"weights": {"num_bits": 8}}, "config_groups.group_0.weights.num_bits"),
    ({"weights": {"symmetric": False}}, "config_groups.group_0.weights.symmetric"),
    ({"weights": {"strategy": "channel"}}, "config_groups.group_0.weights.strategy"),
    ({"weights": {"group_size": 24}}, "config_groups.group_0.weights.group_size"),
    ({"weights": {"actorder": "group"}}, "config_groups.group_0.weights.actorder"),
    ({"input_activations": {"num_bits": 8, "type": "int"}}, "config_groups.group_0.input_activations"),
])
def test_other_compressed_tensors_variants_are_refused(models, change, field):
    _, int4_dir, _ = models
    qc = json.loads(json.dumps(read_config(int4_dir)["quantization_config"]))
    group = qc["config_groups"]["group_0"]
    for key, value in change.items():
        if key == "weights":
            group["weights"].update(value)
        elif key == "input_activations":
            group[key] = value
        else:
            qc[key] = value
    model = resolved(int4_dir, quantization_config=qc)
    with pytest.raises(ConfigError, match=f"config.json: quantization_config.{field}"):
        engine_hparams(model)
    with pytest.raises(ConfigError, match=f"quantization_config.{field}"):
        tensor_layout(model)


def _tensors(directory: Path) -> dict[str, tuple[str, bytes]]:
    """name -> (dtype, stored bytes) of every tensor of a checkpoint."""
    from colibri.checkpoint import read_header

    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        data = f.read_bytes()
        out.update({t.name: (t.dtype, data[t.begin:t.end]) for t in read_header(f).tensors})
    return out


def test_convert_reads_packed_experts_as_their_dequantized_values(engine_binary, models, tmp_path):
    """coli convert reads weight_packed as (u - 8) * scale: the container made from the int4 checkpoint is byte for
    byte the one made from its dequantized f32 copy (scales and shapes consumed, not written), and it runs."""
    _, int4_dir, deq_dir = models
    outs = []
    for src in (int4_dir, deq_dir):
        out = tmp_path / f"container-{src.name}"
        result = CliRunner().invoke(app, ["convert", "--model", str(src), "--out", str(out), "--experts", "int4",
                                          "--dense", "f32"])
        assert result.exit_code == 0, result.output
        outs.append(_tensors(out))
    from_int4, from_deq = outs
    expert_keys = sorted(k for k in from_deq if ".mlp.experts." in k)
    assert expert_keys and sorted(k for k in from_int4 if ".mlp.experts." in k) == expert_keys
    for k in expert_keys:
        assert from_int4[k] == from_deq[k], k
    prompt = list(range(7, 30))
    with start(engine_binary, tmp_path / f"container-{int4_dir.name}", 1) as engine:
        assert len(engine.generate(prompt, max_tokens=4).tokens) == 4
