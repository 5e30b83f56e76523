"""A checkpoint's bytes and parameters split by role (dense, routed experts, embeddings, skipped, buffers).

Pure arithmetic over a tensor layout and the shard headers' tensor index: it asks no family anything, so the
planner (core's default ``plan_resources``) can use it without depending on the hook layer.
"""

from __future__ import annotations

from dataclasses import dataclass

from .checkpoint import TensorIndex, TensorInfo
from .records import Geometry, TensorLayout


def _skipped(name: str, layout: TensorLayout | None) -> bool:
    return layout is not None and any(name.startswith(p) for p in layout.skipped_prefixes)


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
    paged_bytes: int = 0          # embeddings of layout.paged: mapped and read by the row, never held

    @property
    def resident_bytes(self) -> int:
        """What stays in RAM: dense weights and the embeddings the engine holds (not the paged ones)."""
        return self.dense_bytes + self.embedding_bytes - self.paged_bytes

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
    packed_int4 = set(layout.packed_int4) if layout is not None else set()
    paged = set(layout.paged) & embedding_names if layout is not None else set()

    def params(t) -> int:   # values, not stored elements: packed FP4 in I8/U8 holds two per byte, int4 in I32 eight
        if t.name in packed_int4 and t.dtype == "I32":
            return t.numel * 8
        return t.numel * 2 if t.name in packed and t.dtype in ("I8", "U8") else t.numel

    total = skipped_params = routed = buffer_elements = 0
    dense_b = expert_b = embed_b = skipped_b = paged_b = 0
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
            paged_b += t.nbytes if t.name in paged else 0
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
                     bytes_per_expert, experts_per_layer, len([g for g in groups.values() if g]), dtypes, paged_b)
