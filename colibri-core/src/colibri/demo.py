"""``coli demo``'s family-neutral parts: asking the families for a demo model, building a cache directory once
(atomically, under a lock), and the RAM budget whose expert cache holds a given share of each layer's experts.

Which checkpoint the demo runs is family knowledge: the ``demo_model`` hook answers it (colibri-olmoe ships a
small trained model and writes the random-weight ``--synthetic`` one).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Callable

from .cachedir import cache_root, file_lock
from .errors import EngineError
from .records import DemoModel

COMPLETE_MARKER = ".complete"


def demo_cache_dir() -> Path:
    return cache_root() / "demo"


def find_demo_model(synthetic: bool = False) -> DemoModel:
    """The first installed family's demo model; a clear error naming the package to install when none offers one."""
    from . import hooks, plugins

    cache_dir = demo_cache_dir()
    cache_dir.mkdir(parents=True, exist_ok=True)
    found = hooks.demo_model(cache_dir, synthetic)
    if found is None:
        kind = "a synthetic demo model" if synthetic else "a demo model"
        broken = [f"{name} ({fam.error})" for name, fam in plugins.families().items() if fam.error]
        why = f"; broken plugins: {', '.join(broken)}" if broken else ""
        raise EngineError(f"coli demo: no installed family offers {kind}{why}",
                          "pip install colibri-olmoe (or ./colibri-olmoe from a checkout)")
    return found


def ensure_directory(final: Path, write: Callable[[Path], None]) -> tuple[Path, bool]:
    """``final``, created by ``write(tmp)`` into a temporary sibling and renamed into place if it is not complete
    yet; (path, built_now). Concurrent callers wait on a lock; a leftover without the completion marker (a killed
    build) is rebuilt, never trusted."""
    if (final / COMPLETE_MARKER).exists():
        return final, False
    final.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(final.parent / f".{final.name}.lock"):
        if (final / COMPLETE_MARKER).exists():
            return final, False
        tmp = final.parent / f".{final.name}.{os.getpid()}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            write(tmp)
            (tmp / COMPLETE_MARKER).write_text("ok\n")
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final, True


def budget_for_cache_fraction(facts, ctx: int, fraction: float = 0.25) -> int:
    """The RAM budget at which the planner gives each MoE layer ``fraction`` of its experts as cache slots."""
    from . import hooks
    from .records import PlanRequest

    def plan(ram: int):
        request = PlanRequest(ram_bytes=ram, ctx=ctx, kv_slots=1)
        return hooks.plan_resources(facts.model, request, facts.geometry, facts.layout, facts.tensors)

    probe = plan(1 << 50)
    fixed = probe.dense_bytes + probe.kv_bytes + probe.state_bytes + probe.reserve_bytes
    slots = max(1, int(probe.experts_per_layer * fraction))
    ram = fixed + slots * probe.expert_bytes * probe.moe_layers
    got = plan(ram)
    if got.cache_slots_per_layer != slots:   # a family planner with its own arithmetic: search for it
        lo, hi = fixed, 1 << 50
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if plan(mid).cache_slots_per_layer <= slots:
                lo = mid
            else:
                hi = mid - 1
        ram = lo
    return ram
