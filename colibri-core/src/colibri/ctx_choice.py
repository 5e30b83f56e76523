"""The context an engine gets when the user passes no ``--ctx``: what the run needs, or less than the default when
the default's KV would take the expert cache's RAM.

Engines allocate KV for the whole context of every slot at start (``kv_bytes_per_token x ctx x slots``), and the
planner gives the expert cache only what is left. Under a tight ``--ram`` the default 4096 tokens can cost an MoE
model most of its cache (OLMoE-1B-7B at a third of its size: 1 GiB of KV, 3 slots per layer instead of 13), while a
single prompt uses a few hundred positions of it. So:

* ``coli run`` knows its prompt and ``--max-tokens`` up front: the context is their sum rounded up to
  :data:`CTX_STEP`, never above the default. The tokens cannot change: the same positions are computed either way.
* ``coli chat`` / ``coli serve`` do not know how long a conversation gets: the context halves from the default, no
  lower than :data:`TRADE_FLOOR`, while it costs more than a :data:`KEEP_SHARE` of the slots the floor would leave.

Either way a changed context that buys cache slots is said in one line, naming ``--ctx`` as the way to choose; an
explicit ``--ctx`` is always obeyed. See docs/architecture.md ("KV sized for use").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .records import ResourcePlan

CTX_STEP = 256
"""A run's context is its prompt plus its generation budget, rounded up to this (a few MiB of KV at most)."""

TRADE_FLOOR = 1024
"""Chat and serve never shrink the context below this on their own: a conversation needs room to go on."""

KEEP_SHARE = 0.75
"""Chat and serve keep the largest context whose expert cache has at least this share of the floor's slots."""


@dataclass(frozen=True)
class CtxChoice:
    """The context chosen, and the one line saying why when it differs from the default and buys cache slots."""

    ctx: int
    notice: str = ""


def _round_up(n: int, step: int) -> int:
    return -(-max(1, n) // step) * step


def _partial(plan: ResourcePlan) -> bool:
    """Whether more RAM would buy expert slots: a routed-expert model whose cache does not hold every expert."""
    return plan.moe_layers > 0 and plan.experts_per_layer > 0 and plan.cache_slots_per_layer < plan.experts_per_layer


def choose_ctx(default: int, plan_at: Callable[[int], ResourcePlan], needed: int | None = None,
               cap_given: bool = False) -> CtxChoice:
    """The context for an engine started without ``--ctx``.

    :param default: the context the model would get otherwise (4096, or the model's maximum when smaller)
    :param plan_at: the RAM plan at a given context (same budget, slots and ``--cap``)
    :param needed: the positions a single run uses (prompt + generation budget), None for chat/serve
    :param cap_given: ``--cap`` fixes the slots, so chat/serve have nothing to trade context for
    :returns: the context and, when it buys expert slots, the notice to print
    """
    if needed is not None:
        ctx = min(default, _round_up(needed, CTX_STEP))
        why = f"the prompt and --max-tokens need {needed} positions"
    elif cap_given:
        return CtxChoice(default)
    else:
        ctx, why = _traded(default, plan_at), "a conversation's length is not known up front"
    if ctx == default:
        return CtxChoice(default)
    before, after = plan_at(default), plan_at(ctx)
    if not _partial(before) or after.cache_slots_per_layer <= before.cache_slots_per_layer:
        return CtxChoice(ctx)             # nothing bought, nothing to say: the KV is just smaller
    budget = f"--ram {after.ram_bytes / 1024 ** 3:.2f} GiB"
    return CtxChoice(ctx, f"ctx {default} -> {ctx} to keep {after.cache_slots_per_layer} expert slots per layer "
                          f"({before.cache_slots_per_layer} at ctx {default}) under {budget}; {why}; "
                          "pass --ctx to choose")


def _traded(default: int, plan_at: Callable[[int], ResourcePlan]) -> int:
    """The largest context on the halving ladder from ``default`` down to the floor that keeps
    :data:`KEEP_SHARE` of the floor's slots (``default`` itself when the cache is whole or the model has no
    routed experts)."""
    if not _partial(plan_at(default)) or default <= TRADE_FLOOR:
        return default
    wanted = KEEP_SHARE * plan_at(TRADE_FLOOR).cache_slots_per_layer
    ctx = default
    while ctx > TRADE_FLOOR and plan_at(ctx).cache_slots_per_layer < wanted:
        ctx = max(TRADE_FLOOR, ctx // 2)
    return ctx
