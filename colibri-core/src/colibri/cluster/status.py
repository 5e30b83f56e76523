"""``coli cluster status``: what the Ray cluster holds for colibri.

Nodes come from Ray (address, CPUs, resource tags) and from the node itself (its RAM, read by a zero-CPU task
pinned there); replicas answer for themselves (node, state, slots busy, requests served since their last start,
per-request hit rates); expert shards come from the expert-parallel mode when it runs.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

from ..console import human_bytes, print_heading, print_table
from . import NAMESPACE
from .replicas import ACTOR_PREFIX

ANSWER_TIMEOUT_S = 10.0
# Ray's own resources; every other resource of a node is a tag someone gave it
RAY_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")


def node_memory() -> dict[str, int]:
    """Run on a node (as a Ray task): its RAM as colibri's planner sees it."""
    from ..sysinfo import memory

    info = memory()
    return {"ram_total": info.mem_total, "ram_available": info.available_bytes}


def node_rows(ray: ModuleType, measured: dict[str, dict[str, int]]) -> list[dict[str, Any]]:
    """Ray's nodes with their RAM: ``measured`` (node id -> RAM, what the replicas there reported), else a probe
    task on the node (it costs a worker start there, seconds, so only nodes without a replica get one)."""
    nodes = ray.nodes()
    probe = ray.remote(num_cpus=0)(node_memory)
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    pending = {node["NodeID"]: probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
        node["NodeID"], soft=False)).remote() for node in nodes if node.get("Alive") and node["NodeID"] not in measured}
    rows = []
    for node in nodes:
        resources = node.get("Resources", {})
        row: dict[str, Any] = {
            "node_id": node["NodeID"], "address": node.get("NodeManagerAddress"),
            "alive": bool(node.get("Alive")), "cpus": resources.get("CPU", 0),
            "tags": sorted(k for k in resources if k not in RAY_RESOURCES and not k.startswith(("node:",
                                                                                              "accelerator_type"))),
            "ram_total": None, "ram_available": None, **measured.get(node["NodeID"], {}),
        }
        if row["node_id"] in pending:
            try:
                row.update(ray.get(pending[row["node_id"]], timeout=ANSWER_TIMEOUT_S))
            except ray.exceptions.RayError:
                pass   # the node did not answer in time: its RAM stays unknown
        rows.append(row)
    return rows


def replica_rows(ray: ModuleType) -> list[dict[str, Any]]:
    names = sorted(entry["name"] for entry in ray.util.list_named_actors(all_namespaces=True)
                   if entry.get("namespace") == NAMESPACE and entry["name"].startswith(ACTOR_PREFIX))
    asked = []
    for name in names:
        try:
            asked.append((name, ray.get_actor(name, namespace=NAMESPACE).status.remote()))
        except ValueError:    # gone between the listing and the lookup
            continue
    rows = []
    for name, ref in asked:
        try:
            row = {"name": name, **ray.get(ref, timeout=ANSWER_TIMEOUT_S)}
        except ray.exceptions.GetTimeoutError:
            row = {"name": name, "state": "restarting"}   # Ray is restarting it (or its engine is loading)
        except ray.exceptions.RayError:
            row = {"name": name, "state": "dead"}
        rows.append(row)
    return rows


def expert_rows() -> list[dict[str, Any]]:
    """The expert-parallel mode's shards (colibri.cluster.experts), or none when that mode is not installed."""
    try:
        experts = importlib.import_module(f"{__package__}.experts")
    except ImportError:
        return []
    return list(experts.expert_shard_rows())


def cluster_status(ray: ModuleType) -> dict[str, Any]:
    replicas = replica_rows(ray)
    measured = {r["node_id"]: r["node_ram"] for r in replicas if r.get("node_ram")}
    return {"nodes": node_rows(ray, measured), "replicas": replicas, "expert_shards": expert_rows()}


def _share(value: Any) -> str:
    return "-" if value is None else f"{100 * float(value):.1f}%"


def _size(value: Any) -> str:
    return "-" if value is None else human_bytes(value)


def render(status: dict[str, Any]) -> None:
    nodes = status["nodes"]
    print_heading(f"nodes ({sum(n['alive'] for n in nodes)} alive)")
    print_table(("address", "state", "cpus", "ram total", "ram available", "tags", "node id"),
                [(n["address"], "alive" if n["alive"] else "dead", f"{n['cpus']:g}", _size(n["ram_total"]),
                  _size(n["ram_available"]), ",".join(n["tags"]) or "-", n["node_id"][:12]) for n in nodes])
    replicas = status["replicas"]
    if replicas:
        by_id = {n["node_id"]: n["address"] for n in nodes}
        print_heading(f"replicas ({len(replicas)})")
        print_table(("name", "node", "state", "slots busy", "served", "failed", "last hit rate",
                     "mean hit rate", "engine hit rate", "engine rss"),
                    [(r["name"], by_id.get(r.get("node_id"), r.get("node_ip", "-")), r["state"],
                      f"{r['slots_busy']}/{r['slots']}" if "slots" in r else "-", r.get("served", "-"),
                      r.get("failed", "-"), _share(r.get("last_hit_rate")), _share(r.get("mean_hit_rate")),
                      _share(r.get("engine_hit_rate")), _size(r.get("rss_bytes"))) for r in replicas])
    shards = status["expert_shards"]
    if shards:
        print_heading(f"expert shards ({len(shards)})")
        columns = list(dict.fromkeys(key for row in shards for key in row))
        print_table(columns, [[row.get(c, "-") for c in columns] for row in shards])
    if not replicas and not shards:
        print_heading("no colibri replicas or expert shards run on this cluster")
