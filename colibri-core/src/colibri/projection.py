"""A colibri-quant container that does not exist yet, seen as the planner would see the real one.

``coli convert`` decides every byte it will write from the source headers alone (``convert.plan.build_plan``);
this module runs that same plan and re-keys the checkpoint's tensors by source name with the container's byte
sizes (a quantized tensor keeps its logical shape; its bytes are its levels plus its scales), exactly as
``inventory._container_of`` presents a finished container. So ``coli plan --experts int4 --dense int8`` on a
700 GB FP8 checkpoint answers what the converted model would need, without converting anything.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from pathlib import Path

from . import int4_packed
from .checkpoint import TensorInfo
from .errors import UsageError
from .inventory import ModelFacts
from .records import ExpertTensors, TensorLayout


@dataclass(frozen=True)
class Projection:
    facts: ModelFacts           # the model with the container's tensors in place of the source's
    experts: str
    dense: str
    shards: int
    container_bytes: int        # every shard as convert writes it (headers included)
    source_bytes: int


def project(facts: ModelFacts, experts: str, dense: str) -> Projection:
    """The container ``coli convert --experts EXPERTS --dense DENSE`` would write from ``facts.model``."""
    from .convert.run import make_plan

    if facts.container is not None:
        raise UsageError(f"{facts.model.path}: is already a colibri-quant container "
                         f"({', '.join(facts.quant_schemes) or 'float'})",
                         "drop --experts/--dense to plan it as it is, or plan the source checkpoint")
    plan, _index = make_plan(facts.model, experts, dense)
    logical: dict[str, TensorInfo] = {}
    for shard in plan.shards:
        for item in shard.items:
            t = item.source
            dtype = item.scheme if item.quant is not None else item.parts[0].dtype
            logical[t.name] = TensorInfo(t.name, dtype, tuple(t.shape), Path(shard.file_name), 0, item.nbytes)
    tensors = copy.copy(facts.tensors)
    tensors.tensors = logical
    container_bytes = sum(len(s.header_bytes()) + s.data_bytes for s in plan.shards)
    return Projection(replace(facts, tensors=tensors, layout=_container_layout(facts.layout)), experts, dense,
                      len(plan.shards), container_bytes, plan.source_bytes)


def _container_layout(layout: TensorLayout | None) -> TensorLayout | None:
    """The layout as the container will be read: convert stores a packed int4 expert matrix under its logical
    ``X.weight`` name (convert/int4_source.py), so the expert names its ``X.weight_packed`` no more."""
    if layout is None or not layout.packed_int4:
        return layout
    packed, cut = set(layout.packed_int4), len(int4_packed.PACKED_SUFFIX)
    experts = tuple(ExpertTensors(x.layer, x.expert, tuple(n[:-cut] if n in packed else n for n in x.tensors))
                    for x in layout.experts)
    return replace(layout, experts=experts, packed_int4=())
