"""``coli info``, ``coli plan`` and ``coli doctor``: read-only looks at a checkpoint (headers, never weights)."""

from __future__ import annotations

import math
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import typer

from .. import hooks, sysinfo
from ..console import (
    STATUS_STYLES,
    emit_json,
    human_bytes,
    human_count,
    print_heading,
    print_pairs,
    print_table,
    stdout,
)
from ..doctor import DoctorFailed, diagnose, failures
from ..errors import InsufficientMemoryError, UsageError
from ..inventory import ModelFacts, load_facts, take_inventory
from ..model import resolve_model
from ..records import PlanRequest, ResourcePlan
from ._app import app
from .options import FamilyOption, JsonOption, ModelOption

GIB = 1024**3
GB = 1000**3
DEFAULT_CTX = 4096


def _layers(layers: tuple[int, ...]) -> str:
    """``0-3, 5, 7-9``: layer lists of a 90-layer model stay short."""
    if not layers:
        return "none"
    spans: list[list[int]] = []
    for n in sorted(layers):
        if spans and n == spans[-1][1] + 1:
            spans[-1][1] = n
        else:
            spans.append([n, n])
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in spans)


# ---------------------------------------------------------------------------------------------------- info

def info_data(facts: ModelFacts) -> dict[str, Any]:
    g, model = facts.geometry, facts.model
    inv = take_inventory(g, facts.layout, facts.tensors)
    return {
        "model": str(model.path),
        "family": model.family,
        "model_type": model.model_type,
        "architecture": g.architecture,
        "attention": g.attention,
        "geometry": {
            "layers": g.num_layers, "hidden_size": g.hidden_size, "vocab_size": g.vocab_size,
            "heads": g.num_heads, "kv_heads": g.num_kv_heads, "head_dim": g.head_dim,
            "experts": g.num_experts, "top_k": g.top_k, "expert_intermediate": g.expert_intermediate,
            "shared_experts": g.num_shared_experts, "moe_layers": list(g.moe_layers),
            "dense_layers": list(g.dense_layers), "max_context": g.max_context,
            "kv_bytes_per_token": g.kv_bytes_per_token, "state_bytes_per_slot": g.state_bytes_per_slot,
            "notes": {label: value for label, value in g.notes},
        },
        "parameters": {"total": inv.total_params, "active_per_token": inv.active_params,
                       "routed_experts": inv.routed_params, "skipped": inv.skipped_params,
                       "buffers": inv.buffer_elements},
        "bytes": {"dense": inv.dense_bytes, "routed_experts": inv.expert_bytes, "embeddings": inv.embedding_bytes,
                  "paged_embeddings": inv.paged_bytes, "resident": inv.resident_bytes, "skipped": inv.skipped_bytes,
                  "per_expert": inv.bytes_per_expert,
                  "total": inv.loaded_bytes + inv.skipped_bytes},
        "dtypes": dict(sorted(inv.dtypes.items())),
        "files": len(facts.tensors.headers),
        "container": (None if facts.container is None else
                      {"format": "colibri-quant", "version": facts.container.version,
                       "quant_schemes": list(facts.quant_schemes)}),
        "tensors": len(facts.tensors),
    }


@app.command("info")
def info_command(model: str | None = ModelOption, family: str | None = FamilyOption,
                 as_json: bool = JsonOption) -> None:
    """Family, geometry, parameter counts and bytes on disk of a checkpoint."""
    facts = load_facts(resolve_model(model, family))
    data = info_data(facts)
    if as_json:
        emit_json(data)
        return
    g, p, b = data["geometry"], data["parameters"], data["bytes"]
    print_heading(f"{data['model']}")
    rows = [("family", f"{data['family']} (model_type {data['model_type']})"),
            ("architecture", data["architecture"]), ("attention", data["attention"]),
            ("layers", g["layers"]), ("hidden size", g["hidden_size"]), ("vocab", g["vocab_size"])]
    if g["heads"]:
        rows.append(("heads", f"{g['heads']} query, {g['kv_heads']} kv, head dim {g['head_dim']}"))
    if g["experts"]:
        rows += [("experts", f"{g['experts']} routed, top-{g['top_k']}, intermediate {g['expert_intermediate']}"),
                 ("shared experts", g["shared_experts"]),
                 ("MoE layers", _layers(tuple(g["moe_layers"]))),
                 ("dense layers", _layers(tuple(g["dense_layers"])))]
    if g["max_context"]:
        rows.append(("max context", g["max_context"]))
    rows += list(g["notes"].items())
    rows += [("parameters", f"{human_count(p['total'])} total ({p['total']:,}), "
                            f"{human_count(p['active_per_token'])} active per token ({p['active_per_token']:,})")]
    if p["skipped"]:
        rows.append(("skipped", f"{human_count(p['skipped'])} parameters never loaded ({human_bytes(b['skipped'])})"))
    rows += [("on disk", f"{human_bytes(b['total'])}: dense {human_bytes(b['dense'])}, routed experts "
                         f"{human_bytes(b['routed_experts'])}, embeddings {human_bytes(b['embeddings'])}"),
             ("resident", f"{human_bytes(b['resident'])} held in RAM"
                          + (f" (the input embedding's {human_bytes(b['paged_embeddings'])} is mapped and read by the "
                             "row)" if b["paged_embeddings"] else "")),
             ("dtypes", ", ".join(f"{k} x{v}" for k, v in data["dtypes"].items())),
             ("files", f"{data['files']} shard(s), {data['tensors']} tensors")]
    if data["container"]:
        c = data["container"]
        rows.append(("format", f"colibri-quant container v{c['version']} "
                               f"({', '.join(c['quant_schemes']) or 'no quantized tensors'})"))
    print_pairs(rows)


