"""``coli families``: every installed family plugin, what it claims, its engine, and why a broken one failed."""

from __future__ import annotations

from typing import Any

import typer

from .. import hooks, plugins
from ..console import emit_json, print_table, print_warning, stdout
from ..doctor import engine_status
from ._app import app
from .options import JsonOption


def _describe(name: str) -> tuple[Any, str]:
    """The family's own describe_family answer (not whichever plugin answers first), or an error line.

    The descriptor must carry the entry-point name: model hooks are routed by the family name a claim states, so
    a plugin registered as ``a`` that calls itself ``b`` would be asked nothing."""
    try:
        desc = hooks.describe_family(name)
    except Exception as exc:  # a family's bug is reported on its own row, not a crash
        return None, f"describe_family raised {type(exc).__name__}: {exc}"
    if desc is None:
        return None, "does not implement describe_family"
    if desc.name != name:
        return desc, (f"describe_family names the family {desc.name!r} but its entry point is {name!r} "
                      "(the two must be equal: model hooks are routed by that name)")
    return desc, ""


def family_rows() -> list[dict[str, Any]]:
    rows = []
    for name, fam in sorted(plugins.families().items()):
        row: dict[str, Any] = {"family": name, "package": fam.package, "version": fam.version,
                               "model_types": [], "description": "", "engine": "", "engine_built": False,
                               "status": "ok", "error": ""}
        if fam.error:
            row.update(status="broken", error=fam.error, engine="-")
            rows.append(row)
            continue
        desc, problem = _describe(name)
        if desc is not None:
            row.update(model_types=list(desc.model_types), description=desc.description)
        if problem:
            row.update(status="broken", error=problem)
        try:
            built, text = engine_status(name)
        except Exception as exc:  # the engine probe of one family must not hide the others
            built, text = False, f"unknown ({type(exc).__name__}: {exc})"
        row.update(engine=text, engine_built=built)
        rows.append(row)
    return rows


@app.command("families")
def families_command(ctx: typer.Context, as_json: bool = JsonOption) -> None:
    """List installed families: package, version, model types, engine, and load errors."""
    rows = family_rows()
    if as_json:
        emit_json(rows)
        return
    if not rows:
        stdout().print("no colibri families installed (pip install a family package, e.g. colibri-olmoe)")
        return
    table = [(r["family"], r["package"], r["version"], ", ".join(r["model_types"]) or "-",
              r["engine"] if r["status"] == "ok" else "broken") for r in rows]
    print_table(["family", "package", "version", "model types", "engine"], table,
                styles={4: {"broken": "red bold"}})
    debug = bool(ctx.find_root().params.get("debug"))
    loaded = plugins.families()
    for r in rows:
        if r["error"]:
            print_warning(f"family {r['family']} ({r['package']} {r['version']}) is broken and skipped: "
                          f"{r['error']}")
            if debug and loaded[r["family"]].details:
                typer.echo(loaded[r["family"]].details, err=True)
