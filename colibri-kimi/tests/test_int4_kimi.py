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
from colibri.model import read_config  # noqa: E402
from colibri.testing import sources  # noqa: E402
from colibri.testing.int4_packed import write_dequantized, write_int4_checkpoint  # noqa: E402
from kimi_reference import load_reference  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from colibri_kimi.plugin import engine_hparams, tensor_layout  # noqa: E402


@pytest.fixture(scope="session")
def engine_binary() -> Path:
    return build_family("kimi")


@pytest.fixture(scope="session")
def models(tmp_path_factory):
    return sources.quantized_pair(tmp_path_factory.mktemp("kimi-int4"), "kimi_k2", write_int4_checkpoint,
                                  write_dequantized)


def start(binary: Path, model_dir: Path, cap: int):
    return sources.start_engine(binary, model_dir, "kimi", engine_hparams, cap)


def test_int4_checkpoint_matches_transformers_and_its_dequantized_copy(engine_binary, models):
    """Every cache size against transformers; bit for bit against the dequantized copy. safetensors orders a shard
    by dtype, then name: each packed I32 matrix sits beside its I32 weight_shape, so the words do not tile one span
    and the scales are read one by one too: six reads per miss."""
    _, int4_dir, deq_dir = models
    cfg = read_config(int4_dir)
    assert cfg["quantization_config"]["format"] == "pack-quantized"
    moe_layers = sum(1 for i in range(cfg["num_hidden_layers"]) if i >= cfg.get("first_k_dense_replace", 0))
    sources.check_against_dequantized(lambda d, cap: start(engine_binary, d, cap), int4_dir, deq_dir,
                                      load_reference(deq_dir), moe_layers=moe_layers, experts=cfg["n_routed_experts"],
                                      reads_per_miss=6)


def test_info_counts_int4_like_transformers(models):
    built, int4_dir, _ = models
    data = sources.info_counts(int4_dir, built.num_parameters)   # eight values per I32
    layout = tensor_layout(sources.resolved(int4_dir, "kimi"))
    assert [n.rsplit(".", 1)[1] for n in layout.experts[0].tensors] == ["weight_packed"] * 3 + ["weight_scale"] * 3
    cfg = read_config(int4_dir)
    inter, hidden = cfg["moe_intermediate_size"], cfg["hidden_size"]
    per_expert = 3 * inter * hidden // 2 + 3 * inter * hidden // 32 * 2   # nibbles + one BF16 scale per 32
    assert data["bytes"]["per_expert"] == per_expert, "an expert streams its nibbles and scales"


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
    sources.refuses(sources.resolved(int4_dir, "kimi", quantization_config=qc), field, engine_hparams, tensor_layout)


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
        outs.append({k: v for k, v in sources.stored_tensors(out).items() if ".mlp.experts." in k})
    assert outs[0] and outs[0] == outs[1]
    container = tmp_path / f"container-{int4_dir.name}"
    with start(engine_binary, container, 1) as engine:
        assert len(engine.generate(list(range(7, 30)), max_tokens=4).tokens) == 4
    # coli plan projected that container from the packed source's headers: the same expert bytes and disk
    planned = CliRunner().invoke(app, ["plan", "--json", "--model", str(int4_dir), "--ram", "1", "--experts", "int4",
                                       "--dense", "f32"])
    assert planned.exit_code == 0, planned.output
    info = CliRunner().invoke(app, ["info", "--json", "--model", str(container)])
    plan, real = json.loads(planned.stdout), json.loads(info.stdout)
    assert plan["expert_bytes"] == real["bytes"]["per_expert"] > 0
    on_disk = sum(f.stat().st_size for f in container.glob("*.safetensors"))
    assert plan["projected_container"]["container_bytes"] == on_disk
