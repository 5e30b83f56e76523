"""The OLMoE engine on colibri-quant containers (docs/formats.md): quality against the f32 engine over 512
teacher-forced positions, batching exactness, one pread per expert, and the load-time refusals.

The source is a tiny random OLMoE (``colibri.testing.tiny``, weights re-drawn at O(1) scale, 16 experts top-4,
intermediate 64 so int4-g64 applies to every expert matrix), converted with ``coli convert``'s code.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

pytest.importorskip("torch")
pytest.importorskip("transformers")

from typer.testing import CliRunner

from colibri.builder import build_family
from colibri.cli import app
from colibri.convert.container import open_container
from colibri.convert.quality import default_text, run_quality
from colibri.convert.run import convert
from colibri.engine import Engine
from colibri.model import read_config
from colibri.records import ResolvedModel
from colibri.testing.quality import rescale_experts
from colibri.testing.tiny import tiny_model
from colibri_olmoe.plugin import engine_hparams

POSITIONS = 512

# colibri.testing.tiny draws routed-expert matrices ~sqrt(2 * inter) times too small (fused [experts, 2 * inter,
# hidden] tensors, std 1/sqrt(prod(shape[1:]))), so on its models the experts barely reach the logits (int8 and
# int4 experts both give KL ~1e-9 with --dense f32). The source here has every expert matrix re-scaled to std
# 1/sqrt(fan_in) (colibri.testing.quality.rescale_experts), so expert quantization carries real weight, and the
# quality containers keep dense matrices exact (--dense f32), so the figures are the expert scheme's alone.
# Measured (seed 5, 2 layers, hidden 64, 16 experts top-4, intermediate 64; docs/formats.md):
#   int8 experts: top-1 98.44 %, KL mean 9.5e-5 / max 8.9e-3 nats (every flip had an f32 top-1/top-2 margin
#                 <= 0.018 logit: near-ties)
#   int4 experts: top-1 83.20 %, KL mean 7.6e-3 / max 2.3e-2 nats
# int8 meets the issue's 98 %. int4-g64 cannot meet 90 % on a random model: each 64-wide row is ONE group, the
# quantization step is absmax/7 (~0.34 sigma, a ~10 % error on each expert output), and this random model's flat
# distributions (perplexity ~757 on a 512-token vocabulary; 15.8 % of positions have a top-1/top-2 margin below
# 0.05 logit) turn that into argmax flips. The bound asserted is the measured one (81 %) with KL ceilings ~2x the
# measured values; colibri-nano (trained, peaked distributions) is the representative figure (docs/formats.md).
QUALITY = {  # experts scheme -> (min top-1 agreement, max mean KL, max max KL)
    "int8": (0.98, 2e-4, 2e-2),
    "int4": (0.81, 1.5e-2, 5e-2),
}


def resolved(path: Path) -> ResolvedModel:
    return ResolvedModel(path, "olmoe", "olmoe", read_config(path))


@pytest.fixture(scope="module")
def engine_binary() -> Path:
    return build_family("olmoe")


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("olmoe-quant")
    src = rescale_experts(tiny_model("olmoe", root / "tiny", seed=5, intermediate_size=64).path, root / "source")
    out = {"f32": src}
    for experts in QUALITY:
        dst = root / f"{experts}-f32"
        convert(resolved(src), dst, experts=experts, dense="f32")
        out[experts] = dst
    dst = root / "int8-int8"
    convert(resolved(src), dst, experts="int8", dense="int8")
    out["int8-dense"] = dst
    return out


def start(binary: Path, model_dir: Path, *, cap: int = 0, ctx: int = 256, prefetch: bool = False) -> Engine:
    argv = [str(binary), "--model", str(model_dir), "--ctx", str(ctx), "--slots", "1", "--cap", str(cap),
            "--threads", "2", *engine_hparams(resolved(model_dir))]
    return Engine(argv, env={"COLIBRI_PREFETCH": "1" if prefetch else "0"})


@pytest.mark.parametrize("experts", sorted(QUALITY))
def test_quality_against_the_f32_engine(models, experts):
    report = run_quality(resolved(models[experts]), resolved(models["f32"]), [default_text()],
                         positions=POSITIONS, threads=2)
    min_top1, max_mean_kl, max_max_kl = QUALITY[experts]
    assert report.positions == POSITIONS
    assert report.top1_agreement >= min_top1, report
    assert 0 < report.mean_kl <= max_mean_kl, report
    assert report.max_kl <= max_max_kl, report
    assert abs(report.ppl_ratio - 1) < 0.02, report


# colibri-nano (trained on the Python standard library, BF16, 4 layers, hidden 256, 32 experts top-2, vocabulary
# 8192): a real model's peaked distributions, against the random tiny models' near-ties. Its source is BF16, so the
# default --dense bf16 is exact and the figures are the expert scheme's. Measured: int8 99.02 % (KL mean 7.6e-5),
# int4-g64 95.12 % (KL mean 1.4e-3): the issue's 98 % / 90 % hold. Slow (a 8192-wide logit row per position
# through the JSON protocol, minutes on a loaded 2-core machine), so it runs in `nox -s convert_slow` only.
NANO_QUALITY = {"int8": (0.98, 2e-4), "int4": (0.90, 3e-3)}


@pytest.mark.skipif(os.environ.get("COLIBRI_SLOW_TESTS") != "1", reason="slow: set COLIBRI_SLOW_TESTS=1")
@pytest.mark.parametrize("experts", sorted(NANO_QUALITY))
def test_trained_nano_meets_the_issue_targets(tmp_path_factory, experts):
    from colibri.testing.quality import measure_conversion
    from colibri_olmoe.plugin import NANO_DIR

    if not (NANO_DIR / "config.json").exists():
        pytest.fail(f"{NANO_DIR}: colibri-nano is package data of colibri-olmoe and must be present")
    quality = measure_conversion(NANO_DIR, tmp_path_factory.mktemp("nano"), experts, "bf16")
    min_top1, max_kl = NANO_QUALITY[experts]
    assert quality.report.positions == POSITIONS
    assert quality.report.top1_agreement >= min_top1, quality
    assert 0 < quality.report.mean_kl <= max_kl, quality


def test_quantized_dense_weights_run_too(models):
    # int8 attention, embeddings (dequantized per row) and LM head through the generic linear layer.
    report = run_quality(resolved(models["int8-dense"]), resolved(models["f32"]), [default_text()],
                         positions=128, threads=2)
    exact_dense = run_quality(resolved(models["int8"]), resolved(models["f32"]), [default_text()], positions=128,
                              threads=2)
    assert report.top1_agreement >= 0.90, report
    assert report.mean_kl <= 2e-3 and report.max_kl <= 4e-2, report
    assert report.mean_kl > exact_dense.mean_kl   # the dense weights really took the integer path


@pytest.mark.parametrize("experts", sorted(QUALITY))
def test_batched_prefill_is_bit_identical_to_one_token_at_a_time(engine_binary, models, experts):
    rng = random.Random(11)
    prompt = [rng.randrange(2, 512) for _ in range(37)]   # > one 32-token prefill chunk
    with start(engine_binary, models[experts], cap=3) as engine:
        batched = engine.generate(prompt, max_tokens=1, logits=True).logits
        engine.reset(0)
        single = []
        for i in range(1, len(prompt) + 1):
            r = engine.generate(prompt[:i], max_tokens=1, logits=True)
            assert r.accept["reused_tokens"] == i - 1 and len(r.logits) == 1
            single.append(r.logits[0])
    assert single == batched   # %.9g round-trips floats: bit equality of matmul (prefill) and matvec rows


def test_each_expert_is_one_pread_and_placement_changes_no_token(engine_binary, models):
    container = open_container(models["int4"])
    cfg = read_config(models["int4"])
    names = tuple(f"model.layers.0.mlp.experts.0.{m}_proj.weight" for m in ("gate", "up", "down"))
    _, begin, end = container.extent(names)
    one_expert = end - begin
    assert one_expert == sum(p.nbytes for n in names for p in container.tensors[n].parts)
    rng = random.Random(3)
    prompt = [rng.randrange(2, 512) for _ in range(40)]
    runs = {}
    for cap, prefetch in ((2, False), (0, False), (2, True)):
        with start(engine_binary, models["int4"], cap=cap, prefetch=prefetch) as engine:
            result = engine.generate(prompt, max_tokens=16, logits=True)
            stats = engine.stats()
        misses = stats["misses"]
        assert len(misses) == cfg["num_hidden_layers"] and all(m > 0 for m in misses)
        assert stats["reads"] == misses                       # one pread per expert load
        assert stats["bytes_read"] == [m * one_expert for m in misses]
        runs[(cap, prefetch)] = (result.tokens, result.logits)
    assert len({json.dumps(v) for v in runs.values()}) == 1   # cache size and prefetching change no bit


# ---- refusals: one line from `coli run`, a fatal event naming the tensor from the engine itself ----

def coli_run(model_dir: Path):
    return CliRunner().invoke(app, ["run", "hello", "--model", str(model_dir), "--raw", "-n", "2", "--temp", "0",
                                    "--ctx", "64", "--threads", "1"], catch_exceptions=False)


def engine_fatal(binary: Path, model_dir: Path) -> str:
    import subprocess

    argv = [str(binary), "--model", str(model_dir), "--ctx", "64", "--threads", "1",
            *engine_hparams(resolved(model_dir))]
    proc = subprocess.run(argv, input=b"", capture_output=True, timeout=120, check=False)
    events = [json.loads(line) for line in proc.stdout.decode().splitlines()]
    assert proc.returncode == 2 and len(events) == 1 and events[0]["ev"] == "fatal", (proc.returncode, events)
    return events[0]["message"]


def one_line_error(result, *needles: str) -> None:
    assert result.exit_code != 0
    err = result.stderr
    assert err.startswith("error: ") and err.count("\n") == 1, err
    for needle in needles:
        assert needle in err, err


def patch_header(shard: Path, old: bytes, new: bytes) -> None:
    """Replace bytes inside a shard's JSON header (same length, so every offset stays valid)."""
    assert len(old) == len(new)
    data = shard.read_bytes()
    hlen = int.from_bytes(data[:8], "little")
    header = data[8:8 + hlen]
    assert header.count(old) == 1, old
    shard.write_bytes(data[:8] + header.replace(old, new) + data[8 + hlen:])