# ---------------------------------------------------------------------------------------------------- plan

def _largest_shard(facts: ModelFacts) -> Path:
    return max((h for h in facts.tensors.headers), key=lambda h: h.file_size).file


def plan_request(facts: ModelFacts, ram: float | None, ctx: int | None, kv_slots: int,
                 disk_bw: float | None, cap: int = 0, measure_disk: bool = False) -> tuple[PlanRequest, dict[str, str]]:
    """Validate the flags against the family's limits and fill in RAM and bandwidth from the machine."""
    sources: dict[str, str] = {}
    g, limits = facts.geometry, facts.limits
    if ctx is None:
        ctx = min([DEFAULT_CTX] + [v for v in (g.max_context, limits.max_context if limits else 0) if v])
    if ctx < 1:
        raise UsageError(f"--ctx {ctx}: must be at least 1", "pass --ctx N with N >= 1")
    if kv_slots < 1:
        raise UsageError(f"--kv-slots {kv_slots}: must be at least 1", "pass --kv-slots N with N >= 1")
    if limits is not None:
        bound = limits.max_context or g.max_context      # 0: the model's own context bounds the engine's
        if bound and ctx > bound:
            raise UsageError(f"--ctx {ctx} exceeds the {facts.model.family} engine's limit of "
                             f"{bound} tokens", f"pass --ctx {bound} or less")
        if limits.max_kv_slots and kv_slots > limits.max_kv_slots:
            raise UsageError(f"--kv-slots {kv_slots} exceeds the {facts.model.family} engine's limit of "
                             f"{limits.max_kv_slots}", f"pass --kv-slots {limits.max_kv_slots} or less")
    if cap < 0:
        raise UsageError(f"--cap {cap}: must be 0 (from the budget) or more", "pass --cap N with N >= 0")
    if ram is not None:
        if ram <= 0:
            raise UsageError(f"--ram {ram:g}: must be more than 0 GiB", "pass --ram GB, e.g. --ram 16")
        ram_bytes = int(ram * GIB)
        sources["ram"] = "--ram"
    else:
        mem = sysinfo.memory()
        ram_bytes = mem.available_bytes
        sources["ram"] = mem.source
    bandwidth, sources["disk_bandwidth"] = disk_bandwidth(facts, disk_bw, measure_disk)
    return PlanRequest(ram_bytes=ram_bytes, ctx=ctx, kv_slots=kv_slots, disk_bandwidth=bandwidth, cap=cap), sources


def disk_bandwidth(facts: ModelFacts, disk_bw: float | None, measure_disk: bool = False) -> tuple[float, str]:
    """The read bandwidth (bytes/s, 0 = unknown) of the disk holding the model, and where the figure came from:
    ``--disk-bw`` (GB/s), a measurement now (``measure_disk``), or one taken earlier on the same disk."""
    if disk_bw is not None:
        if disk_bw <= 0:
            raise UsageError(f"--disk-bw {disk_bw:g}: must be more than 0 GB/s", "pass --disk-bw 2.5, say")
        return disk_bw * GB, "--disk-bw"
    shard = _largest_shard(facts)
    if measure_disk:
        # Reading a shard is the one way to know the disk, and the only weight bytes plan ever reads: opt-in.
        bandwidth = sysinfo.measure_read_bandwidth(shard)
        if bandwidth > 0:
            sysinfo.remember_read_bandwidth(shard, bandwidth)
        return bandwidth, f"measured reading {shard.name}"
    cached = sysinfo.cached_read_bandwidth(shard)
    return (cached or 0.0, "measured earlier on this disk (--measure-disk)" if cached else
            "unknown: pass --disk-bw GB/s or --measure-disk")


