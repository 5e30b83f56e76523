"""The qwen engine on colibri-quant containers: it composes the shared blocks (runtime/qlinear.h), so a container
runs without qwen-specific code. Quality against the f32 engine over 512 teacher-forced positions of the fixed
quality text, and one pread per expert load.

Measured (seed 5, moe_intermediate_size 64; docs/formats.md): qwen3_moe int8/bf16 top-1 99.8 %, KL mean 9.3e-6;
qwen2_moe (shared expert + gate) int4/bf16 top-1 98.6 %, KL mean 2.4e-5 / max 1.2e-4 nats.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

pytest.importorskip("torch")
pytest.importorskip("transformers")

from colibri.convert.container import open_container  # noqa: E402
from colibri.convert.quality import default_text, run_quality  # noqa: E402
from colibri.convert.run import convert  # noqa: E402
from colibri.launch import open_engine  # noqa: E402
from colibri.model import resolve_model  # noqa: E402
from colibri.testing.tiny import tiny_model  # noqa: E402

CASES = {  # kind -> (experts scheme, min top-1 agreement, max mean KL)
    "qwen3_moe": ("int8", 0.98, 2e-4),
    "qwen2_moe": ("int4", 0.90, 3e-3),
}


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("qwen-quant")


def source_and_container(root: Path, kind: str):
    experts = CASES[kind][0]
    src = resolve_model(str(tiny_model(kind, root / "tiny", seed=5, moe_intermediate_size=64).path))
    out = root / f"{kind}-{experts}"
    if not out.exists():
        convert(src, out, experts=experts, dense="bf16")
    return src, resolve_model(str(out))


@pytest.mark.parametrize("kind", sorted(CASES))
def test_container_quality_against_the_f32_engine(root, kind):
    src, dst = source_and_container(root, kind)
    _, min_top1, max_kl = CASES[kind]
    report = run_quality(dst, src, [default_text()], positions=512, threads=2)
    assert report.positions == 512
    assert report.top1_agreement >= min_top1, report
    assert 0 < report.mean_kl <= max_kl, report


def test_container_reads_each_expert_with_one_pread(root):
    _, dst = source_and_container(root, "qwen2_moe")
    container = open_container(dst.path)
    names = tuple(f"model.layers.0.mlp.experts.0.{m}_proj.weight" for m in ("gate", "up", "down"))
    _, begin, end = container.extent(names)
    prompt = [random.Random(2).randrange(2, 500) for _ in range(40)]
    with open_engine(dst, ctx=128, cap=2, threads=2) as engine:
        engine.generate(prompt, max_tokens=8)
        stats = engine.stats()
    assert all(m > 0 for m in stats["misses"])
    assert stats["reads"] == stats["misses"]
    assert stats["bytes_read"] == [m * (end - begin) for m in stats["misses"]]
