"""``coli build``: compile family engines now instead of on first use."""

from __future__ import annotations

from typing import Optional

import typer

from ..console import emit_json, print_pairs
from ..errors import EngineError
from ._app import app
from .options import JsonOption


@app.command("build")
def build_command(
    family: Optional[str] = typer.Argument(None, help="Family to build (default: every family with an engine)."),
    force: bool = typer.Option(False, "--force", help="Rebuild even when an identical build is cached."),
    as_json: bool = JsonOption,
) -> None:
    """Compile the C engine of one family (or all), with the shared runtime, into the build cache."""
    from .. import builder, plugins

    if family is not None:
        names = [family]
    else:
        names = builder.families_with_engines()
        if not names:
            installed = ", ".join(n for n, f in plugins.families().items() if not f.error) or "none"
            raise EngineError("no installed family ships an engine", f"installed families: {installed}")
    built = {name: builder.build_family(name, force=force) for name in names}
    if as_json:
        emit_json({name: str(path) for name, path in built.items()})
    else:
        print_pairs([(name, str(path)) for name, path in built.items()])
