"""Core's default answer to the ``converter_spec`` hook, derived from a family's ``tensor_layout``."""

from __future__ import annotations

from ..records import ConverterSpec, TensorLayout


def spec_from_layout(layout: TensorLayout, expert_schemes: tuple[str, ...] = ("int8", "int4"),
                     dense_schemes: tuple[str, ...] = ("bf16", "int8", "int4")) -> ConverterSpec | None:
    """A spec whose dense matrices are the embeddings, the LM head and every ``required`` tensor.

    Only the 2-D ones among them are quantized (the converter checks shapes on disk); routers and norms are
    never dense matrices. ``None`` when the layout has no routed experts: there is nothing to stream, so nothing
    for a container to do.
    """
    if not layout.experts:
        return None
    routers = {name for _, name in layout.routers}
    norms = set(layout.norms)
    names = [*layout.embeddings, *([layout.lm_head] if layout.lm_head else []), *layout.required]
    dense = tuple(dict.fromkeys(n for n in names if n not in routers and n not in norms))
    return ConverterSpec(expert_schemes=expert_schemes, dense_schemes=dense_schemes, dense_matrices=dense)
