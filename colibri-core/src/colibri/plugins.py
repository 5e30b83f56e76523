"""Loading family plugins from the ``colibri.families`` entry-point group.

Loaded once per process. ``COLIBRI_LOAD_PLUGINS`` (comma-separated entry-point names) loads only those;
``COLIBRI_DISABLE_PLUGINS`` skips the named ones. A plugin that fails to import is recorded and skipped: it is
shown by ``coli families`` and never takes the CLI down.
"""

from __future__ import annotations

import os
import traceback
from dataclasses import dataclass
from importlib import metadata
from typing import Any

import pluggy

from . import defaults, hookspecs

ENTRY_POINT_GROUP = "colibri.families"


@dataclass(frozen=True)
class LoadedFamily:
    """One entry point of the group, loaded or not."""

    entry_point: str
    package: str
    version: str
    plugin: Any = None
    error: str = ""          # one line: why it failed to load
    details: str = ""        # the traceback, for --debug


_manager: pluggy.PluginManager | None = None
_families: dict[str, LoadedFamily] = {}


def _names_from_env(var: str) -> set[str] | None:
    raw = os.environ.get(var)
    if raw is None:
        return None
    return {name.strip() for name in raw.split(",") if name.strip()}


def _family_entry_points() -> list[metadata.EntryPoint]:
    return sorted(metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda ep: ep.name)


def _load() -> tuple[pluggy.PluginManager, dict[str, LoadedFamily]]:
    pm = pluggy.PluginManager("colibri")
    pm.add_hookspecs(hookspecs)
    pm.register(defaults.CoreDefaults(family_hook), name="colibri.defaults")
    only = _names_from_env("COLIBRI_LOAD_PLUGINS")
    disabled = _names_from_env("COLIBRI_DISABLE_PLUGINS") or set()
    families: dict[str, LoadedFamily] = {}
    for ep in _family_entry_points():
        if ep.name in families or (only is not None and ep.name not in only) or ep.name in disabled:
            continue
        package = ep.dist.name if ep.dist else "?"
        version = ep.dist.version if ep.dist else "?"
        try:
            plugin = ep.load()
            pm.register(plugin, name=ep.name)
        except Exception as exc:  # a broken third-party plugin must not take colibri down
            first_line = (str(exc).splitlines() or [""])[0]
            families[ep.name] = LoadedFamily(
                ep.name, package, version, error=f"{type(exc).__name__}: {first_line}",
                details=traceback.format_exc(),
            )
            continue
        families[ep.name] = LoadedFamily(ep.name, package, version, plugin=plugin)
    pm.check_pending()
    return pm, families


def manager() -> pluggy.PluginManager:
    """The process-wide plugin manager, loading the entry points on first use."""
    global _manager, _families
    if _manager is None:
        _manager, _families = _load()
    return _manager


def families() -> dict[str, LoadedFamily]:
    """Every entry point of the group by name, with its load error if it failed."""
    manager()
    return dict(_families)


def reset() -> None:
    """Forget loaded plugins (tests use this after changing the environment or installed packages)."""
    global _manager, _families
    _manager, _families = None, {}


def register(plugin: Any, name: str, package: str = "(registered in-process)", version: str = "") -> None:
    """Register a family plugin object directly, as if an entry point had loaded it (tests, embedding apps)."""
    manager().register(plugin, name=name)
    _families[name] = LoadedFamily(name, package, version, plugin=plugin)


def family_hook(family: str, name: str) -> Any:
    """A hook caller restricted to one family's plugin plus core's defaults.

    Model-bound hooks must be answered by the family that claimed the model, never by whichever plugin happens
    to answer first; this is what replaces an ``if family == ...`` chain.
    """
    pm = manager()
    others = [p for n, p in pm.list_name_plugin() if n not in (family, "colibri.defaults") and p is not None]
    return pm.subset_hook_caller(name, remove_plugins=others)


def _code_of(plugin: Any) -> tuple[str, bool]:
    """Where a plugin's code lives: (name, is_package). An entry-point module's top-level package (its helpers are
    its code too); for an object registered in-process, the module that defines its class, exactly."""
    if isinstance(plugin, type(os)):
        return plugin.__name__.split(".")[0], True
    return type(plugin).__module__, False


def culprit(exc: BaseException) -> LoadedFamily | None:
    """The family plugin whose code the exception went through (innermost first), or None when only core's did.

    A bug inside a family hook is that plugin's to fix: the CLI names its package and version instead of calling
    it a colibri internal error."""
    packages: dict[str, LoadedFamily] = {}
    modules: dict[str, LoadedFamily] = {}
    for fam in _families.values():
        if fam.plugin is None:
            continue
        name, is_package = _code_of(fam.plugin)
        if name != __name__.split(".")[0]:
            (packages if is_package else modules)[name] = fam
    tb, frames = exc.__traceback__, []
    while tb is not None:
        frames.append(tb.tb_frame.f_globals.get("__name__", ""))
        tb = tb.tb_next
    for module in reversed(frames):
        owner = modules.get(module) or packages.get(module.split(".")[0])
        if owner is not None:
            return owner
    return None
