"""``coli start``, ``coli status``, ``coli logs`` and ``coli stop``: ``coli serve`` as a background server."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any, Optional

import typer

from .. import envvars
from ..console import emit_json, human_bytes, print_pairs, print_table, stdout
from ..server.config import API_KEY_ENV, DEFAULT_HOST, DEFAULT_PORT
from ._app import app
from .options import FamilyOption, JsonOption, ModelOption

NameOption = typer.Option("default", "--name", metavar="NAME",
                          help="Which background server (several may run, each with its own pidfile and log).")


def resident_bytes_of(model: str | None, family: str | None) -> tuple[Any, int]:
    """The resolved model and the bytes its engine keeps resident (headers only)."""
    from ..inventory import load_facts, take_inventory
    from ..model import resolve_model

    resolved = resolve_model(model, family)
    facts = load_facts(resolved)
    return resolved, take_inventory(facts.geometry, facts.layout, facts.tensors).resident_bytes


def start_server(model: str | None, family: str | None, name: str, host: str, port: int,
                 serve_args: list[str], wait: float) -> dict[str, Any]:
    """Start a background server and return its status (what ``coli start`` and ``coli setup`` print)."""
    from .. import daemon
    from .serve import check_bind

    check_bind(host, "--api-key" if "--api-key" in serve_args else os.environ.get(API_KEY_ENV))
    resolved, resident = resident_bytes_of(model, family)
    record, asked = daemon.start(name, resolved.path, resolved.family, resident, host, port, serve_args, wait)
    data = daemon.status(record)
    if record.port != asked:
        data["note"] = f"port {asked} was taken; listening on {record.port}"
    return data


@app.command("start", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def start_command(
    ctx: typer.Context,
    model: Optional[str] = ModelOption,
    family: Optional[str] = FamilyOption,
    name: str = NameOption,
    host: str = typer.Option(DEFAULT_HOST, "--host", help="Address to bind (anything but loopback needs "
                             "--api-key)."),
    port: int = typer.Option(DEFAULT_PORT, "--port", help="First port to try; the next free one is used if taken."),
    wait: float = typer.Option(60.0, "--wait", metavar="SECONDS",
                               help="Seconds to wait for the model to load before returning (it goes on loading "
                                    "after that; `coli status` shows how far it got)."),
    as_json: bool = JsonOption,
) -> None:
    """Start `coli serve` in the background (pidfile + log; any other `coli serve` option is passed on).

    Without --model (and $COLI_MODEL) it serves the model `coli setup` chose."""
    if model is None and not envvars.getenv(envvars.MODEL):
        from ..setup_flow import read_config

        model = read_config().get("model")
    data = start_server(model, family, name, host, port, list(ctx.args), wait)
    if as_json:
        emit_json(data)
        return
    if data.get("note"):
        stdout().print(f"note: {data['note']}")
    stdout().print(f"started {name!r}: {data['url']} (pid {data['pid']}, {data['state']}); "
                   f"log {data['log']}; `coli status` to follow the load, `coli stop` to end it")


def _records(name: str | None) -> list:
    from .. import daemon

    if name is None:
        return list(daemon.records())
    record = daemon.read_record(daemon.check_name(name))
    if record is None:
        raise daemon.ServerStateError(f"no background server named {name!r}",
                                      "coli status lists them; coli start starts one")
    return [record]


def _print_status(data: dict[str, Any]) -> None:
    rows = [("state", data["state"] + (f" ({data['detail']})" if data.get("detail") else "")),
            ("url", data["url"]), ("model", f"{data['model']} ({data['family']})"), ("pid", data["pid"]),
            ("uptime", f"{data['uptime_s']:.0f} s")]
    load = data.get("load")
    if load:
        share = f"{load['fraction'] * 100:.0f}% of " if load.get("fraction") is not None else ""
        rows.append(("load", f"{human_bytes(load['resident_bytes'])} resident, {share}"
                             f"{human_bytes(load['dense_bytes'])} dense weights"))
    tps = data.get("last_decode_tokens_per_s")
    rows.append(("last decode", f"{tps:.2f} tok/s" if tps else "no request yet"))
    rows.append(("log", data["log"]))
    print_pairs(rows)


@app.command("status")
def status_command(name: Optional[str] = typer.Option(None, "--name", metavar="NAME",
                                                      help="One background server (default: all of them)."),
                   as_json: bool = JsonOption) -> None:
    """State, URL, model, load progress and last decode speed of the background servers."""
    from .. import daemon

    found = [daemon.status(r) for r in _records(name)]
    if as_json:
        emit_json(found[0] if name else {"servers": found})
        return
    if not found:
        stdout().print("no background server (start one with `coli start --model NAME`)")
        return
    if len(found) == 1:
        _print_status(found[0])
        return
    print_table(["name", "state", "url", "model"], [(d["name"], d["state"], d["url"], d["model"]) for d in found])


@app.command("logs")
def logs_command(name: str = NameOption,
                 follow: bool = typer.Option(False, "--follow", "-f",
                                             help="Keep printing new lines until the server exits (or Ctrl-C)."),
                 lines: int = typer.Option(200, "--lines", "-n", help="Lines of the end of the log to print first.")
                 ) -> None:
    """Print a background server's log."""
    from .. import daemon

    record = _records(name)[0]
    path = Path(record.log)
    with open(path, "rb") as fh:
        tail = fh.read().decode(errors="replace").splitlines(keepends=True)[-lines:] if lines > 0 else []
        sys.stdout.write("".join(tail))
        sys.stdout.flush()
        while follow and daemon.alive(record):
            chunk = fh.read()
            if chunk:
                sys.stdout.write(chunk.decode(errors="replace"))
                sys.stdout.flush()
            else:
                time.sleep(0.2)
        if follow:
            sys.stdout.write(fh.read().decode(errors="replace"))


@app.command("stop")
def stop_command(name: str = NameOption,
                 grace: float = typer.Option(15.0, "--grace", metavar="SECONDS",
                                             help="Seconds to wait after SIGTERM before killing its process group.")
                 ) -> None:
    """Stop a background server, by its pidfile (never by process name)."""
    from .. import daemon

    record = _records(name)[0]
    how = daemon.stop(record, grace)
    stdout().print(f"{name!r} ({record.url}, pid {record.pid}): {how}")
