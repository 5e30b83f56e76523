"""colibri's model directory: where ``coli pull`` puts a repo, and how a model is found again by its name.

A repo ``Org/Name`` pulled at the default branch lives in ``<models root>/Org/Name``; one pulled at a revision in
``<models root>/Org/Name@REVISION``. The files are the repo's own, laid out as on the hub (no symlinks), so any
tool that reads a Hugging Face checkpoint directory reads it. ``.colibri-pull.json`` beside them records where they
came from and which files are complete and verified.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from .errors import ModelNotFoundError, UsageError
from .xdg import MODELS_ENV, models_root

RECORD = ".colibri-pull.json"


def local_name(repo_id: str, revision: str | None) -> str:
    return f"{repo_id}@{revision}" if revision else repo_id


def default_dest(repo_id: str, revision: str | None) -> Path:
    return models_root() / local_name(repo_id, revision)


def is_name(text: str) -> bool:
    """A model name (``Org/Name[@REV]`` or ``Name``), not a path someone typed on purpose."""
    parts = text.split("/")
    return (bool(text) and not text.startswith(("/", ".", "~")) and len(parts) <= 2
            and all(p and p not in (".", "..") for p in parts))


def find(name: str) -> Path | None:
    """The pulled copy of ``name`` in the model directory, or ``None``."""
    if not is_name(name):
        return None
    candidate = models_root() / name
    return candidate if candidate.is_dir() else None


def read_record(directory: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((directory / RECORD).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def write_record(directory: Path, data: dict[str, Any]) -> None:
    """Atomically: a crash leaves the old record or the new one, never half of one."""
    tmp = directory / f"{RECORD}.tmp{os.getpid()}"
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True), encoding="utf-8")
    os.replace(tmp, directory / RECORD)


def _is_model_dir(path: Path) -> bool:
    return (path / RECORD).is_file() or (path / "config.json").is_file()


def local_models() -> list[tuple[str, Path]]:
    """(name, directory) of every model in the model directory: ``Name`` or ``Org/Name[@REV]``, sorted."""
    root = models_root()
    found: list[tuple[str, Path]] = []
    if not root.is_dir():
        return found
    for first in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        if _is_model_dir(first):
            found.append((first.name, first))
            continue
        for second in sorted(p for p in first.iterdir() if p.is_dir() and not p.name.startswith(".")):
            if _is_model_dir(second):
                found.append((f"{first.name}/{second.name}", second))
    return found


def size_on_disk(directory: Path) -> int:
    """Bytes the directory's files occupy (allocated blocks: a sparse file counts what it really uses)."""
    total = 0
    for dirpath, _dirs, files in os.walk(directory):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
            except OSError:
                pass
    return total


def remove(name: str) -> Path:
    """Delete a pulled model by name; refuses anything outside the model directory."""
    directory = find(name)
    if directory is None:
        known = ", ".join(n for n, _ in local_models()[:8]) or "none"
        raise ModelNotFoundError(f"{name}: no such model in {models_root()}",
                                 f"`coli list` shows what is there ({known}); the directory is ${MODELS_ENV}")
    root = models_root().resolve()
    resolved = directory.resolve()
    if root not in resolved.parents:
        raise UsageError(f"{directory}: not inside the model directory {root}", "remove it by hand")
    shutil.rmtree(resolved)
    parent = resolved.parent
    if parent != root and not any(parent.iterdir()):
        parent.rmdir()      # the now empty Org/ folder
    return resolved