def make_plan(facts: ModelFacts, request: PlanRequest) -> ResourcePlan:
    """The claiming family's plan_resources answer (core's planner unless the family overrides it)."""
    return hooks.plan_resources(facts.model, request, facts.geometry, facts.layout, facts.tensors)


def _gib_up(n: int) -> str:
    """GiB rounded up to 2 decimals, so the suggested --ram really fits."""
    return f"{math.ceil(n / GIB * 100) / 100:.2f}"


def not_fitting_error(plan: ResourcePlan) -> InsufficientMemoryError:
    if plan.stages:
        name, size = max(plan.stages, key=lambda stage: stage[1])
        return InsufficientMemoryError(
            f"{human_bytes(plan.ram_bytes)} of RAM cannot hold the largest stage ({name}: {human_bytes(size)}); "
            "the stages run one at a time", f"needs at least {human_bytes(plan.min_ram_bytes)}: pass --ram "
                                            f"{_gib_up(plan.min_ram_bytes)} or more")
    return InsufficientMemoryError(
        f"{human_bytes(plan.ram_bytes)} of RAM cannot hold one expert slot per MoE layer: dense "
        f"{human_bytes(plan.dense_bytes)} + KV {human_bytes(plan.kv_bytes)} + state {human_bytes(plan.state_bytes)}"
        f" + reserve {human_bytes(plan.reserve_bytes)} + {plan.moe_layers} x {human_bytes(plan.expert_bytes)} "
        f"expert slots",
        f"needs at least {human_bytes(plan.min_ram_bytes)}: pass --ram {_gib_up(plan.min_ram_bytes)} or more, "
        "or lower --ctx / --kv-slots")


@app.command("plan")
def plan_command(
    model: str | None = ModelOption,
    family: str | None = FamilyOption,
    repo: str | None = typer.Option(None, "--repo", metavar="REPO[@REV]",
                                    help="Plan a hub repo before downloading it: reads only its JSON files and "
                                         "each shard's header (HTTP Range reads)."),
    experts: str | None = typer.Option(None, "--experts", metavar="int4|int8",
                                       help="Plan the container `coli convert --experts` would write (without "
                                            "converting anything)."),
    dense: str | None = typer.Option(None, "--dense", metavar="int8|bf16|f32",
                                     help="With --experts: how that container stores dense matrices "
                                          "[default: bf16]."),
    ram: float | None = typer.Option(None, "--ram", metavar="GB",
                                        help="RAM budget in GiB. Default: available RAM within cgroup limits."),
    ctx: int | None = typer.Option(None, "--ctx", metavar="N", help="Context tokens per slot (default 4096 "
                                      "or the model's maximum, if smaller)."),
    kv_slots: int = typer.Option(1, "--kv-slots", metavar="N", help="Concurrent sequences (KV slots)."),
    disk_bw: float | None = typer.Option(None, "--disk-bw", metavar="GB/s",
                                            help="Disk read bandwidth in GB/s. Default: the last --measure-disk "
                                                 "result for this disk, else unknown."),
    measure_disk: bool = typer.Option(False, "--measure-disk",
                                      help="Measure the disk by reading up to 256 MB of the largest shard (the "
                                           "only weight bytes plan ever reads) and remember the result."),
    as_json: bool = JsonOption,
) -> None:
    """Place the model in RAM: dense, KV, reserve and expert cache slots per layer, and the disk-bound speed."""
    facts, projected = planned_facts(model, family, repo, experts, dense)
    request, sources = plan_request(facts, ram, ctx, kv_slots, disk_bw, measure_disk=measure_disk and not repo)
    plan = make_plan(facts, request)
    if ctx is None and not plan.stages:
        plan = replace(plan, notes=(*plan.notes, *_chosen_ctx_notes(facts, request)))
    container = None if projected is None else {
        "experts": projected.experts, "dense": projected.dense, "shards": projected.shards,
        "container_bytes": projected.container_bytes, "source_bytes": projected.source_bytes}
    if as_json:
        emit_json({"model": str(facts.model.path), "family": facts.model.family, "ctx": request.ctx,
                   "kv_slots": request.kv_slots, "sources": sources, "repo": repo,
                   "projected_container": container, **asdict(plan)})
    else:
        _print_plan(facts, request, plan, sources)
        if container:
            stdout().print(f"projected container: experts {container['experts']}, dense {container['dense']}: "
                           f"{human_bytes(container['container_bytes'])} on disk in {container['shards']} shards "
                           f"(source tensors {human_bytes(container['source_bytes'])}); nothing was converted")
    if not plan.fits:
        raise not_fitting_error(plan)


