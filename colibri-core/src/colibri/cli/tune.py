"""``coli tune``: measure this machine's disk and expert kernels, save the profile ``run``/``serve``/``chat`` use."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from ._app import app
from .options import FamilyOption, JsonOption


def _model_target(model: str, family: Optional[str]):
    """(directory keyed, largest shard, expert bytes, probe geometry) of a model."""
    from .. import tune
    from ..inventory import load_facts
    from ..model import resolve_model
    from ..roles import take_inventory

    facts = load_facts(resolve_model(model, family))
    g = facts.geometry
    inv = take_inventory(g, facts.layout, facts.tensors)
    shard = max((h for h in facts.tensors.headers), key=lambda h: h.file_size).file
    schemes = facts.quant_schemes
    scheme = "q4" if any(s.startswith("int4") for s in schemes) else "q8"
    hidden, width = g.hidden_size, g.expert_intermediate
    if hidden % 64 or width % 64 or not hidden or not width:   # the probe's kernels want 64-column groups
        hidden, width = tune.DEFAULT_GEOMETRY[:2]
    geometry = (hidden, width, scheme, g.num_experts or tune.DEFAULT_GEOMETRY[3], g.top_k or tune.DEFAULT_GEOMETRY[4])
    return facts.model.path, shard, inv.bytes_per_expert or tune.DEFAULT_EXPERT_BYTES, geometry


def _default_dir() -> Path:
    """The models directory when it exists (where models live), else the cache directory."""
    from ..cachedir import cache_root
    from ..xdg import models_root

    models = models_root()
    return models if models.is_dir() else cache_root()


@app.command("tune")
def tune_command(
    model: Optional[str] = typer.Option(None, "--model", "-m", metavar="DIR|NAME", help="Measure on this model's "
                                        "own shards (read only) at its expert size and geometry."),
    family: Optional[str] = FamilyOption,
    directory: Optional[Path] = typer.Option(None, "--dir", help="Measure the filesystem holding this directory "
                                             "with a temporary file (default: the models dir, else the cache)."),
    file_size: str = typer.Option("256MiB", "--file-size", help="Size of the temporary file read at random."),
    seconds: float = typer.Option(8.0, "--seconds", help="Time budget of the whole measurement."),
    threads: Optional[int] = typer.Option(None, "--threads", help="Compute threads of the kernel probe "
                                          "(default: cores, as run uses)."),
    as_json: bool = JsonOption,
) -> None:
    """Measure random expert-sized reads (queue depths 1-8, with and without O_DIRECT) and one expert's matmul
    time, choose I/O threads, staging buffers, prefill chunk and lookahead, and save them for this filesystem."""
    from .. import tune
    from ..console import emit_json, human_bytes, print_pairs
    from ..errors import UsageError
    from ..launch import default_threads
    from .serve import parse_size

    if model and directory:
        raise UsageError("both --model and --dir given", "pass one: --model measures its shards, --dir a scratch file")
    size = parse_size(file_size, "--file-size")
    if model:
        where, shard, expert_bytes, geometry = _model_target(model, family)
    else:
        where, shard, expert_bytes, geometry = directory or _default_dir(), None, tune.DEFAULT_EXPERT_BYTES, \
            tune.DEFAULT_GEOMETRY
    if threads is not None and threads < 1:
        raise UsageError(f"--threads {threads}: must be at least 1", "or leave it out")
    profile = tune.tune(where, model_file=shard, expert_bytes=expert_bytes, geometry=geometry, file_size=size,
                        seconds=seconds, threads=threads or default_threads())
    saved = tune.save_profile(profile, where)
    if as_json:
        emit_json({"profile": str(saved), **profile.as_json()})
        return
    c = profile.choices
    rows = [(f"depth {p.depth}{' direct' if p.direct else ' buffered'}",
             f"{human_bytes(p.bytes_per_s)}/s, {p.latency_s * 1e3:.2f} ms a read ({p.reads} reads)")
            for p in profile.reads]
    rows += [("expert matmul", f"{profile.expert_s * 1e3:.3f} ms a token, {profile.expert_batch_s * 1e3:.3f} ms for "
                               f"{tune.PREFILL_PROBE_ROWS} rows ({profile.qpath})"),
             ("I/O threads", f"{c.io_threads} (--io {c.io})"), ("staging buffers", str(c.staging_buffers)),
             ("prefill chunk", str(c.prefill_chunk)), ("lookahead", "pays" if c.lookahead else "does not pay"),
             ("disk bound bandwidth", f"{human_bytes(c.disk_bandwidth)}/s"), ("saved", str(saved))]
    print_pairs(rows)
