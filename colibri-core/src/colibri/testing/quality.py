"""The container-quality check every family with an engine runs: convert a tiny model, then compare the container
with the f32 engine over 512 teacher-forced positions of the fixed quality text."""

from __future__ import annotations

from pathlib import Path


def check_container_quality(kind: str, root: Path, experts: str, dense: str, min_top1: float, max_kl: float,
                            **overrides) -> None:
    """Assert top-1 agreement >= ``min_top1`` and 0 < mean KL <= ``max_kl`` (KL 0 would mean nothing was quantized).

    The tiny model is built with seed 5 and ``moe_intermediate_size`` 64 unless ``overrides`` say otherwise.
    """
    from ..convert.quality import default_text, run_quality
    from ..convert.run import convert
    from ..model import resolve_model
    from .tiny import tiny_model

    overrides = {"seed": 5, "moe_intermediate_size": 64, **overrides}
    src = resolve_model(str(tiny_model(kind, root / "tiny", **overrides).path))
    out = root / f"{kind}-{experts}-{dense}"
    convert(src, out, experts=experts, dense=dense)
    report = run_quality(resolve_model(str(out)), src, [default_text()], positions=512, threads=2)
    assert report.positions == 512
    assert report.top1_agreement >= min_top1, report
    assert 0 < report.mean_kl <= max_kl, report