def _chosen_ctx_notes(facts: ModelFacts, request: PlanRequest) -> tuple[str, ...]:
    """What chat/serve would do with this default context (ctx_choice.py), when they would trade it for slots."""
    from ..ctx_choice import choose_ctx

    choice = choose_ctx(request.ctx, lambda c: make_plan(facts, replace(request, ctx=c)))
    if not choice.notice:
        return ()
    return (f"coli chat/serve without --ctx: {choice.notice} (coli run sizes it from its prompt + --max-tokens)",)


def planned_facts(model: str | None, family: str | None, repo: str | None, experts: str | None,
                  dense: str | None):
    """The facts ``coli plan`` plans: of a local model or a hub repo's header-only copy, as shipped or as the
    container ``--experts/--dense`` would make of it (``(facts, Projection or None)``)."""
    if repo is not None:
        if model is not None:
            raise UsageError("--model and --repo both given", "plan one: a local model or a hub repo")
        from ..header_copy import header_only_copy

        model = str(header_only_copy(repo))
    facts = load_facts(resolve_model(model, family))
    if experts is None and dense is None:
        return facts, None
    if experts is None:
        raise UsageError("--dense without --experts", "give the container's expert scheme too: --experts int4|int8")
    from ..projection import project

    projected = project(facts, experts, dense or "bf16")
    return projected.facts, projected


def _print_plan(facts: ModelFacts, request: PlanRequest, plan: ResourcePlan, sources: dict[str, str]) -> None:
    g = facts.geometry
    print_heading(f"{facts.model.path} ({facts.model.family}, {facts.model.model_type})")
    rows = [("RAM budget", f"{human_bytes(plan.ram_bytes)} ({sources['ram']})")]
    if plan.stages:   # a pipeline: its stages run one at a time, so the largest one is the peak
        rows += [(f"stage {name}", f"{human_bytes(size)} (weights + runtime reserve)") for name, size in plan.stages]
        rows.append(("peak (largest stage)", human_bytes(max(size for _, size in plan.stages))))
    else:
        rows += [("dense weights", f"{human_bytes(plan.dense_bytes)} resident"),
                 ("KV cache", f"{human_bytes(plan.kv_bytes)} = {g.kv_bytes_per_token} B/token x {request.ctx} ctx x "
                              f"{request.kv_slots} slot(s)")]
    if plan.state_bytes:
        rows.append(("recurrent state", f"{human_bytes(plan.state_bytes)} = {g.state_bytes_per_slot} B x "
                                        f"{request.kv_slots} slot(s)"))
    if not plan.stages:
        rows.append(("reserve", f"{human_bytes(plan.reserve_bytes)} (one prefill pass's scratch + 64 MiB runtime)"))
    if plan.moe_layers:
        rows += [("expert cache", f"{plan.cache_slots_per_layer} of {plan.experts_per_layer} slots/layer x "
                                  f"{plan.moe_layers} MoE layers x {human_bytes(plan.expert_bytes)} = "
                                  f"{human_bytes(plan.cache_bytes)}"),
                 ("cold read/token", f"{human_bytes(plan.routed_bytes_per_token)} (top-{g.top_k} experts x "
                                     f"{plan.moe_layers} layers)")]
    if plan.disk_bandwidth:
        rows.append(("disk bandwidth", f"{plan.disk_bandwidth / GB:.2f} GB/s ({sources['disk_bandwidth']})"))
    else:
        rows.append(("disk bandwidth", sources["disk_bandwidth"]))
    if plan.disk_bound_tokens_per_s:
        rows.append(("disk-bound speed", f"{plan.disk_bound_tokens_per_s:.2f} tok/s when every routed expert "
                                         "misses the cache"))
    rows.append(("minimum RAM", human_bytes(plan.min_ram_bytes)))
    rows.append(("fits", "yes" if plan.fits else "no"))
    print_pairs(rows)
    for note in plan.notes:
        stdout().print(f"note: {note}")


# -------------------------------------------------------------------------------------------------- doctor

@app.command("doctor")
def doctor_command(
    model: str | None = ModelOption,
    family: str | None = FamilyOption,
    deep: bool = typer.Option(False, "--deep", help="Also check every tensor's dtype, size, offsets, overlaps, "
                                                    "the roles and shapes the family needs (headers only), and "
                                                    "that the tokenizer loads and the chat template renders."),
    as_json: bool = JsonOption,
) -> None:
    """Check a checkpoint: config, family, tokenizer, chat template, shards, disk, engine (and --deep tensors)."""
    checks = diagnose(model, family, deep)
    bad = failures(checks)
    if as_json:
        emit_json({"ok": not bad, "checks": [c.to_json() for c in checks]})
    else:
        print_table(["status", "check", "detail"], [(c.status, c.name, c.detail) for c in checks],
                    styles={0: STATUS_STYLES})
    if bad:
        raise DoctorFailed(bad, deep)
