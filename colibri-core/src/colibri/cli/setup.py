"""``coli setup``: detect the machine, recommend a catalog model that fits, pull (and convert) it, serve it."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Optional

import typer

from ..console import emit_json, human_bytes, human_count, print_pairs, print_table, stdout
from ..errors import UsageError
from ..server.config import DEFAULT_HOST, DEFAULT_PORT
from ._app import app
from .options import JsonOption


class _QuietConvert:
    def start(self, total_bytes: int, shards: int) -> None: ...
    def shard(self, plan, resumed: bool) -> None: ...
    def advance(self, nbytes: int) -> None: ...
    def finish(self) -> None: ...


def _table(candidates) -> None:
    rows = []
    for c in candidates:
        e = c.entry
        scheme = f"experts {e.experts}, dense {e.dense}" if e.experts else "as shipped"
        rows.append((e.repo, e.family, e.parameters or human_count(c.total_params), scheme,
                     human_bytes(c.expert_bytes) if c.expert_bytes else "-",
                     human_bytes(c.min_ram_bytes) if c.min_ram_bytes else "-",
                     human_bytes(c.disk_needed_bytes) if c.disk_needed_bytes else "-",
                     f"{c.tokens_per_s:.2f}" if c.tokens_per_s else "-", "yes" if c.fits else f"no: {c.problem}"))
    print_table(["repo", "family", "parameters", "container", "expert", "min RAM", "disk", "tok/s (disk)", "fits"],
                rows)


def _running_same(name: str, model_dir: Path) -> dict[str, Any] | None:
    from .. import daemon

    record = daemon.read_record(name)
    if record is None or not daemon.alive(record):
        return None
    if Path(record.model) != model_dir:
        raise daemon.ServerStateError(f"server {name!r} is running another model ({record.model})",
                                      f"coli stop{'' if name == daemon.DEFAULT_NAME else ' --name ' + name} "
                                      "first, or pass --name NAME for a second server")
    return daemon.status(record)


@app.command("setup")
def setup_command(
    yes: bool = typer.Option(False, "--yes", "-y", help="Unattended: take the recommendation without asking."),
    model: Optional[str] = typer.Option(None, "--model", metavar="REPO",
                                        help="Set up this catalog repo instead of the largest one that fits."),
    catalog: Optional[Path] = typer.Option(None, "--catalog", metavar="FILE",
                                           help="Catalog of candidate models (default: colibri's; also "
                                                "$COLIBRI_CATALOG)."),
    ram: Optional[float] = typer.Option(None, "--ram", metavar="GB",
                                        help="RAM budget in GiB (default: available RAM within cgroup limits)."),
    disk_bw: Optional[float] = typer.Option(None, "--disk-bw", metavar="GB/s",
                                            help="Disk read speed in GB/s (default: measured once, remembered)."),
    ctx: Optional[int] = typer.Option(None, "--ctx", metavar="N", help="Context per slot to plan for."),
    name: str = typer.Option("default", "--name", metavar="NAME", help="Name of the background server."),
    host: str = typer.Option(DEFAULT_HOST, "--host", help="Address the server binds."),
    port: int = typer.Option(DEFAULT_PORT, "--port", help="First port to try for the server."),
    start: bool = typer.Option(True, "--start/--no-start", help="Start the server at the end."),
    keep_source: bool = typer.Option(False, "--keep-source",
                                     help="Keep the downloaded release after converting it."),
    as_json: bool = JsonOption,
) -> None:
    """From nothing to a served model: detect RAM, disk and cores; pick a catalog model that fits; pull, convert,
    configure and start it. Safe to rerun."""
    from .. import setup_flow
    from .daemon import start_server
    from .models import RichPullReporter

    entries = setup_flow.load_catalog(catalog)
    machine = setup_flow.detect(ram, disk_bw)
    say = (lambda *a: None) if as_json else stdout().print
    say(f"machine: {human_bytes(machine.ram_bytes)} RAM usable ({machine.ram_source}), {machine.cores} cores, "
        f"{human_bytes(machine.disk_free_bytes)} free in {machine.disk_path} at "
        f"{machine.disk_bandwidth / 1e9:.2f} GB/s ({machine.disk_source})")
    candidates = [setup_flow.assess(e, machine, ctx) for e in entries]
    if not as_json:
        _table(candidates)
    choice = setup_flow.choose(candidates, model)
    if not yes:
        if not sys.stdin.isatty():
            raise UsageError(f"would set up {choice.entry.repo}, but there is no terminal to confirm it",
                             "pass --yes to accept, or --model REPO to choose")
        if not typer.confirm(f"Set up {choice.entry.repo} ({choice.entry.parameters})?", default=True):
            raise typer.Exit(1)
    say(f"setting up {choice.entry.repo}")
    reporter = RichPullReporter()
    try:
        from .convert import RichReporter

        model_dir = setup_flow.install(choice, reporter, _QuietConvert() if as_json else RichReporter(), keep_source)
    finally:
        reporter.stop()
    config = {"model": str(model_dir), "repo": choice.entry.repo, "family": choice.entry.family,
              "container": ({"experts": choice.entry.experts, "dense": choice.entry.dense}
                            if choice.entry.experts else None),
              "server": {"name": name, "host": host, "port": port}, "ctx": ctx}
    config_path = setup_flow.write_config(config)
    server = None
    if start:
        server = _running_same(name, model_dir)
        if server is None:
            server = start_server(str(model_dir), choice.entry.family, name, host, port,
                                  [*(["--ctx", str(ctx)] if ctx else []), *(["--ram", str(ram)] if ram else [])],
                                  wait=120.0)
        else:
            server["note"] = "already running this model; left as it is"
    if as_json:
        emit_json({"machine": setup_flow.machine_json(machine),
                   "candidates": [setup_flow.candidate_json(c) for c in candidates],
                   "chosen": choice.entry.repo, "model": str(model_dir), "config": str(config_path),
                   "server": server})
        return
    pairs = [("model", str(model_dir)), ("configuration", str(config_path))]
    if server:
        pairs += [("server", f"{server['url']} ({server['state']})"), ("try", f"curl {server['url']}/models")]
        if server.get("note"):
            pairs.append(("note", server["note"]))
    print_pairs(pairs)
