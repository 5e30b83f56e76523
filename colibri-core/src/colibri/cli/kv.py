"""``coli kv list`` and ``coli kv clear``: the conversations saved to disk (colibri/kv_store.py), per model."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Optional

import typer

from ..console import emit_json, human_bytes, print_table, stdout
from ..errors import UsageError
from ._app import ColiGroup, app
from .options import JsonOption, KvDirOption

kv_app = typer.Typer(cls=ColiGroup, name="kv", no_args_is_help=True,
                     help="Saved conversation KV: list it, or clear it per model or all.")
app.add_typer(kv_app, name="kv")


def _models(kv_dir: str | None) -> list[dict[str, Any]]:
    from ..kv_store import describe_model, kv_root, model_dirs, saved_files

    rows = []
    for directory in model_dirs(kv_root(kv_dir)):
        files = saved_files(directory)
        record = describe_model(directory)
        rows.append({"directory": str(directory), "model": record.get("model"), "name": record.get("name"),
                     "family": record.get("family"), "files": len(files),
                     "tokens": sum(f.n_tokens for f in files), "bytes": sum(f.size for f in files),
                     "last_used": max((f.mtime for f in files), default=None)})
    return rows


def _ago(stamp: float | None) -> str:
    if stamp is None:
        return "-"
    seconds = max(0.0, time.time() - stamp)
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f} {unit} ago"
    return f"{seconds:.0f} s ago"


@kv_app.command("list")
def list_command(kv_dir: Optional[str] = KvDirOption, as_json: bool = JsonOption) -> None:
    """Saved KV per model: files, tokens, size on disk, when last used."""
    from ..kv_store import kv_root

    rows = _models(kv_dir)
    if as_json:
        emit_json({"kv_dir": str(kv_root(kv_dir)), "models": rows})
        return
    if not rows:
        stdout().print(f"no saved KV in {kv_root(kv_dir)}")
        return
    print_table(["model", "family", "files", "tokens", "size", "last used", "directory"],
                [(r["name"] or "(unknown)", r["family"] or "-", r["files"], r["tokens"], human_bytes(r["bytes"]),
                  _ago(r["last_used"]), Path(r["directory"]).name) for r in rows])


@kv_app.command("clear")
def clear_command(
    model: Optional[str] = typer.Option(None, "--model", "-m", metavar="DIR|NAME",
                                        help="Clear only this model's saved KV (a directory, or its name as "
                                             "`coli kv list` shows it)."),
    all_models: bool = typer.Option(False, "--all", help="Clear every model's saved KV."),
    kv_dir: Optional[str] = KvDirOption,
) -> None:
    """Delete saved KV (and the kept `coli chat --resume` conversation) of one model, or of all."""
    import shutil

    from ..kv_store import kv_root

    if (model is None) == (not all_models):
        raise UsageError("coli kv clear needs --model NAME or --all", "coli kv list shows the models")
    wanted = None if model is None else _model_key(model)
    cleared = []
    for row in _models(kv_dir):
        if wanted is None or wanted in (row["model"], row["name"]):
            shutil.rmtree(row["directory"], ignore_errors=True)
            cleared.append(row)
    if wanted is not None and not cleared:
        raise UsageError(f"--model {model}: no saved KV for it in {kv_root(kv_dir)}",
                         "coli kv list shows the models that have some")
    freed = sum(r["bytes"] for r in cleared)
    stdout().print(f"cleared {len(cleared)} model(s), {sum(r['files'] for r in cleared)} file(s), "
                   f"{human_bytes(freed)}")


def _model_key(model: str) -> str:
    """A model directory as ``model.json`` records it (resolved), or the name as given."""
    path = Path(model).expanduser()
    return str(path.resolve()) if path.is_dir() else model
