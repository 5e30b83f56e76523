"""From a resolved model and the user's flags to a running engine: limits, RAM plan, binary, arguments.

Every flag a family's limits reject (context past its maximum, too many slots, no engine) is refused here with the
flag named, never passed on or silently clamped.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping

from . import builder, hooks
from .engine import DEFAULT_READY_TIMEOUT, Engine
from .errors import EngineError, InsufficientMemoryError, UsageError
from .inventory import ModelFacts, load_facts
from .kv_store import DEFAULT_BUDGET_BYTES as DEFAULT_KV_BUDGET
from .ctx_choice import choose_ctx
from .planner import PREFILL_ROWS, streaming_chunk, streaming_split
from .records import EngineEnv, Limits, PlanRequest, ResolvedModel, ResourcePlan
from .validation import require_sound_tensors

GIB = 1024 ** 3
DEFAULT_CTX = 4096


IO_MODES = ("auto", "direct", "buffered")


@dataclass(frozen=True)
class Streaming:
    """How experts are streamed: the machinery switches (speed only, never tokens) and the opt-in lossy knobs.

    ``None`` for prefetch/pin means auto: on when the cache cannot hold every expert (the model does not fit),
    off otherwise (with everything resident there is nothing to read ahead or protect); ``None`` for preload is
    the reverse (a cache that holds every expert is filled at start). The eviction policy follows pin: auto duels
    the learned hot set against LRU (``--pin duel``: each layer evicts by whichever scored better recently),
    ``True`` is the hot set alone, ``False`` LRU alone."""

    prefetch: bool | None = None
    pin: bool | None = None
    lookahead: bool | None = None    # None: as coli tune measured (off without a profile)
    preload: bool | None = None
    io: str = "auto"
    experts_k: int | None = None
    experts_top_p: float | None = None
    moe_union: bool = True

    def lossy_label(self) -> str:
        """"experts-k=4 experts-top-p=0.9" or "" (the label every stats line and API response carries)."""
        parts = []
        if self.experts_k:
            parts.append(f"experts-k={self.experts_k}")
        if self.experts_top_p is not None and self.experts_top_p < 1:
            parts.append(f"experts-top-p={self.experts_top_p:g}")
        return " ".join(parts)

    def check(self) -> None:
        if self.io not in IO_MODES:
            raise UsageError(f"--io {self.io}: not a read mode", "pass --io auto, direct or buffered")
        if self.experts_k is not None and self.experts_k < 1:
            raise UsageError(f"--experts-k {self.experts_k}: must be at least 1", "for example --experts-k 4")
        if self.experts_top_p is not None and not 0 < self.experts_top_p <= 1:
            raise UsageError(f"--experts-top-p {self.experts_top_p:g}: must be in (0, 1]",
                             "for example --experts-top-p 0.9")

    def engine_args(self, partial_cache: bool) -> tuple[str, ...]:
        def switch(value: bool | None) -> str:
            return "on" if (partial_cache if value is None else value) else "off"

        pin = ("duel" if partial_cache else "off") if self.pin is None else switch(self.pin)
        args = ["--prefetch", switch(self.prefetch), "--pin", pin, "--io", self.io]
        if self.lookahead:
            args += ["--lookahead", "on"]
        if (not partial_cache) if self.preload is None else self.preload:   # auto: when every expert fits
            args += ["--preload", "on"]
        if not self.moe_union:
            args += ["--moe-union", "off"]
        if self.experts_k:
            args += ["--experts-k", str(self.experts_k)]
        if self.experts_top_p is not None and self.experts_top_p < 1:
            args += ["--experts-top-p", repr(float(self.experts_top_p))]
        return tuple(args)


@dataclass(frozen=True)
class LaunchSpec:
    """Everything needed to start (and to describe) one engine for one model."""

    facts: ModelFacts
    plan: ResourcePlan
    ctx: int
    slots: int
    threads: int
    argv: tuple[str, ...]
    env: Mapping[str, str]
    streaming: Streaming = Streaming()
    tune: Any = None                  # the coli tune profile used (colibri.tune.TuneProfile), None: untuned

    @property
    def cap(self) -> int:
        return self.plan.cache_slots_per_layer


def ram_bytes(ram_gib: float | None) -> int:
    """``--ram`` in GiB, or what the machine has available (cgroup limits included) when not given."""
    if ram_gib is not None:
        if ram_gib <= 0:
            raise UsageError(f"--ram {ram_gib:g}: must be a positive number of GiB", "for example --ram 8")
        return int(ram_gib * GIB)
    from .sysinfo import memory

    return memory().available_bytes


def default_threads() -> int:
    """Physical cores among the CPUs this process may run on: SMT siblings share one core's FPUs, and
    oversubscribing them measured 2.3x slower (docs/lessons)."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        return max(1, os.cpu_count() or 1)
    cores = set()
    for cpu in cpus:
        topo = f"/sys/devices/system/cpu/cpu{cpu}/topology"
        try:
            with open(f"{topo}/physical_package_id") as pkg, open(f"{topo}/core_id") as core:
                cores.add((pkg.read().strip(), core.read().strip()))
        except OSError:
            cores.add(("cpu", str(cpu)))      # no topology exposed (some containers): count the CPU itself
    return max(1, len(cores))


