"""Core's default RAM planner: dense weights resident, KV and state per slot, a reserve, the rest expert cache.

The budget is split in this order, and only what is left becomes routed-expert cache slots::

    dense  = every non-expert tensor as stored (embeddings, attention, norms, routers, shared experts)
    kv     = kv_bytes_per_token x ctx x slots
    state  = state_bytes_per_slot x slots                (recurrent / linear-attention layers)
    reserve= what one prefill pass allocates (activations, attention scores, logits rows) + a fixed 64 MiB
    cache  = (ram - dense - kv - state - reserve) // (bytes per expert x MoE layers) slots per layer,
             capped at the experts a layer has

A plan that cannot give every MoE layer even one slot does not fit; it still carries the numbers and
``min_ram_bytes``, the smallest budget that would.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from .roles import take_inventory
from .records import Geometry, PlanRequest, ResolvedModel, ResourcePlan, TensorLayout

FIXED_RESERVE_BYTES = 64 * 1024 * 1024
"""Thread stacks, I/O staging buffers, allocator slack, the engine's code and libc: measured engines sit at a
few tens of MiB beyond their tensors, and 64 MiB keeps the OOM killer away without costing a real model a slot."""

PREFILL_ROWS = 128
"""The most prompt rows one forward pass holds: launch's streaming prefill chunk (the engine's own default is 32).
The engine allocates its scratch for this many rows, not for the whole context: a prompt is prefilled in chunks."""

ENGINE_DEFAULT_ROWS = 32

PREFILL_SCORES_BUDGET = 64 << 20
"""Attention-score scratch a bigger prefill chunk may cost at most (launch.prefill_chunk shrinks the chunk to it)."""

ROW_ACTIVATIONS = 12
"""Hidden-sized f32 activations the engine keeps per row: the decoder's residual, normed copy, projection and
shared-expert output (4), the MoE's gathered input and expert output (2), and the family's attention scratch (q, k,
v, their normed copies and the attention output: about 6 for full multi-head attention, less for GQA)."""

SCRATCH_DTYPE_BYTES = 4

STAGING_SLACK_BYTES = 3 * 4096
"""A staging buffer holds the largest expert plus room to align a direct read on both ends (expert_store.c)."""

MIN_STAGES = 4
"""Staging buffers worth having: both I/O threads reading, and the next two reads queued behind them."""


def staging_stages(top_k: int) -> int:
    """The staging buffers the engine's I/O pool wants (expert_pool.c pool_size): two per routed expert of a token, one
    for the layer's own misses and one for the next layer's predictions."""
    return min(64, max(MIN_STAGES, 2 * max(1, top_k)))


def streaming_split(plan: ResourcePlan, top_k: int, wanted: int | None = None) -> tuple[int, int]:
    """(cache slots per layer, staging buffers) when prefetching, inside the RAM ``plan`` gave the cache.

    The buffers come first out of what rounding the cache down to whole slots per layer left over: up to
    ``staging_stages(top_k)`` of them, and at least ``MIN_STAGES``. Only when the leftover holds fewer than that
    does the cache give up a slot per layer, which frees a buffer per MoE layer. The plan's last slot per layer always
    stays; the ``MIN_STAGES`` buffers then come on top of it, as the plan's reserve allows for. ``wanted`` replaces
    ``staging_stages(top_k)`` (coli tune's choice)."""
    wanted = wanted or staging_stages(top_k)
    buffer = plan.expert_bytes + STAGING_SLACK_BYTES
    spare = plan.ram_bytes - (plan.dense_bytes + plan.kv_bytes + plan.state_bytes + plan.reserve_bytes
                              + plan.cache_bytes)
    slots = plan.cache_slots_per_layer
    while slots > 1 and spare // buffer < MIN_STAGES:
        slots -= 1
        spare += plan.moe_layers * plan.expert_bytes
    return slots, int(max(MIN_STAGES, min(wanted, max(0, spare) // buffer)))


def streaming_chunk(num_heads: int, ctx: int, wanted: int = PREFILL_ROWS) -> int:
    """The prefill chunk for streaming: ``wanted`` rows while their attention scores (rows x heads x ctx f32) stay
    within PREFILL_SCORES_BUDGET (launch.prefill_chunk passes it when above the engine's default)."""
    return min(wanted, PREFILL_SCORES_BUDGET // (max(1, num_heads) * max(1, ctx) * SCRATCH_DTYPE_BYTES))


def prefill_rows(geometry: Geometry, ctx: int, wanted: int = 0) -> int:
    """Rows of the largest prefill pass at ``ctx``: the streaming chunk for ``wanted`` (0: PREFILL_ROWS), never
    below the engine's default, never above the context."""
    chunk = streaming_chunk(geometry.num_heads, ctx, wanted or PREFILL_ROWS)
    return min(max(1, ctx), max(ENGINE_DEFAULT_ROWS, chunk))


def scratch_bytes(geometry: Geometry, ctx: int, wanted_rows: int = 0) -> int:
    """What the engine allocates for one prefill pass at ``ctx``: per row its activations, each routed choice's
    output (top-k x hidden), one expert's gate and up rows and a logits row (the engine keeps every row's logits for
    prompt logprobs), plus the attention scores of the pass (rows x heads x ctx). The MoE layers share one set of
    expert scratch (decoder.c share_moe_scratch), so none of it scales with the layer count. Measured on the
    OLMoE-1B-7B geometry at ctx 4096 after a 512-token prompt: 36 MB of RSS beyond tensors, KV, cache and staging,
    against a reserve of 150 MB for the worst case (every score and logits row touched)."""
    rows = prefill_rows(geometry, ctx, wanted_rows)
    per_row = ((ROW_ACTIVATIONS + max(1, geometry.top_k)) * geometry.hidden_size + 2 * geometry.expert_intermediate
               + geometry.vocab_size)
    scores = rows * max(1, geometry.num_heads) * max(1, ctx)
    return (rows * per_row + scores) * SCRATCH_DTYPE_BYTES


def reserve_bytes(geometry: Geometry, ctx: int, wanted_rows: int = 0) -> int:
    return scratch_bytes(geometry, ctx, wanted_rows) + FIXED_RESERVE_BYTES


def plan(model: ResolvedModel, request: PlanRequest, geometry: Geometry, layout: TensorLayout | None,
         tensors: Any) -> ResourcePlan:
    """Place ``model`` in ``request.ram_bytes``; see the module docstring for the order of the split."""
    inv = take_inventory(geometry, layout, tensors)
    dense = inv.resident_bytes
    kv = geometry.kv_bytes_per_token * request.ctx * request.kv_slots
    state = geometry.state_bytes_per_slot * request.kv_slots
    reserve = reserve_bytes(geometry, request.ctx, request.prefill_rows)
    fixed = dense + kv + state + reserve
    experts_per_layer = geometry.num_experts or inv.experts_per_layer
    moe_layers = inv.moe_layers
    expert_bytes = inv.bytes_per_expert
    slot_row = expert_bytes * moe_layers          # one cache slot in every MoE layer
    notes: list[str] = []

    left = request.ram_bytes - fixed
    if slot_row > 0:
        slots = max(0, left) // slot_row
        slots = min(slots, experts_per_layer)
        if request.cap:
            wanted = min(request.cap, experts_per_layer)
            fits = wanted <= slots
            if not fits:
                notes.append(f"--cap {request.cap} needs {wanted} slots per layer but only {slots} fit")
            slots = wanted
        else:
            fits = slots >= 1
        min_ram = fixed + slot_row * max(1, min(request.cap, experts_per_layer) if request.cap else 1)
        if fits and slots == experts_per_layer:
            notes.append("every routed expert fits in RAM: after warm-up no expert is read from disk")
    else:
        slots = 0
        fits = left >= 0
        min_ram = fixed
        notes.append("no routed experts: the whole model is resident")

    cache = slots * slot_row
    top_k = min(geometry.top_k, experts_per_layer) if geometry.top_k else experts_per_layer
    routed_per_token = top_k * expert_bytes * moe_layers
    bandwidth = float(request.disk_bandwidth)
    tok_s = bandwidth / routed_per_token if bandwidth > 0 and routed_per_token > 0 else 0.0
    if inv.skipped_bytes and layout is not None:
        notes.append(f"{inv.skipped_bytes} bytes of tensors under {', '.join(layout.skipped_prefixes)} "
                     "are never loaded")
    result = ResourcePlan(
        ram_bytes=request.ram_bytes, dense_bytes=dense, kv_bytes=kv, state_bytes=state, reserve_bytes=reserve,
        expert_bytes=expert_bytes, experts_per_layer=experts_per_layer, moe_layers=moe_layers,
        cache_slots_per_layer=slots, cache_bytes=cache, routed_bytes_per_token=routed_per_token,
        disk_bandwidth=bandwidth, disk_bound_tokens_per_s=tok_s, fits=fits, min_ram_bytes=min_ram,
        notes=tuple(notes),
    )
    if 0 < slots < experts_per_layer and not request.cap:
        result = replace(result, notes=(*result.notes, streaming_note(result, top_k)))
    return result


def streaming_note(plan: ResourcePlan, top_k: int) -> str:
    """What ``coli run`` does with a partial cache: the staging buffers and the pinned share."""
    slots, stages = streaming_split(plan, top_k)
    paid = ("the slack left after whole slots" if slots == plan.cache_slots_per_layer
            else f"{plan.cache_slots_per_layer - slots} slot(s) per layer")
    return (f"the cache is partial, so coli run/chat/serve stream by default: {stages} prefetch staging buffers "
            f"(paid by {paid}) and {slots} cache slots per layer, of which pinning keeps {slots // 2} "
            f"({100 * (slots // 2) / slots:.0f}%) for the hottest experts while the learned hot set leads LRU in "
            f"set dueling (--no-prefetch; --pin: the hot set alone, --no-pin: LRU alone)")
