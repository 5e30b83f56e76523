"""What a checkpoint holds, from its headers: the family's view of it and its bytes and parameters by role.

``load_facts`` is the one place that asks the claiming family for geometry, tensor layout, weight files and
limits, so ``info``, ``plan``, ``doctor`` and ``run`` all see the model the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from . import plugins
from .checkpoint import TensorIndex, TensorInfo
from .errors import FamilyError
from .records import Geometry, Limits, ResolvedModel, ShardSet, TensorLayout


@dataclass(frozen=True)
class ModelFacts:
    """A resolved model with everything its family says about it and the tensor index of its shards."""

    model: ResolvedModel
    geometry: Geometry
    layout: TensorLayout | None
    limits: Limits | None
    shard_sets: tuple[ShardSet, ...]
    tensors: TensorIndex
    container: Any = None          # colibri.convert.container.Container for a colibri-quant container, else None

    @property
    def quant_schemes(self) -> tuple[str, ...]:
        """The quantized schemes a container stores (sorted), () for a native checkpoint."""
        if self.container is None:
            return ()
        return tuple(sorted({t.scheme for t in self.container.tensors.values() if t.quant is not None}))


def family_answer(model: ResolvedModel, hook: str, **kwargs: Any) -> Any:
    """Call a firstresult model hook on the claiming family (plus core's default)."""
    return plugins.family_hook(model.family, hook)(model=model, **kwargs)


def geometry_of(model: ResolvedModel) -> Geometry:
    geometry = family_answer(model, "model_geometry")
    if geometry is None:
        raise FamilyError(f"family {model.family} does not describe the geometry of {model.path}",
                          f"the {model.family} plugin must implement the model_geometry hook")
    return geometry


def shard_sets_of(model: ResolvedModel) -> tuple[ShardSet, ...]:
    found = family_answer(model, "weight_files") or ()
    return tuple(found)


def load_facts(model: ResolvedModel) -> ModelFacts:
    """Ask the family for geometry/layout/limits/weight files and read every shard header (never weights).

    The files are validated (dtypes, sizes, offsets, overlaps) and the config's counts checked against the tensors
    on disk before the family is asked for a layout, which it sizes from the config."""
    from . import validation

    geometry = geometry_of(model)
    limits = family_answer(model, "limits")
    shard_sets = shard_sets_of(model)
    if not shard_sets:
        from .errors import ModelNotFoundError

        raise ModelNotFoundError(f"{model.path}: no *.safetensors weights found",
                                 "point --model at a checkpoint directory with safetensors shards")
    tensors = TensorIndex(shard_sets)
    validation.require(validation.file_checks(tensors.headers))
    container = _container_of(model, tensors)
    validation.require([validation.check_counts(model, geometry, tensors.tensors)])
    layout = family_answer(model, "tensor_layout")
    return ModelFacts(model, geometry, layout, limits, shard_sets, tensors, container)


def _container_of(model: ResolvedModel, tensors: TensorIndex):
    """Validate a colibri-quant container (ContainerError on a bad stamp) and re-key ``tensors`` by the source
    names its scheme map states, so roles, expert bytes and plans see the model as the family describes it: a
    quantized tensor is one entry of its logical shape whose byte range spans its levels and scales."""
    from .convert.container import is_stamped, open_container

    if not any(is_stamped(h) for h in tensors.headers):
        return None
    container = open_container(model.path)
    if container is None:
        return None
    tensors.tensors = logical_tensors(container)
    return container


def logical_tensors(container) -> dict[str, TensorInfo]:
    """A container's tensors by source name, each of its logical shape, spanning its levels and scales."""
    logical = {}
    for t in container.tensors.values():
        dtype = t.scheme if t.quant is not None else t.parts[0].dtype
        logical[t.name] = TensorInfo(t.name, dtype, tuple(t.shape), t.file, t.begin, t.end)
    return logical


def _skipped(name: str, layout: TensorLayout | None) -> bool:
    return bool(layout) and any(name.startswith(p) for p in layout.skipped_prefixes)


@dataclass(frozen=True)
class Inventory:
    """Bytes and parameters of a checkpoint split by role. Skipped tensors (never loaded) are counted apart."""

    total_params: int             # every loaded tensor's numel (skipped tensors and buffers excluded)
    active_params: int            # per token: total - routed experts + top_k experts' worth per MoE layer
    skipped_params: int
    buffer_elements: int          # numel of stored non-parameter tensors (layout.buffers)
    routed_params: int
    dense_bytes: int              # non-expert, non-embedding tensors as stored
    expert_bytes: int             # all routed experts as stored
    embedding_bytes: int          # input embedding and an untied LM head
    skipped_bytes: int
    bytes_per_expert: int         # the largest routed expert (a cache slot must hold any of them)
    experts_per_layer: int
    moe_layers: int
    dtypes: dict[str, int]

    @property
    def resident_bytes(self) -> int:
        """What stays in RAM: dense weights and embeddings."""
        return self.dense_bytes + self.embedding_bytes

    @property
    def loaded_bytes(self) -> int:
        return self.dense_bytes + self.embedding_bytes + self.expert_bytes


def expert_groups(layout: TensorLayout | None, tensors: TensorIndex) -> dict[int, dict[int, list[TensorInfo]]]:
    """layer -> expert -> its tensors found in the index (missing ones are doctor's business)."""
    groups: dict[int, dict[int, list[TensorInfo]]] = {}
    if layout is None:
        return groups
    for ex in layout.experts:
        found = [tensors[n] for n in ex.tensors if n in tensors]
        groups.setdefault(ex.layer, {})[ex.expert] = found
    return groups


def take_inventory(geometry: Geometry, layout: TensorLayout | None, tensors: TensorIndex) -> Inventory:
    groups = expert_groups(layout, tensors)
    expert_names = {t.name for layer in groups.values() for ts in layer.values() for t in ts}
    embedding_names = set()
    if layout is not None:
        embedding_names = set(layout.embeddings) | ({layout.lm_head} if layout.lm_head else set())
    buffers = set(layout.buffers) if layout is not None else set()
    packed = set(layout.packed_fp4) if layout is not None else set()

    def params(t) -> int:   # values, not stored elements: packed FP4 in I8/U8 holds two per byte
        return t.numel * 2 if t.name in packed and t.dtype in ("I8", "U8") else t.numel

    total = skipped_params = routed = buffer_elements = 0
    dense_b = expert_b = embed_b = skipped_b = 0
    dtypes: dict[str, int] = {}
    for t in tensors:
        if _skipped(t.name, layout):
            skipped_params += t.numel
            skipped_b += t.nbytes
            continue
        if t.name in buffers:
            buffer_elements += t.numel
        else:
            total += params(t)
        dtypes[t.dtype] = dtypes.get(t.dtype, 0) + 1
        if t.name in expert_names:
            routed += 0 if t.name in buffers else params(t)   # an expert's block scales are bytes, not parameters
            expert_b += t.nbytes
        elif t.name in embedding_names:
            embed_b += t.nbytes
        else:
            dense_b += t.nbytes
    active = total
    bytes_per_expert = 0
    experts_per_layer = 0
    for layer in groups.values():
        if not layer:
            continue
        layer_params = sum(params(t) for ts in layer.values() for t in ts if t.name not in buffers)
        # top_k experts' worth of this layer, at the layer's mean expert size (experts of a layer are equal in
        # every real family; the mean keeps the arithmetic exact for them and sensible otherwise).
        k = min(geometry.top_k, len(layer)) if geometry.top_k else len(layer)
        active -= layer_params - (layer_params * k) // len(layer)
        bytes_per_expert = max([bytes_per_expert] + [sum(t.nbytes for t in ts) for ts in layer.values()])
        experts_per_layer = max(experts_per_layer, len(layer))
    return Inventory(total, active, skipped_params, buffer_elements, routed, dense_b, expert_b, embed_b, skipped_b,
                     bytes_per_expert, experts_per_layer, len([g for g in groups.values() if g]), dtypes)