def check_limits(model: ResolvedModel, limits: Limits | None, ctx: int, slots: int, model_context: int = 0) -> None:
    """Refuse flags past the family's limits; ``model_context`` (the geometry's) bounds ``--ctx`` when the limits
    leave ``max_context`` at 0."""
    if limits is None:
        raise EngineError(f"family {model.family} states no limits for {model.path}",
                          f"the {model.family} plugin must implement the limits hook")
    if not limits.has_engine:
        reason = limits.reason_no_engine or "the family has no engine yet"
        raise EngineError(f"{model.family} cannot run {model.path}: {reason}", "coli families shows what runs")
    if ctx < 1:
        raise UsageError(f"--ctx {ctx}: must be at least 1", "for example --ctx 4096")
    bound = limits.max_context or model_context
    if bound and ctx > bound:
        raise UsageError(f"--ctx {ctx} exceeds the {bound} tokens {model.family} supports for this model",
                         f"pass --ctx {bound} or less")
    if slots < 1 or slots > limits.max_kv_slots:
        raise UsageError(f"--slots {slots}: {model.family} supports 1 to {limits.max_kv_slots} slots",
                         f"pass --slots {min(max(slots, 1), limits.max_kv_slots)}")


def check_cap_and_threads(facts: ModelFacts, cap: int | None, threads: int | None) -> None:
    """``--cap`` within the model's experts per MoE layer, ``--threads`` at least one (None: the defaults)."""
    experts = facts.geometry.num_experts
    if cap is not None and (cap < 0 or (experts and cap > experts)):
        span = f"1 to {experts}" if experts else "a positive number"
        raise UsageError(f"--cap {cap}: out of range; {facts.model.path.name} has {experts or 'no'} experts per "
                         "MoE layer", f"pass --cap {span} (slots per layer), or leave it out to size it from --ram")
    if threads is not None and threads < 1:
        raise UsageError(f"--threads {threads}: must be at least 1",
                         f"pass --threads 1 to {os.cpu_count() or 1}, or leave it out for {default_threads()}")


def check_container(facts: ModelFacts) -> None:
    """A colibri-quant container runs only on an engine whose limits list every quantized scheme it stores."""
    stored = facts.quant_schemes
    supported = facts.limits.quant_schemes if facts.limits else ()
    missing = [s for s in stored if s not in supported]
    if missing:
        model = facts.model
        raise EngineError(f"{model.family} cannot run {model.path}: the container stores {', '.join(missing)} "
                          f"weights and the {model.family} engine runs "
                          f"{', '.join(supported) if supported else 'no quantized weights'}",
                          "run the source checkpoint, or reconvert with schemes the family supports "
                          "(coli families)")


STREAMING_PREFILL_CHUNK = PREFILL_ROWS  # prompt tokens per pass when experts stream (the engine's default is 32)


def prefill_chunk(facts: ModelFacts, ctx: int, partial_cache: bool,
                  wanted: int = STREAMING_PREFILL_CHUNK) -> int | None:
    """Prompt tokens per forward pass, or None for the engine's default (32).

    When the expert cache is partial, each prefill pass reads every expert its rows route to once (batch-union), so
    a 64-token prompt in 32-token passes reads most experts twice; 128 reads them once. Chunking never changes a
    token. The engine's scratch grows with the chunk (attention scores are chunk x heads x ctx floats), so the chunk
    shrinks for many heads or a long context, never below the default."""
    if not partial_cache:
        return None
    chunk = streaming_chunk(facts.geometry.num_heads, ctx, wanted)
    return chunk if chunk > 32 else None


def max_ctx(facts: ModelFacts) -> int | None:
    """The longest context the model and its engine both support, None when neither states one."""
    bounds = [v for v in (facts.geometry.max_context, facts.limits.max_context if facts.limits else 0) if v]
    return min(bounds) if bounds else None


def default_ctx(facts: ModelFacts) -> int:
    """4096, or less when the model or its engine supports less (as ``coli plan`` chooses)."""
    bound = max_ctx(facts)
    return DEFAULT_CTX if bound is None else min(DEFAULT_CTX, bound)