def layer_shard(directory: Path) -> Path:
    return sorted(directory.glob("model-*.safetensors"))[1]   # shard 1 holds the globals; 2.. the layers


@pytest.mark.parametrize("edit", ["newer_version", "unknown_container"])
def test_unknown_stamp_is_fatal_at_load(engine_binary, models, tmp_path, edit):
    broken = tmp_path / "broken"
    shutil.copytree(models["int8"], broken)
    shard = layer_shard(broken)
    if edit == "newer_version":
        patch_header(shard, b'"colibri.version":"1"', b'"colibri.version":"2"')
        needles = (shard.name, "version", "not supported")
    else:
        patch_header(shard, b'"colibri.container":"colibri-quant"', b'"colibri.container":"colibri-qu4nt"')
        needles = (shard.name, "colibri-qu4nt")
    one_line_error(coli_run(broken), *needles)
    message = engine_fatal(engine_binary, broken)
    assert all(n in message for n in needles), message


def test_truncated_scale_tensor_is_fatal_naming_it(engine_binary, models, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    broken = tmp_path / "broken"
    shutil.copytree(models["int8"], broken)
    shard = layer_shard(broken)
    victim = "model.layers.0.mlp.experts.3.up_proj.scales"
    with safe_open(shard, "pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    tensors[victim] = tensors[victim][: len(tensors[victim]) // 2]
    save_file(tensors, str(shard), metadata=meta)
    one_line_error(coli_run(broken), victim)
    message = engine_fatal(engine_binary, broken)
    assert victim in message, message


@pytest.mark.parametrize("count", [8, 32])
def test_config_edited_to_another_expert_count_is_fatal_naming_the_tensor(engine_binary, models, tmp_path, count):
    broken = tmp_path / "broken"
    shutil.copytree(models["int8"], broken)
    cfg = json.loads((broken / "config.json").read_text())
    assert cfg["num_experts"] == 16
    cfg["num_experts"] = count
    (broken / "config.json").write_text(json.dumps(cfg))
    message = engine_fatal(engine_binary, broken)
    assert "model.layers.0.mlp." in message, message
    result = coli_run(broken)
    one_line_error(result, "model.layers.0.mlp.")


def test_launch_refuses_schemes_the_family_does_not_run(models, monkeypatch):
    from colibri import launch
    from colibri.errors import EngineError
    from colibri.inventory import load_facts
    from colibri.records import Limits

    facts = load_facts(resolved(models["int4"]))
    assert facts.quant_schemes == ("int4-g64",)
    launch.check_container(facts)   # olmoe runs it
    narrowed = type(facts)(**{**facts.__dict__, "limits": Limits(max_context=4096, has_engine=True,
                                                                   quant_schemes=("int8-row",))})
    with pytest.raises(EngineError, match="int4-g64"):
        launch.check_container(narrowed)


def test_info_and_doctor_understand_containers(models):
    runner = CliRunner()
    info = runner.invoke(app, ["info", "--model", str(models["int4"]), "--json"], catch_exceptions=False)
    assert info.exit_code == 0, info.output
    data = json.loads(info.stdout)
    native = json.loads(runner.invoke(app, ["info", "--model", str(models["f32"]), "--json"]).stdout)
    assert data["container"]["quant_schemes"] == ["int4-g64"] and native["container"] is None
    # routed experts counted by their stored bytes (levels + scales), not as dense tensors
    container = open_container(models["int4"])
    expert_bytes = sum(t.end - t.begin for n, t in container.tensors.items() if ".mlp.experts." in n)
    assert data["bytes"]["routed_experts"] == expert_bytes
    assert data["parameters"]["total"] == native["parameters"]["total"]
    doctor = runner.invoke(app, ["doctor", "--model", str(models["int4"]), "--deep"], catch_exceptions=False)
    assert doctor.exit_code == 0, doctor.output
    assert "colibri-quant v1" in doctor.stdout
