"""Assertions family packages share in their tests: does a TensorLayout describe a checkpoint exactly? Do two
System One answers agree?"""

from __future__ import annotations

from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

from ..checkpoint import TensorIndex, default_shard_set
from ..records import Claim, ResolvedModel, ShardSet, TensorLayout


def layout_names(layout: TensorLayout) -> list[str]:
    """Every tensor name a layout mentions (duplicates kept, so a test can check there are none)."""
    names = list(layout.embeddings) + list(layout.norms) + [name for _, name in layout.routers]
    names += [t for expert in layout.experts for t in expert.tensors]
    names += list(layout.required) + list(layout.buffers)
    if layout.lm_head and layout.lm_head not in layout.embeddings:
        names.append(layout.lm_head)
    return names


def claim_of(family: str, model_dir: Path, config: Mapping[str, Any] | None) -> Claim | None:
    """The claim ``family`` makes on a model directory through core's discovery (``colibri.hooks.claims``: the
    family's own ``detect_config``, or core's claim by ``model_type`` when it has none), else None."""
    from ..hooks import claims

    return next((c for c in claims(model_dir, config) if c.family == family), None)


def resolved(path: Path, family: str, config: Mapping[str, Any] | None = None,
             model_type: str | None = None) -> ResolvedModel:
    """A ResolvedModel for a directory (config read from disk unless given) without going through plugins."""
    import json

    if config is None:
        config = json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))
    mt = model_type or str(config.get("model_type"))
    return ResolvedModel(Path(path), family, mt, MappingProxyType(dict(config)))


def check_layout_against_checkpoint(layout: TensorLayout, shard_sets: tuple[ShardSet, ...] | Path,
                                    expected_elements: int | None = None) -> TensorIndex:
    """Assert the layout names exactly the checkpoint's tensors (outside ``skipped_prefixes``), once each.

    Also asserts that the summed element count equals ``expected_elements`` when given. Returns the index.
    """
    if isinstance(shard_sets, Path):
        found = default_shard_set(shard_sets)
        assert found is not None, f"{shard_sets}: no safetensors"
        shard_sets = (found,)
    index = TensorIndex(shard_sets)
    names = layout_names(layout)
    duplicates = sorted({n for n in names if names.count(n) > 1})
    assert not duplicates, f"layout names these tensors twice: {duplicates[:5]}"
    on_disk = {t.name for t in index if not t.name.startswith(layout.skipped_prefixes or ("\0",))}
    missing = sorted(set(names) - set(index.tensors))
    extra = sorted(on_disk - set(names))
    assert not missing, f"layout names {len(missing)} tensors absent from the checkpoint, e.g. {missing[:5]}"
    assert not extra, f"{len(extra)} checkpoint tensors have no role in the layout, e.g. {extra[:5]}"
    if expected_elements is not None:
        total = sum(t.numel for t in index)
        assert total == expected_elements, f"checkpoint holds {total} elements, expected {expected_elements}"
    return index


def routers_and_experts_consistent(layout: TensorLayout, moe_layers: tuple[int, ...], num_experts: int) -> None:
    """Assert one router per MoE layer and ``num_experts`` experts (each gate, up, down) per MoE layer."""
    router_layers = tuple(layer for layer, _ in layout.routers)
    assert router_layers == tuple(moe_layers), f"routers on layers {router_layers}, MoE layers {moe_layers}"
    for layer in moe_layers:
        per_layer = [e for e in layout.experts if e.layer == layer]
        assert [e.expert for e in per_layer] == list(range(num_experts)), f"layer {layer}: experts out of order"
        assert all(len(e.tensors) >= 3 for e in per_layer), f"layer {layer}: expert without gate/up/down"


def assert_answers_close(got: Any, want: Any, where: str = "", tol: float = 1e-4) -> None:
    """System One answers (nested dicts) equal ``want``: the same keys everywhere, every float within ``tol``,
    everything else equal. ``where`` names the place of a mismatch (``text.spam.noul``)."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), where
        for key in want:
            assert_answers_close(got[key], want[key], f"{where}.{key}", tol)
    elif isinstance(want, float):
        assert abs(got - want) <= tol, f"{where}: {got} vs {want}"
    else:
        assert got == want, where