def plan_at(facts: ModelFacts, ram: int, ctx: int, slots: int, cap: int | None, rows: int = 0) -> ResourcePlan:
    """The plan the ``plan_resources`` hook makes, fitting or not (``rows``: the prefill chunk launch may ask for)."""
    request = PlanRequest(ram_bytes=ram, ctx=ctx, kv_slots=slots, cap=int(cap or 0), prefill_rows=rows)
    return hooks.plan_resources(facts.model, request, facts.geometry, facts.layout, facts.tensors)


def plan_for(facts: ModelFacts, ram: int, ctx: int, slots: int, cap: int | None, rows: int = 0) -> ResourcePlan:
    """The plan, or :class:`InsufficientMemoryError` with the numbers when it does not fit."""
    plan = plan_at(facts, ram, ctx, slots, cap, rows)
    if not plan.fits:
        from .console import human_bytes

        why = "; ".join(plan.notes) or (f"dense {human_bytes(plan.dense_bytes)} + KV {human_bytes(plan.kv_bytes)} + "
                                        f"reserve {human_bytes(plan.reserve_bytes)} leave no room for one expert "
                                        "slot per layer")
        raise InsufficientMemoryError(f"--ram {ram / GIB:.2f} GiB does not fit {facts.model.path.name}: {why}",
                                      f"it needs at least {plan.min_ram_bytes / GIB:.2f} GiB; "
                                      "pass a larger --ram or a smaller --ctx")
    return plan


def prepare(model: ResolvedModel, *, ram_gib: float | None = None, ctx: int | None = None, slots: int = 1,
            cap: int | None = None, threads: int | None = None, facts: ModelFacts | None = None,
            streaming: Streaming | None = None, tune: Any = None, io_threads: int | None = None,
            needed: int | None = None, trade_ctx: bool = False) -> LaunchSpec:
    """Check the flags against the family's limits, plan RAM, find (or build) the engine, assemble its argv.

    ``tune`` (a :class:`colibri.tune.TuneProfile`) sets what the flags leave open: I/O threads, staging buffers,
    the streaming prefill chunk and lookahead; ``io_threads`` and ``streaming.lookahead`` given explicitly win.
    Without ``ctx`` the context may be chosen (ctx_choice.py): ``needed`` (a single run's prompt + generation
    budget) sizes it, or ``trade_ctx`` (chat, serve: a conversation of unknown length) lets the default context shrink
    for expert slots under a tight budget; either change that buys slots is printed as one warning line. Neither
    given: the default context, as before (decide, quality and tests that need a known context)."""
    facts = facts or load_facts(model)
    # The engine is never started on a checkpoint whose tensors contradict the family's layout (what
    # doctor --deep and convert refuse too): it would read past its arrays or compute with the wrong shapes.
    require_sound_tensors(model, facts.geometry, facts.layout, facts.tensors)
    chosen = ctx is None
    ctx = default_ctx(facts) if ctx is None else int(ctx)
    check_limits(model, facts.limits, ctx, slots, facts.geometry.max_context)
    check_container(facts)
    check_cap_and_threads(facts, cap, threads)
    ram = ram_bytes(ram_gib)
    rows = (tune.choices.prefill_chunk if tune is not None else 0) or STREAMING_PREFILL_CHUNK
    if chosen and (needed is not None or trade_ctx):
        choice = choose_ctx(ctx, lambda c: plan_at(facts, ram, c, slots, cap, rows), needed, cap_given=bool(cap))
        ctx = choice.ctx
        if choice.notice:
            from .console import print_warning

            print_warning(choice.notice)
    plan = plan_for(facts, ram, ctx, slots, cap, rows)
    binary = builder.engine_for_model(model)
    if binary is None:
        raise EngineError(f"family {model.family} has no engine binary", "coli families shows what runs")
    env: EngineEnv = hooks.build_env(model, plan)
    threads = default_threads() if threads is None else int(threads)
    streaming = streaming or Streaming()
    streaming.check()
    if streaming.lossy_label():
        from .console import print_warning

        print_warning(f"lossy routing ({streaming.lossy_label()}): tokens will differ from the model's own routing")
    partial = 0 < plan.cache_slots_per_layer < plan.experts_per_layer
    if io_threads is not None and not 1 <= io_threads <= IO_THREADS_MAX:
        raise UsageError(f"--io-threads {io_threads}: must be 1 to {IO_THREADS_MAX}",
                         "leave it out for what coli tune measured (or the engine's 2)")
    top_k = facts.geometry.top_k or 1
    tuned = tuned_streaming(tune, streaming, top_k, plan.cache_slots_per_layer / max(1, plan.experts_per_layer))
    streaming, io_threads = tuned.streaming, io_threads or tuned.io_threads
    engine_cap, stages = plan.cache_slots_per_layer, None
    if partial and not cap and (streaming.prefetch is None or streaming.prefetch):   # an explicit --cap is obeyed
        # prefetching stays inside --ram: its staging buffers come out of the cache's budget
        engine_cap, stages = streaming_split(plan, top_k, tuned.staging_buffers)
    chunk = prefill_chunk(facts, ctx, partial, tuned.prefill_chunk or STREAMING_PREFILL_CHUNK)
    argv = (str(binary), "--model", str(model.path), "--ctx", str(ctx), "--slots", str(slots),
            "--cap", str(engine_cap), "--threads", str(threads),
            *(("--prefill-chunk", str(chunk)) if chunk else ()),
            *(("--io-stages", str(stages)) if stages else ()),
            *(("--io-threads", str(io_threads)) if io_threads else ()),
            *streaming.engine_args(partial), *env.args)
    return LaunchSpec(facts, plan, ctx, slots, threads, argv, dict(env.env), streaming, tune)


