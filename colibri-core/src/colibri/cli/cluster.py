"""``coli cluster``: colibri on a Ray cluster (docs/cluster.md). ``coli cluster serve`` is ``coli serve`` with
replicas (one per node unless ``--replicas`` says otherwise); ``coli cluster status`` shows what the cluster holds."""

from __future__ import annotations

import os
from typing import Optional

import typer

from ..console import emit_json
from ._app import ColiGroup, app
from .options import JsonOption
from .serve import serve_command

cluster_app = typer.Typer(cls=ColiGroup, name="cluster", no_args_is_help=True,
                          help="Run colibri on a Ray cluster: engine replicas behind one endpoint, and its status "
                               "(needs colibri-core[cluster]).")
app.add_typer(cluster_app, name="cluster")

cluster_app.command("serve", help="Serve the model (as coli serve, same options) from engine replicas on the Ray "
                                  "cluster: one per node unless --replicas N.")(serve_command)


@cluster_app.command("status")
def status_command(
    address: Optional[str] = typer.Option(None, "--address", metavar="RAY_ADDRESS", help="The Ray cluster "
                                          "(host:port; default: RAY_ADDRESS, else the one this machine runs)."),
    as_json: bool = JsonOption,
) -> None:
    """Nodes (address, CPUs, RAM, resource tags), replicas (node, state, slots busy, requests served, hit rates)
    and expert shards of the Ray cluster."""
    from ..cluster.replicas import connect
    from ..cluster.status import cluster_status, render

    ray = connect(address or os.environ.get("RAY_ADDRESS") or "auto")
    status = cluster_status(ray)
    if as_json:
        emit_json(status)
    else:
        render(status)
