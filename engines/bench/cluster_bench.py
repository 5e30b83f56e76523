"""Expert-parallel on a loopback Ray cluster (``nox -s bench_cluster``; never a default session).

The OLMoE-1B-7B-geometry checkpoint ``nox -s bench`` builds (stream_bench.build_checkpoint, cached under
``$COLIBRI_BENCH_CACHE``), a Ray cluster of one head node and three expert nodes on 127.0.0.1 (each its own
``colibri_experts_<name>`` resource), and for 1, 2 and 3 expert workers: the head engine with a small expert cache,
each worker holding at most a third of the experts (its RAM bound; with root, each worker and the head also run in
a cgroup v1 memory group capped there, as stream_bench does), so no single node's RAM holds the hot set and the
disk serves what no node holds. The same prompt, then teacher-forced decode steps.

Per run: decode tok/s, bytes read from disk per decoded token, and the network per token and per MoE layer (bytes
both ways, messages, round trips) as the head engine counts them, with the 1-minute load average and the share of
the CPU other processes took during the run (machine_load; with root, everything the bench starts, Ray's own
daemons included, is counted as ours through a cpuacct group). ``--rounds`` rounds run every (partition, workers)
configuration once each, in an order that rotates every round so no configuration always follows the same one;
each configuration's figure is the median of its uncontended runs (other processes under ``--contended`` of the
CPU), or of all its runs, flagged, when none was.

``--quick``: the tiny OLMoE test model instead, few tokens, no cgroups (checks that the session works; its speed
means nothing). Writes ``bench-results/cluster_bench.json`` and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench-results"
sys.path.insert(0, str(Path(__file__).resolve().parent))

from machine_load import LoadWindow, OwnCpuGroup  # noqa: E402


def log(msg: str) -> None:
    print(f"[cluster_bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def start_ray(nodes: int):
    temp = tempfile.mkdtemp(prefix="cb", dir="/tmp")   # short: Ray's socket paths live under it
    os.makedirs(f"{temp}/ray")
    os.environ.update({"RAY_TMPDIR": temp, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"})
    import ray
    from ray.cluster_utils import Cluster

    ray._private.ray_constants.ENABLE_RAY_CLUSTER = False   # keep 127.0.0.1 (read at import)
    node = {"num_cpus": 1, "object_store_memory": 80 << 20, "node_ip_address": "127.0.0.1"}
    cluster = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False,
                                                           "temp_dir": f"{temp}/ray"})
    for i in range(nodes):
        cluster.add_node(**node, resources={f"colibri_experts_n{i}": 1})
    cluster.wait_for_nodes()
    from colibri.cluster import experts

    ray.init(address=cluster.address, namespace=experts.NAMESPACE, log_to_driver=False)
    return cluster


def checkpoint(quick: bool, work: Path) -> Path:
    if quick:
        from colibri.testing.tiny import tiny_model

        return tiny_model("olmoe", work, seed=11, num_layers=3, num_experts=16, top_k=4).path
    import stream_bench

    return stream_bench.build_checkpoint(stream_bench.CACHE / "olmoe-synth", skew=False, experts_from=None)


def capped_group(limit: int, name: str):
    """A cgroup v1 memory group at ``limit`` bytes (stream_bench's, one per name), or None without root."""
    import stream_bench

    try:
        return stream_bench.CappedGroup(limit, name)
    except (OSError, RuntimeError) as exc:
        log(f"no memory cap for {name} ({exc}); the RAM bound is the share size alone")
        return None


def run(model: Path, workers: int, partition: str, args, layers: dict[int, int], expert_bytes: int,
        tag: str, cpu: OwnCpuGroup | None) -> dict:
    from colibri import inventory, launch
    from colibri.cluster import experts
    from colibri.engine import Engine
    from colibri.model import resolve_model

    resolved = resolve_model(str(model), None)
    facts = inventory.load_facts(resolved)
    total = sum(layers.values())
    per_worker = max(1, total // 3)   # a third of the experts: one node never holds the hot set
    spec = launch.prepare(resolved, ctx=args.prompt + args.decode + 8, cap=args.cap, threads=args.threads,
                          streaming=launch.Streaming(io="auto"))
    groups = []
    prefix = None
    if not args.quick and workers:
        # One group for the workers (all on this machine): each holds per_worker experts, so together at most
        # workers x that; the per-node bound itself is the share size (max_per_worker).
        g = capped_group(workers * (per_worker * expert_bytes + (128 << 20)), f"workers-{tag}")
        if g is not None:
            groups.append(g)
            prefix = g.wrap([])
    ec = None
    argv = list(spec.argv)
    if workers:
        ec = experts.start_expert_cluster(Path(spec.argv[0]), model, workers, partition, layers=layers,
                                          threads=args.threads, max_per_worker=per_worker, argv_prefix=prefix)
        argv += ec.engine_args()
    if not args.quick:
        head = capped_group(spec.plan.dense_bytes + spec.plan.kv_bytes + spec.plan.reserve_bytes +
                            args.cap * len(layers) * expert_bytes + (256 << 20), f"head-{tag}")
        if head is not None:
            groups.append(head)
            argv = head.wrap(argv)
    vocab = facts.model.config["vocab_size"]
    rng = random.Random(1234)
    prompt = [rng.randrange(2, vocab) for _ in range(args.prompt)]
    forced = [rng.randrange(2, vocab) for _ in range(args.decode)]
    try:
        with Engine(argv, env=spec.env, ready_timeout=1800) as eng:
            with LoadWindow(group=cpu) as window:
                result = eng.generate(prompt, max_tokens=args.decode, forced=forced)
    finally:
        if ec is not None:
            ec.stop()
        for g in groups:
            g.close()
    d = result.stats["decode"]
    steps = max(1, d["steps"])
    moe = len(layers)
    row = {"workers": workers, "partition": partition if workers else "-", "decode_tps": d.get("decode_tps")
           or result.stats["decode_tps"], "disk_bytes_per_token": d["bytes_read"] / steps,
           "held_per_worker": per_worker if workers else 0, "experts": total, "moe_layers": moe,
           "hit_rate": d.get("hit_rate"), "load_average": window.load_average,
           "other_cpu_share": window.other_cpu_share}
    if workers:
        net = d["remote_bytes_sent"] + d["remote_bytes_received"]
        row.update({"net_bytes_per_token": net / steps, "net_bytes_per_layer": net / steps / moe,
                    "sent_per_layer": d["remote_bytes_sent"] / steps / moe,
                    "received_per_layer": d["remote_bytes_received"] / steps / moe,
                    "messages_per_layer": d["remote_messages"] / steps / moe,
                    "round_trips_per_layer": d["remote_layer_round_trips"] / steps / moe,
                    "fallbacks": d["remote_fallback_experts"]})
    return row


def median_rows(runs: list[dict], contended: float) -> list[dict]:
    """One row per (partition, workers): the run with the median decode speed among the uncontended ones (all of
    them, flagged ``contended``, when none was quiet), with how many runs there were and how many were quiet."""
    rows = []
    for key in dict.fromkeys((r["partition"], r["workers"]) for r in runs):
        mine = [r for r in runs if (r["partition"], r["workers"]) == key]
        quiet = [r for r in mine if r["other_cpu_share"] < contended]
        pool = sorted(quiet or mine, key=lambda r: r["decode_tps"])
        rows.append({**pool[(len(pool) - 1) // 2], "runs": len(mine), "quiet_runs": len(quiet),
                     "contended": not quiet, "decode_tps_all": [r["decode_tps"] for r in mine]})
    return rows


def table(rows: list[dict]) -> str:
    head = ("| workers | partition | decode tok/s (median) | disk bytes/token | net bytes/token | net bytes/layer "
            "| messages/layer | round trips/layer | quiet runs | load avg | other CPU |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        flag = " (contended)" if r.get("contended") else ""
        lines.append(f"| {r['workers']} | {r['partition']} | {r['decode_tps']:.2f}{flag} | "
                     f"{r['disk_bytes_per_token'] / 1e6:.2f} MB | {r.get('net_bytes_per_token', 0) / 1e3:.1f} kB | "
                     f"{r.get('net_bytes_per_layer', 0) / 1e3:.1f} kB | {r.get('messages_per_layer', 0):.2f} | "
                     f"{r.get('round_trips_per_layer', 0):.2f} | {r.get('quiet_runs', 1)}/{r.get('runs', 1)} | "
                     f"{r['load_average']:.2f} | {r['other_cpu_share']:.0%} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny model, few tokens, no cgroups (a smoke run)")
    ap.add_argument("--partition", default="expert,layer", help="partitions to run: expert, layer or both")
    ap.add_argument("--workers", default="0,1,2,3", help="worker counts to run (0 = the single machine)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=None, help="runs of every configuration (default 3; 1 if --quick)")
    ap.add_argument("--contended", type=float, default=0.10,
                    help="a run where other processes took this share of the CPU or more is contended")
    args = ap.parse_args()
    args.prompt, args.decode, args.cap = (16, 8, 1) if args.quick else (64, 32, 4)
    rounds = args.rounds or (1 if args.quick else 3)
    partitions = [p for p in args.partition.split(",") if p]
    if not partitions or set(partitions) - {"layer", "expert"}:
        raise SystemExit(f"--partition {args.partition}: expected expert, layer or expert,layer")
    from colibri import inventory
    from colibri.cluster import experts
    from colibri.model import resolve_model

    cpu = OwnCpuGroup.create()   # before Ray starts, so its daemons and actors are ours too
    work = Path(tempfile.mkdtemp(prefix="cluster-bench-"))
    model = checkpoint(args.quick, work)
    facts = inventory.load_facts(resolve_model(str(model), None))
    layers = experts.moe_layers(facts)
    ex = facts.layout.experts[0]
    expert_bytes = sum(facts.tensors[name].end - facts.tensors[name].begin for name in ex.tensors)
    counts = [int(w) for w in args.workers.split(",")]
    configs = [("-", 0)] * (0 in counts) + [(p, n) for p in partitions for n in counts if n]
    cluster = start_ray(max(counts))
    runs = []
    try:
        for r in range(rounds):
            shift = r % len(configs)
            for partition, n in configs[shift:] + configs[:shift]:
                log(f"round {r + 1}/{rounds}: {n} worker(s), by {partition}")
                row = run(model, n, partition, args, layers, expert_bytes, f"{partition}{n}r{r}", cpu)
                runs.append({**row, "round": r})
                log(json.dumps(runs[-1]))
    finally:
        import ray

        ray.shutdown()
        cluster.shutdown()
    rows = median_rows(runs, args.contended)
    RESULTS.mkdir(exist_ok=True)
    out = {"quick": args.quick, "model": str(model), "expert_bytes": expert_bytes, "rounds": rounds,
           "contended_share": args.contended, "rows": rows, "runs": runs}
    (RESULTS / "cluster_bench.json").write_text(json.dumps(out, indent=1))
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
