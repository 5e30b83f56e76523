"""``coli pull``, ``coli list`` and ``coli rm``: models in colibri's model directory, by name."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any, Optional

import typer

from ..console import emit_json, human_bytes, print_table, stdout
from ..errors import ColibriError
from ._app import app
from .options import JsonOption


class RichPullReporter:
    """One bar over the repo's bytes (done, total, rate, time left) on a terminal; a line per file otherwise."""

    def __init__(self, console=None) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn,
        )

        self.console = console or Console(file=sys.stderr, highlight=False, soft_wrap=True)
        self.live = self.console.is_terminal
        self.progress = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                                 TransferSpeedColumn(), TimeRemainingColumn(), console=self.console,
                                 transient=False, disable=not self.live)
        self.task: Any = None
        self.repo_id = ""
        self.file_started = 0.0
        self.file_bytes = 0

    def start(self, repo, total_bytes: int, done_bytes: int) -> None:
        self.repo_id = repo.repo_id
        self.progress.start()
        self.task = self.progress.add_task(f"{repo.repo_id}", total=total_bytes, completed=done_bytes)

    def file(self, f) -> None:
        self.progress.update(self.task, description=f"{self.repo_id}: {f.name}")
        self.file_started, self.file_bytes = time.monotonic(), 0

    def advance(self, nbytes: int) -> None:
        self.progress.advance(self.task, nbytes)
        self.file_bytes += nbytes

    def file_done(self, f) -> None:
        if not self.live:   # logs and pipes get a line per file instead of a live bar
            seconds = max(time.monotonic() - self.file_started, 1e-6)
            self.console.print(f"fetched {f.name}: {human_bytes(self.file_bytes)} at "
                               f"{human_bytes(self.file_bytes / seconds)}/s ({human_bytes(f.size)}, checksum "
                               "verified)")

    def finish(self) -> None:
        self.progress.update(self.task, description=f"{self.repo_id}: done")
        self.progress.stop()

    def stop(self) -> None:
        if self.task is not None:
            self.progress.stop()


@app.command("pull")
def pull_command(
    ref: str = typer.Argument(..., metavar="REPO[@REVISION]", help="A hub repo id, e.g. allenai/OLMoE-1B-7B-0924."),
    include: Optional[list[str]] = typer.Option(
        None, "--include", metavar="GLOB", help="Only files matching this glob (repeatable), e.g. '*.json'."),
    directory: Optional[Path] = typer.Option(None, "--dir", metavar="DIR",
                                             help="Download into DIR instead of the model directory."),
) -> None:
    """Download a model repo from the hub (HF_ENDPOINT, HF_TOKEN) into the model directory; a rerun resumes."""
    from huggingface_hub.utils import logging as hf_logging

    from ..pull import pull

    hf_logging.set_verbosity_error()   # its retry warnings would break the one error line; the bar shows progress
    reporter = RichPullReporter()
    try:
        result = pull(ref, include=include, dest=directory, reporter=reporter)
    finally:
        reporter.stop()
    out = stdout()
    if result.offline:
        out.print(f"{result.dest}: already pulled (offline mode: not checked for updates)")
        return
    assert result.repo is not None     # a pull that reached the hub knows the repo and its commit
    if result.already_complete:
        out.print(f"{result.dest}: up to date ({result.repo.repo_id} at {result.repo.commit[:12]})")
    else:
        out.print(f"{result.dest}: {result.fetched_files} file(s), {human_bytes(result.fetched_bytes)} fetched "
                  f"({result.repo.repo_id} at {result.repo.commit[:12]})")


def _describe(directory: Path) -> dict[str, Any]:
    """Family and storage scheme of a local model from its headers; what is wrong instead when unreadable."""
    from .. import models_dir
    from ..inventory import load_facts, take_inventory
    from ..model import resolve_model

    record = models_dir.read_record(directory) or {}
    row: dict[str, Any] = {"path": str(directory), "size_bytes": models_dir.size_on_disk(directory),
                           "repo_id": record.get("repo_id"), "commit": record.get("commit"),
                           "complete": record.get("complete", True), "family": None, "container": None}
    try:
        facts = load_facts(resolve_model(directory))
    except ColibriError as exc:
        row["problem"] = exc.message
        return row
    row["family"] = facts.model.family
    if facts.container is not None:
        row["container"] = "colibri-quant " + (", ".join(facts.quant_schemes) or "float")
    else:
        dtypes = take_inventory(facts.geometry, facts.layout, facts.tensors).dtypes
        row["container"] = "source " + "+".join(sorted(dtypes, key=lambda d: -dtypes[d])[:3])
    return row


@app.command("list")
def list_command(as_json: bool = JsonOption) -> None:
    """Models in the model directory ($COLIBRI_MODELS): name, family, size on disk, container scheme."""
    from .. import models_dir
    from ..xdg import models_root

    rows = [{"name": name, **_describe(path)} for name, path in models_dir.local_models()]
    if as_json:
        emit_json({"models_dir": str(models_root()), "models": rows})
        return
    if not rows:
        stdout().print(f"no models in {models_root()} (get one with `coli pull ORG/NAME` or `coli setup`)")
        return
    print_table(["name", "family", "size", "container", "state"],
                [(r["name"], r["family"] or "-", human_bytes(r["size_bytes"]), r["container"] or "-",
                  ("incomplete: rerun coli pull" if not r["complete"] else r.get("problem", "ok")))
                 for r in rows])


@app.command("rm")
def rm_command(names: list[str] = typer.Argument(..., metavar="NAME...",
                                                  help="Models to delete, as `coli list` names them.")) -> None:
    """Delete pulled models from the model directory."""
    from .. import models_dir

    for name in names:
        removed = models_dir.remove(name)
        stdout().print(f"removed {name} ({removed})")
