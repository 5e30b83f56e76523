"""Core's default answer to the ``converter_spec`` hook, derived from a family's ``tensor_layout``."""

from __future__ import annotations

from typing import Iterable

from ..records import ConverterSpec, TensorLayout

EXPERT_SCHEMES = ("int8", "int4")
DENSE_SCHEMES = ("f32", "bf16", "int8", "int4")


def spec_from_layout(layout: TensorLayout, expert_schemes: tuple[str, ...] = EXPERT_SCHEMES,
                     dense_schemes: tuple[str, ...] = DENSE_SCHEMES,
                     selectors: Iterable[str] = ()) -> ConverterSpec | None:
    """A spec whose dense matrices are the embeddings, the LM head and every ``required`` tensor.

    Only the 2-D ones among them are quantized (the converter checks shapes on disk); routers and norms are
    never dense matrices. ``selectors`` names further tensors that feed a hard selection the way a router does
    (e.g. a DSA indexer's projections, whose top-k over keys flips when its scores move): they are left out of
    the dense matrices too, so every ``--dense`` stores them as F32. ``None`` when the layout has no routed
    experts: there is nothing to stream, so nothing for a container to do.
    """
    if not layout.experts:
        return None
    exempt = {name for _, name in layout.routers} | set(layout.norms) | set(selectors)
    names = [*layout.embeddings, *([layout.lm_head] if layout.lm_head else []), *layout.required]
    dense = tuple(dict.fromkeys(n for n in names if n not in exempt))
    return ConverterSpec(expert_schemes=expert_schemes, dense_schemes=dense_schemes, dense_matrices=dense)
