"""What a checkpoint holds, from its headers: the family's view of it and its bytes and parameters by role.

``load_facts`` is the one place that asks the claiming family for geometry, tensor layout, weight files and
limits, so ``info``, ``plan``, ``doctor`` and ``run`` all see the model the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from . import hooks
from .checkpoint import TensorIndex, TensorInfo
from .errors import FamilyError
from .records import Geometry, Limits, ResolvedModel, ShardSet, TensorLayout
from .roles import Inventory, expert_groups, take_inventory

__all__ = ["Inventory", "ModelFacts", "expert_groups", "family_answer", "geometry_of", "load_facts", "shard_sets_of",
           "take_inventory"]


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
    """Call a firstresult model hook by name on the claiming family (plus core's default). Kept for plugins and
    tests written against it; core itself calls the typed functions of ``colibri.hooks``."""
    return getattr(hooks, hook)(model, **kwargs)


def geometry_of(model: ResolvedModel) -> Geometry:
    geometry = hooks.model_geometry(model)
    if geometry is None:
        raise FamilyError(f"family {model.family} does not describe the geometry of {model.path}",
                          f"the {model.family} plugin must implement the model_geometry hook")
    return geometry


def shard_sets_of(model: ResolvedModel) -> tuple[ShardSet, ...]:
    return hooks.weight_files(model)


def load_facts(model: ResolvedModel) -> ModelFacts:
    """Ask the family for geometry/layout/limits/weight files and read every shard header (never weights).

    The files are validated (dtypes, sizes, offsets, overlaps) and the config's counts checked against the tensors
    on disk before the family is asked for a layout, which it sizes from the config."""
    from . import validation

    geometry = geometry_of(model)
    limits = hooks.limits(model)
    shard_sets = shard_sets_of(model)
    if not shard_sets:
        from .errors import ModelNotFoundError

        raise ModelNotFoundError(f"{model.path}: no *.safetensors weights found",
                                 "point --model at a checkpoint directory with safetensors shards")
    tensors = TensorIndex(shard_sets)
    validation.require(validation.file_checks(tensors.headers))
    container = _container_of(model, tensors)
    validation.require([validation.check_counts(model, geometry, tensors.tensors)])
    layout = hooks.tensor_layout(model)
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
