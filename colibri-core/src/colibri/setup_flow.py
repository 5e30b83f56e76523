"""``coli setup``: from a machine to a served model, with every number read, none assumed.

1. The machine: RAM colibri may use (MemAvailable within the cgroup's limit, ``sysinfo.memory``), cores (the CPU
   affinity mask), free disk and read speed where the models go (a measurement remembered per device).
2. The catalog (``catalog.json``, or ``--catalog`` / ``$COLIBRI_CATALOG``): real repos, each with its family, the
   publisher's parameter count and the container colibri recommends. For each, the repo's config and shard headers
   are read from the hub (a header-only copy, ``coli plan --repo``), the recommended container is projected with
   convert's own plan, and the planner says whether it fits this RAM, what the disk must hold and the disk-bound
   speed.
3. The largest model that fits (or the one asked for) is pulled, converted if its container differs from the
   release, recorded in the configuration file, and served in the background.

Every step is idempotent: a pull resumes or finds the files complete, a conversion resumes or finds its container
done, a server already serving the chosen model is left running.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from . import sysinfo
from .errors import ColibriError, ConfigError, UsageError
from .xdg import config_dir, models_root

CATALOG_ENV = "COLIBRI_CATALOG"
CONFIG_NAME = "setup.json"
GIB = 1024 ** 3
DISK_PROBE_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class CatalogEntry:
    repo: str
    family: str
    parameters: str                 # the publisher's figure, for people; the plan counts from the headers
    experts: str | None             # recommended container; None = serve the release as it ships
    dense: str | None


@dataclass(frozen=True)
class Machine:
    ram_bytes: int
    ram_source: str
    cores: int
    disk_path: str
    disk_free_bytes: int
    disk_bandwidth: float           # bytes/s
    disk_source: str


@dataclass
class Candidate:
    entry: CatalogEntry
    fits: bool = False
    problem: str | None = None
    total_params: int = 0
    active_params: int = 0
    expert_bytes: int = 0           # one routed expert as the container stores it
    min_ram_bytes: int = 0
    cache_slots_per_layer: int = 0
    experts_per_layer: int = 0
    source_bytes: int = 0           # what the pull downloads
    container_bytes: int = 0        # what convert writes (0: served as shipped)
    disk_needed_bytes: int = 0
    tokens_per_s: float = 0.0       # disk-bound, every routed expert a miss
    extra: dict[str, Any] = field(default_factory=dict)


def catalog_path(option: Path | None) -> Path:
    explicit = option or (Path(os.environ[CATALOG_ENV]) if os.environ.get(CATALOG_ENV) else None)
    return explicit or Path(__file__).with_name("catalog.json")


def load_catalog(option: Path | None = None) -> list[CatalogEntry]:
    path = catalog_path(option)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the catalog ({exc.strerror})", "pass --catalog FILE") from None
    except ValueError as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc})", "fix the catalog file") from None
    models = data.get("models") if isinstance(data, dict) else None
    if not isinstance(models, list) or not models:
        raise ConfigError(f"{path}: needs a non-empty 'models' list", "see colibri/catalog.json for the format")
    out = []
    for i, m in enumerate(models):
        if not isinstance(m, dict) or not isinstance(m.get("repo"), str) or not isinstance(m.get("family"), str):
            raise ConfigError(f"{path}: models[{i}] needs 'repo' and 'family' strings", "fix the catalog file")
        container = m.get("container") or {}
        out.append(CatalogEntry(m["repo"], m["family"], str(m.get("parameters", "")), container.get("experts"),
                                container.get("dense") or ("bf16" if container.get("experts") else None)))
    return out


def _existing(path: Path) -> Path:
    path = path.absolute()
    while not path.exists():
        path = path.parent
    return path


def disk_bandwidth(where: Path, given_gbps: float | None) -> tuple[float, str]:
    """The read speed of the disk under ``where``: given, remembered, or measured once on a probe file."""
    if given_gbps is not None:
        if given_gbps <= 0:
            raise UsageError(f"--disk-bw {given_gbps:g}: must be more than 0 GB/s", "pass --disk-bw 2.5, say")
        return given_gbps * 1e9, "--disk-bw"
    probe = where / f".colibri-disk-probe-{os.getpid()}"
    cached = sysinfo.cached_read_bandwidth(where)
    if cached:
        return cached, "measured earlier on this disk"
    try:
        with open(probe, "wb") as fh:
            block = os.urandom(1 << 20)
            for _ in range(DISK_PROBE_BYTES >> 20):
                fh.write(block)
            fh.flush()
            os.fsync(fh.fileno())       # written back, so dropping the page cache really sends the read to disk
        measured = sysinfo.measure_read_bandwidth(probe, max_bytes=DISK_PROBE_BYTES)
    finally:
        probe.unlink(missing_ok=True)
    if measured > 0:
        sysinfo.remember_read_bandwidth(where, measured)
    return measured, f"measured reading {DISK_PROBE_BYTES >> 20} MiB"


def detect(ram_gib: float | None, disk_bw_gbps: float | None) -> Machine:
    where = _existing(models_root())
    if ram_gib is not None:
        if ram_gib <= 0:
            raise UsageError(f"--ram {ram_gib:g}: must be more than 0 GiB", "pass --ram GB, e.g. --ram 16")
        ram, source = int(ram_gib * GIB), "--ram"
    else:
        mem = sysinfo.memory()
        ram, source = mem.available_bytes, mem.source
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    bandwidth, bw_source = disk_bandwidth(where, disk_bw_gbps)
    return Machine(ram, source, cores, str(where), shutil.disk_usage(where).free, bandwidth, bw_source)


def assess(entry: CatalogEntry, machine: Machine, ctx: int | None) -> Candidate:
    """Fit of ``entry``'s recommended container on ``machine``, from the repo's headers (no weights read)."""
    from .cli.inspect import make_plan, plan_request
    from .header_copy import remote_header_copy
    from .inventory import load_facts, take_inventory
    from .model import resolve_model
    from .projection import project

    found = Candidate(entry)
    try:
        copy, repo = remote_header_copy(entry.repo)
        facts = load_facts(resolve_model(copy, entry.family))
        found.source_bytes = repo.total_bytes
        if entry.experts:
            projected = project(facts, entry.experts, entry.dense or "bf16")
            facts, found.container_bytes = projected.facts, projected.container_bytes
        request, _sources = plan_request(facts, machine.ram_bytes / GIB, ctx, 1,
                                         machine.disk_bandwidth / 1e9 if machine.disk_bandwidth > 0 else None)
        plan = make_plan(facts, request)
    except ColibriError as exc:
        found.problem = exc.message
        return found
    inv = take_inventory(facts.geometry, facts.layout, facts.tensors)
    found.total_params, found.active_params = inv.total_params, inv.active_params
    found.expert_bytes, found.min_ram_bytes = plan.expert_bytes, plan.min_ram_bytes
    found.cache_slots_per_layer, found.experts_per_layer = plan.cache_slots_per_layer, plan.experts_per_layer
    found.tokens_per_s = plan.disk_bound_tokens_per_s
    # converting holds the release and the container at once (until the release is deleted)
    found.disk_needed_bytes = found.source_bytes + found.container_bytes
    if not plan.fits:
        found.problem = f"needs {found.min_ram_bytes / GIB:.2f} GiB of RAM, {machine.ram_bytes / GIB:.2f} available"
    elif found.disk_needed_bytes > machine.disk_free_bytes:
        found.problem = (f"needs {found.disk_needed_bytes / GIB:.1f} GiB of disk, "
                         f"{machine.disk_free_bytes / GIB:.1f} free in {machine.disk_path}")
    found.fits = found.problem is None
    return found


def choose(candidates: list[Candidate], wanted: str | None) -> Candidate:
    if wanted is not None:
        for c in candidates:
            if c.entry.repo == wanted:
                if not c.fits:
                    raise UsageError(f"{wanted} does not fit this machine: {c.problem}",
                                     "pick another from the table, or pass --ram/--disk-bw to plan otherwise")
                return c
        raise UsageError(f"--model {wanted}: not in the catalog", "pick a repo from the table, or use --catalog FILE")
    fitting = [c for c in candidates if c.fits]
    if not fitting:
        smallest = min((c for c in candidates if c.min_ram_bytes), key=lambda c: c.min_ram_bytes, default=None)
        hint = (f"the smallest, {smallest.entry.repo}, needs {smallest.min_ram_bytes / GIB:.2f} GiB of RAM"
                if smallest else "see the table for why")
        raise UsageError("no catalog model fits this machine", hint)
    return max(fitting, key=lambda c: (c.total_params, c.tokens_per_s))


def container_dir(entry: CatalogEntry) -> Path:
    return models_root() / f"{entry.repo}-colibri-{entry.experts}-{entry.dense}"


def install(choice: Candidate, pull_reporter: Any, convert_reporter: Any, keep_source: bool) -> Path:
    """Pull the release; convert it when the recommended container differs; return the directory to serve."""
    from . import models_dir
    from .convert.run import convert
    from .model import resolve_model
    from .pull import pull

    entry = choice.entry
    target = container_dir(entry) if entry.experts else models_dir.default_dest(entry.repo, None)
    if entry.experts and (target / "config.json").is_file() and not (target / ".colibri-convert").exists():
        return target            # converted before; the release may be gone already
    source = pull(entry.repo, reporter=pull_reporter).dest
    if not entry.experts:
        return source
    convert(resolve_model(source, entry.family), target, experts=entry.experts, dense=entry.dense or "bf16",
            reporter=convert_reporter)
    if not keep_source:
        shutil.rmtree(source)
    return target


def config_file() -> Path:
    return config_dir() / CONFIG_NAME


def read_config() -> dict[str, Any]:
    try:
        data = json.loads(config_file().read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def write_config(data: dict[str, Any]) -> Path:
    path = config_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True), encoding="utf-8")
    os.replace(tmp, path)
    return path


def machine_json(machine: Machine) -> dict[str, Any]:
    return asdict(machine)


def candidate_json(c: Candidate) -> dict[str, Any]:
    out = asdict(c)
    out.pop("extra", None)
    out["entry"] = asdict(c.entry)
    return out
