"""Expert-parallel mode: routed experts held in the RAM of several machines, started and watched by Ray.

One expert worker per node (pinned by that node's ``colibri_experts_<name>`` custom resource) is a Ray actor that
runs the engine binary in worker mode (``--expert-worker``, runtime/expert_worker.h) and holds its share of the
experts in RAM. The head engine gets an expert map (``--expert-map``: each worker's address and share) and sends
each MoE layer's rows to the workers holding the selected experts over the engine's own TCP framing
(docs/protocol.md, "Expert workers"); Ray is the control plane only, never on the per-token path.

When a worker's engine dies the actor exits, Ray restarts the actor on the same node, and the new actor starts
the worker again on the same port (kept in Ray's key-value store); the head reconnects and sends the share again.
Meanwhile the head streams that worker's experts from disk: slower, never different tokens.

The share: ``partition_experts`` splits every MoE layer's experts by layer or by expert, balanced by the routing
counts of the hot-set sidecar (``<model>/.colibri-hotset``) when there is one, else by expert count.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ColibriError, UsageError

NAMESPACE = "colibri"
RESOURCE_PREFIX = "colibri_experts_"
ACTOR_PREFIX = "colibri-expert-worker-"
PARTITIONS = ("layer", "expert")
START_TIMEOUT_S = 600.0   # a worker builds its engine on first use on a fresh node


class ClusterError(ColibriError):
    """The Ray cluster cannot run the expert workers asked for."""


# ---- the share ----

def read_hotset_counts(path: Path) -> dict[int, list[int]]:
    """The routing counts per MoE layer a hot-set sidecar kept (runtime/expert_hotset.c writes it); {} when the
    file is missing or not a sidecar (the engine ignores such a file too)."""
    try:
        words = path.read_text().split()
    except (OSError, UnicodeDecodeError):
        return {}
    if len(words) < 4 or words[0] != "colibri-hotset" or words[2] != "key":
        return {}
    counts: dict[int, list[int]] = {}
    i = 4
    try:
        while i + 3 < len(words) and words[i] == "layer" and words[i + 2] == "experts":
            layer, n = int(words[i + 1]), int(words[i + 3])
            if n < 1 or n > 65536:
                return {}
            counts[layer] = [int(w) for w in words[i + 4:i + 4 + n]]
            if len(counts[layer]) != n:
                return {}
            i += 4 + n
    except ValueError:
        return {}
    return counts


def partition_experts(layers: dict[int, int], n_workers: int, mode: str,
                      counts: dict[int, list[int]] | None = None,
                      max_per_worker: int | None = None) -> list[dict[int, list[int]]]:
    """Split the routed experts (``layers``: MoE layer -> expert count) among ``n_workers``.

    ``layer``: whole layers, each to the worker with the least routing load so far (a layer's load is its routing
    count, or its expert count without a sidecar), heaviest layers first. ``expert``: every layer split across
    all workers, its experts hottest first to the worker holding the least of that layer's load (round robin by
    index when there are no counts), so each layer's traffic spreads over every worker. Deterministic: ties go to
    the lower worker and the lower index. ``max_per_worker`` (a worker's RAM in experts): each worker keeps only
    that many of its share, the hottest (lowest index among equals); what nobody keeps streams from disk.
    """
    if mode not in PARTITIONS:
        raise UsageError(f"--partition {mode}: not a partitioning", "use layer or expert")
    if n_workers < 1:
        raise UsageError("--expert-workers must be at least 1")
    counts = counts or {}
    shares: list[dict[int, list[int]]] = [{} for _ in range(n_workers)]

    def weights(layer: int) -> list[int]:
        c = counts.get(layer)
        return c if c is not None and len(c) == layers[layer] and sum(c) > 0 else [1] * layers[layer]

    if mode == "layer":
        load = [0] * n_workers
        # A layer's load is its share of the routing (every token routes top_k rows through every layer), so
        # without counts each layer weighs its expert count (bytes held); with them, how often its experts are hit
        # relative to the layer's own traffic is the same for every layer and the count balance decides.
        order = sorted(layers, key=lambda lay: (-layers[lay], lay))
        for layer in order:
            w = min(range(n_workers), key=lambda i: (load[i], i))
            shares[w][layer] = list(range(layers[layer]))
            load[w] += layers[layer]
        return _trim(shares, max_per_worker, weights)
    for layer in sorted(layers):
        wts = weights(layer)
        load = [0] * n_workers
        held = [0] * n_workers
        for e in sorted(range(layers[layer]), key=lambda x: (-wts[x], x)):
            w = min(range(n_workers), key=lambda i: (load[i], held[i], i))
            shares[w].setdefault(layer, []).append(e)
            load[w] += wts[e]
            held[w] += 1
    return _trim(shares, max_per_worker, weights)


def _trim(shares: list[dict[int, list[int]]], limit: int | None, weights: Any) -> list[dict[int, list[int]]]:
    out = []
    for share in shares:
        pairs = [(layer, e) for layer in sorted(share) for e in share[layer]]
        if limit is not None and len(pairs) > limit:
            pairs = sorted(pairs, key=lambda p: (-weights(p[0])[p[1]], p))[:max(limit, 0)]
        kept: dict[int, list[int]] = {}
        for layer, e in sorted(pairs):
            kept.setdefault(layer, []).append(e)
        out.append(kept)
    return out


def ranges(experts: list[int]) -> str:
    """0,1,2,5 -> "0-2,5" (the map's expert list)."""
    out: list[str] = []
    i = 0
    while i < len(experts):
        j = i
        while j + 1 < len(experts) and experts[j + 1] == experts[j] + 1:
            j += 1
        out.append(str(experts[i]) if i == j else f"{experts[i]}-{experts[j]}")
        i = j + 1
    return ",".join(out)


def write_expert_map(path: Path, addresses: list[str], shares: list[dict[int, list[int]]]) -> Path:
    """The head engine's ``--expert-map`` file, written atomically."""
    lines = ["colibri-expert-map 1"]
    for address, share in zip(addresses, shares):
        lines.append(f"worker {address}")
        lines += [f"layer {layer} experts {ranges(share[layer])}" for layer in sorted(share) if share[layer]]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("\n".join(lines) + "\n")
    os.replace(tmp, path)
    return path


def moe_layers(facts: Any) -> dict[int, int]:
    """MoE layer -> routed expert count, from the family's tensor layout (``inventory.load_facts``; headers only)."""
    layers: dict[int, int] = {}
    for ex in facts.layout.experts if facts.layout is not None else ():
        layers[ex.layer] = max(layers.get(ex.layer, 0), ex.expert + 1)
    if not layers:
        raise UsageError(f"{facts.model.path.name} has no routed experts", "expert-parallel mode is for MoE models")
    return layers


# ---- the Ray side ----

def _ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise ClusterError("expert-parallel mode needs Ray", 'pip install "colibri-core[cluster]"') from exc
    return ray


class ExpertWorker:
    """A Ray actor (wrapped by ``_actor_class``): one engine in worker mode on this node, and a watcher that ends
    the actor when the engine dies, so Ray restarts both."""

    def __init__(self, engine: str, model_dir: str, index: int, run_id: str, threads: int = 0,
                 argv_prefix: list[str] | None = None):
        ray = _ray()
        from ray.experimental import internal_kv

        self.index = index
        self.node_ip = ray.util.get_node_ip_address()
        ctx = ray.get_runtime_context()
        self.node_id = ctx.get_node_id()
        self.restarted = bool(ctx.was_current_actor_reconstructed)
        key = f"colibri:expert-port:{run_id}:{index}".encode()
        port = internal_kv._internal_kv_get(key)
        argv = [*(argv_prefix or []), engine, "--expert-worker", "--model", model_dir,
                "--listen", f"{self.node_ip}:{int(port) if port else 0}", "--threads", str(threads)]
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        first = self.proc.stdout.readline()
        try:
            ev = json.loads(first)
        except ValueError:
            ev = {"ev": "fatal", "message": first.strip() or "the expert worker exited"}
        if ev.get("ev") != "listening":
            raise RuntimeError(f"expert worker {index} did not start: {ev.get('message')}")
        self.port = int(ev["port"])
        self.pid = int(ev["pid"])
        internal_kv._internal_kv_put(key, str(self.port).encode(), overwrite=True)
        self.loaded: dict[str, int] = {"experts": 0, "bytes": 0}
        threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            if ev.get("ev") == "loaded":
                self.loaded = {"experts": int(ev["experts"]), "bytes": int(ev["bytes"])}
        self.proc.wait()
        os._exit(1)   # the engine is gone: end the actor so Ray restarts it (and with it the engine)

    def info(self) -> dict[str, Any]:
        return {"index": self.index, "node_ip": self.node_ip, "node_id": self.node_id, "address": self.address(),
                "pid": self.pid, "restarted": self.restarted, "rss_bytes": _rss(self.pid), **self.loaded}

    def address(self) -> str:
        return f"{self.node_ip}:{self.port}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()


def _rss(pid: int) -> int:
    try:
        pages = int(Path(f"/proc/{pid}/statm").read_text().split()[1])
    except (OSError, ValueError, IndexError):
        return 0
    return pages * os.sysconf("SC_PAGE_SIZE")


_ACTOR = None


def _actor_class() -> Any:
    global _ACTOR
    if _ACTOR is None:
        # max_restarts=-1: Ray restarts a lost worker for as long as its node is there.
        _ACTOR = _ray().remote(num_cpus=0, max_restarts=-1, max_task_retries=0)(ExpertWorker)
    return _ACTOR


def node_tags(ray: Any) -> list[str]:
    """The custom resources that mark nodes able to hold experts, one per node, sorted."""
    tags = [name for name in ray.cluster_resources() if name.startswith(RESOURCE_PREFIX)]
    return sorted(tags)


@dataclass
class ExpertCluster:
    """The expert workers of one head engine: their actors, shares and the map file the head reads."""

    shares: list[dict[int, list[int]]]
    actors: list[Any]
    tags: list[str]
    map_path: Path
    run_id: str
    addresses: list[str] = field(default_factory=list)

    def engine_args(self) -> list[str]:
        return ["--expert-map", str(self.map_path)]

    def infos(self, timeout: float = 10.0) -> list[dict[str, Any] | None]:
        ray = _ray()
        out: list[dict[str, Any] | None] = []
        for actor in self.actors:
            try:
                out.append(ray.get(actor.info.remote(), timeout=timeout))
            except Exception:   # a dead or restarting actor: reported as not alive
                out.append(None)
        return out

    def stop(self) -> None:
        ray = _ray()
        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:
                pass
        self.actors = []


def start_expert_cluster(engine: Path, model_dir: Path, n_workers: int, partition: str, *,
                         layers: dict[int, int], address: str | None = None, threads: int = 0,
                         hotset: Path | None = None, argv_prefix: list[str] | None = None,
                         workdir: Path | None = None, max_per_worker: int | None = None) -> ExpertCluster:
    """Start ``n_workers`` expert workers, one per node carrying a ``colibri_experts_<name>`` resource, give each
    its share and write the head's expert map. ``address``: the Ray cluster (None: the one this process is
    connected to, else ``ray.init``'s default). ``max_per_worker``: the experts one worker's RAM holds (None: its
    whole share); ``argv_prefix``: what the worker's command runs under (a memory cgroup shim, in the benchmark)."""
    if partition not in PARTITIONS:
        raise UsageError(f"--partition {partition}: not a partitioning", "use layer or expert")
    ray = _ray()
    if not ray.is_initialized():
        ray.init(address=address, namespace=NAMESPACE, include_dashboard=False, log_to_driver=False)
    tags = node_tags(ray)
    if len(tags) < n_workers:
        raise ClusterError(f"--expert-workers {n_workers}: the Ray cluster has {len(tags)} node(s) offering a "
                           f"{RESOURCE_PREFIX}<name> resource",
                           f"start each expert node with --resources '{{\"{RESOURCE_PREFIX}<name>\": 1}}'")
    counts = read_hotset_counts(hotset or model_dir / ".colibri-hotset")
    shares = partition_experts(layers, n_workers, partition, counts, max_per_worker)
    run_id = uuid.uuid4().hex[:12]
    from ray.experimental import internal_kv

    for i, share in enumerate(shares):   # for expert_shard_rows (coli cluster status), in another process
        internal_kv._internal_kv_put(f"colibri:expert-share:{ACTOR_PREFIX}{run_id}-{i}".encode(),
                                     json.dumps({str(k): ranges(v) for k, v in share.items()}).encode(),
                                     overwrite=True)
    actor = _actor_class()
    actors = [actor.options(name=f"{ACTOR_PREFIX}{run_id}-{i}", namespace=NAMESPACE, resources={tags[i]: 1})
              .remote(str(engine), str(model_dir), i, run_id, threads, argv_prefix) for i in range(n_workers)]
    try:
        addresses = ray.get([a.address.remote() for a in actors], timeout=START_TIMEOUT_S)
    except Exception as exc:
        for a in actors:
            ray.kill(a, no_restart=True)
        raise ClusterError(f"the expert workers did not start: {exc}".splitlines()[0],
                           "check that the engine and the model are at the same path on every expert node") from exc
    folder = workdir or Path(tempfile.mkdtemp(prefix="colibri-experts-"))
    path = write_expert_map(folder / f"expert-map-{run_id}.txt", addresses, shares)
    return ExpertCluster(shares, actors, tags[:n_workers], path, run_id, addresses)


def expert_shard_rows(timeout: float = 10.0) -> list[dict[str, Any]]:
    """One row per expert worker of the connected Ray cluster (``coli cluster status``): ``worker`` (actor name),
    ``node`` (IP), ``address`` (host:port of its data path), ``layers`` (MoE layer -> expert ranges of its share,
    e.g. {3: "0-31,40"}), ``experts`` and ``bytes_held`` (what it has loaded), ``ram_bytes`` (its engine's RSS),
    ``alive`` (answered within ``timeout``), ``restarted`` (Ray restarted it at least once). Needs ``ray.init``
    done by the caller."""
    ray = _ray()
    from ray.experimental import internal_kv

    rows: list[dict[str, Any]] = []
    names = sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                   if a.get("namespace") == NAMESPACE and a["name"].startswith(ACTOR_PREFIX))
    for name in names:
        share = internal_kv._internal_kv_get(f"colibri:expert-share:{name}".encode())
        row: dict[str, Any] = {"worker": name, "node": None, "address": None,
                               "layers": {int(k): v for k, v in json.loads(share).items()} if share else {},
                               "experts": 0, "bytes_held": 0, "ram_bytes": 0, "alive": False, "restarted": False}
        try:
            info = ray.get(ray.get_actor(name, namespace=NAMESPACE).info.remote(), timeout=timeout)
        except Exception:
            rows.append(row)
            continue
        row.update(node=info["node_ip"], address=info["address"], experts=info["experts"], bytes_held=info["bytes"],
                   ram_bytes=info["rss_bytes"], alive=True, restarted=info["restarted"])
        rows.append(row)
    return rows


def wait_for(predicate: Any, timeout: float, every: float = 0.1) -> bool:
    """Poll ``predicate`` until it is true or ``timeout`` seconds pass (bounded waits for restarts)."""
    until = time.monotonic() + timeout
    while time.monotonic() < until:
        if predicate():
            return True
        time.sleep(every)
    return bool(predicate())


def with_expert_workers(spec: Any, n_workers: int | None, partition: str,
                        address: str | None) -> tuple[Any, ExpertCluster | None]:
    """``coli run`` / ``coli serve`` with ``--expert-workers N``: start the workers for the spec's model and give
    the head engine the map (the spec's argv gains ``--expert-map``); (spec, None) unchanged without the flag. The
    caller stops the returned cluster when its engine is done."""
    if not n_workers:
        return spec, None
    import dataclasses

    cluster = start_expert_cluster(Path(spec.argv[0]), spec.facts.model.path, n_workers, partition,
                                   layers=moe_layers(spec.facts), address=address)
    return dataclasses.replace(spec, argv=(*spec.argv, *cluster.engine_args())), cluster
