"""The container-quality check every family with an engine runs: convert a tiny model, then compare the container
with the f32 engine over 512 teacher-forced positions of the fixed quality text.

The source is ``colibri.testing.tiny``'s model with its routed experts re-scaled (:func:`rescale_experts`), so the
expert scheme carries real weight in the logits, and the check converts it with ``--dense f32`` by default: dense
matrices exact, so the figures measure the expert scheme alone (what a BF16 checkpoint gets with the default
``--dense bf16``, which is exact on BF16 sources).
"""

from __future__ import annotations

import math
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..convert.quality import QualityReport


def rescale_experts(src: Path, dst: Path) -> Path:
    """A copy of checkpoint ``src`` at ``dst`` with every routed-expert matrix re-scaled to std 1/sqrt(fan_in).

    ``colibri.testing.tiny`` draws weights with std 1/sqrt(prod(shape[1:])), and transformers stores experts
    fused as [experts, 2 * inter, hidden], so its expert matrices come out ~sqrt(2 * inter) times too small: the
    experts' share of the residual stream is then so small that int8 and int4 experts give the same logits to
    ~1e-9 nats of KL, and a quality check would measure nothing. Re-scaled, each expert matrix has the variance
    N(0, 1/fan_in) means, as every other matrix of the model already has. Roles come from the family's
    ``tensor_layout``, so this works for every family.
    """
    from safetensors import safe_open
    from safetensors.numpy import save_file

    from .. import hooks
    from ..model import resolve_model

    model = resolve_model(str(src))
    layout = hooks.tensor_layout(model)
    if layout is None:
        raise ValueError(f"{src}: family {model.family} has no tensor_layout: its routed experts are unknown")
    experts = {name for ex in layout.experts for name in ex.tensors}
    tmp = dst.with_name(dst.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp)
    for shard in sorted(Path(src).glob("*.safetensors")):
        with safe_open(str(shard), "np") as f:
            meta = f.metadata()
            tensors = {}
            for name in f.keys():
                t = f.get_tensor(name)
                if name in experts:
                    t = (t / t.std() / math.sqrt(t.shape[1])).astype(t.dtype)
                tensors[name] = t
        save_file(tensors, str(tmp / shard.name), metadata=meta)
    tmp.rename(dst)
    return dst


POSITIONS = 512
_references: dict[str, tuple[list[int], Any]] = {}   # source directory -> (token ids, f32 engine logits)


def quality_source(kind: str, root: Path, **overrides) -> Path:
    """The tiny ``kind`` checkpoint (seed 5, ``moe_intermediate_size`` 64 unless ``overrides`` say otherwise) with
    its experts re-scaled, built once under ``root``."""
    from .tiny import tiny_config, tiny_model

    # the routed experts' width: moe_intermediate_size where the config has one, else (all-MoE configs such as
    # OLMoE's) intermediate_size
    width = {"moe_intermediate_size" if "moe_intermediate_size" in tiny_config(kind) else "intermediate_size": 64}
    built = tiny_model(kind, root / "tiny", **{"seed": 5, **width, **overrides}).path
    source = root / f"{built.name}-rescaled"
    if not source.exists():
        rescale_experts(built, source)
    return source


def _logits(model, ids: list[int]):
    import numpy as np

    from ..convert.quality import forced_logits
    from ..launch import open_engine

    with open_engine(model, ctx=len(ids), threads=2) as engine:
        return forced_logits(engine, ids, len(ids)).astype(np.float32).astype(np.float64)


def _reference(source: Path) -> tuple[list[int], Any]:
    """Token ids of the quality text and the f32 engine's logits on them, computed once per source."""
    from .. import hooks
    from ..convert.quality import default_text, token_window
    from ..model import resolve_model

    key = str(source.resolve())
    if key not in _references:
        src = resolve_model(key)
        tokenizer = hooks.load_tokenizer(src)
        ids = token_window(tokenizer.encode(default_text()), POSITIONS, "the quality text")
        _references[key] = (ids, _logits(src, ids))
    return _references[key]


@dataclass(frozen=True)
class ContainerQuality:
    report: QualityReport           # the container against the f32 engine
    flipped_margin_max: float       # largest f32 top-1 minus top-2 logit among positions whose argmax flipped
    near_ties: float                # fraction of positions whose f32 top-1/top-2 margin is below 0.05
    conversion: object = None       # the ConvertResult (its out directory, per-tensor scheme fallbacks)


def measure_container_quality(kind: str, root: Path, experts: str, dense: str, **overrides) -> ContainerQuality:
    """Convert the :func:`quality_source` of ``kind`` with ``--experts``/``--dense`` and teacher-force 512
    positions of the fixed quality text through the container and the f32 engine (reference run once)."""
    return measure_conversion(quality_source(kind, root, **overrides), root, experts, dense)


def measure_conversion(source: Path, root: Path, experts: str, dense: str) -> ContainerQuality:
    """Convert checkpoint ``source`` into ``root`` and compare it with the f32 engine on ``source`` (512
    teacher-forced positions of the fixed quality text; the reference run once per source)."""
    import numpy as np

    from ..convert.quality import compare
    from ..convert.run import convert
    from ..model import resolve_model

    ids, ref = _reference(source)
    out = root / f"{source.name}-{experts}-{dense}"
    converted = convert(resolve_model(str(source)), out, experts=experts, dense=dense)
    cand = _logits(resolve_model(str(out)), ids)
    top2 = np.sort(ref, axis=-1)[:, -2:]
    margin = top2[:, 1] - top2[:, 0]
    flipped = ref.argmax(-1) != cand.argmax(-1)
    return ContainerQuality(compare(ref, cand, ids[1:]), float(margin[flipped].max()) if flipped.any() else 0.0,
                            float((margin < 0.05).mean()), converted)


def check_container_quality(kind: str, root: Path, experts: str, dense: str, min_top1: float, max_kl: float,
                            **overrides) -> ContainerQuality:
    """Assert top-1 agreement >= ``min_top1`` and 0 < mean KL <= ``max_kl`` (KL 0 would mean nothing was quantized).
    ``overrides`` go to the tiny model (see :func:`quality_source`)."""
    quality = measure_container_quality(kind, root, experts, dense, **overrides)
    report = quality.report
    assert report.positions == POSITIONS
    assert report.top1_agreement >= min_top1, quality
    assert 0 < report.mean_kl <= max_kl, quality
    return quality