IO_THREADS_MAX = 8   # the engine's CB_IO_THREADS_MAX


@dataclass(frozen=True)
class Tuned:
    """What a coli tune profile sets for one launch (0 / None: the untuned default)."""

    streaming: Streaming
    io_threads: int = 0
    staging_buffers: int | None = None
    prefill_chunk: int = 0


LOOKAHEAD_MAX_CACHE_SHARE = 0.5   # lookahead by default only while the cache holds at most this share of a layer


def tuned_streaming(tune: Any, streaming: Streaming, top_k: int, cache_share: float) -> Tuned:
    """The profile's choices where the flags left them open. ``cache_share``: the plan's cache slots per layer over
    its experts (1 or more: every expert resident, nothing is read).

    Lookahead when the profile says the disk has the time and the cache holds at most
    :data:`LOOKAHEAD_MAX_CACHE_SHARE` of a layer: measured on and off (``nox -s bench_lookahead``), it gained 3-9 %
    of decode speed with 23-38 % of the experts cached, where reads dominate a token, and nothing to -2.5 % at 70-88 %,
    where the few reads it hides cost as much again in matmuls slowed by the reads in flight. The staging buffers are
    the profile's (a reader's buffer being filled and one waiting) but at least one per routed expert, plus one per
    routed expert of the next layer with lookahead."""
    if tune is None:
        return Tuned(streaming)
    c = tune.choices
    if (streaming.lookahead is None and 0 < cache_share <= LOOKAHEAD_MAX_CACHE_SHARE and c.lookahead
            and streaming.prefetch is not False):
        from dataclasses import replace

        streaming = replace(streaming, lookahead=True)
    stages = max(top_k, c.staging_buffers) + (top_k if streaming.lookahead else 0)
    return Tuned(streaming, c.io_threads, min(64, stages), c.prefill_chunk)


@dataclass(frozen=True)
class KVOptions:
    """Saved conversation KV (colibri/kv_store.py): ``directory`` None means the cache's kv/ directory."""

    enabled: bool = True
    directory: str | None = None
    budget: int = DEFAULT_KV_BUDGET


def kv_store_for(spec: LaunchSpec, kv: KVOptions):
    """The store of ``spec``'s model under ``kv`` (its identity: family, weights, hyperparameters)."""
    from .kv_store import KVStore, hyperparameter_args, kv_root, model_identity

    model = spec.facts.model
    identity = model_identity(model.path, model.family, hyperparameter_args(spec.argv))
    store = KVStore(kv_root(kv.directory), identity, kv.budget)
    store.describe(model.path, model.family)
    return store


def start(spec: LaunchSpec, ready_timeout: float = DEFAULT_READY_TIMEOUT, kv: KVOptions | None = None,
          store=None) -> Engine:
    """Start the engine of ``spec``; with ``kv`` enabled, its slots are saved and restored (kv_store.py) in
    ``store`` (default: :func:`kv_store_for`)."""
    if kv is None or not kv.enabled:
        return Engine(spec.argv, env=spec.env, ready_timeout=ready_timeout)
    return Engine(spec.argv, env=spec.env, ready_timeout=ready_timeout, kv_store=store or kv_store_for(spec, kv))


def open_engine(model: ResolvedModel, **kwargs) -> Engine:
    """``prepare`` then ``start``: the engine for ``model``, loaded and ready."""
    return start(prepare(model, **kwargs))
