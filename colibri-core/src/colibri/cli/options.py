"""Options shared by the commands, so ``--model``/``--family``/``--json`` read the same everywhere."""

from __future__ import annotations

import typer

from ..model import MODEL_ENV

ModelOption = typer.Option(
    None, "--model", "-m", metavar="DIR|NAME",
    help=f"Checkpoint directory (Hugging Face layout), or the name of a pulled model (Org/Name). "
         f"Defaults to ${MODEL_ENV}.",
)
FamilyOption = typer.Option(
    None, "--family", metavar="NAME", help="Family to use when several installed families claim the model.",
)
JsonOption = typer.Option(False, "--json", help="Print machine-readable JSON instead of text.")

# Expert streaming (colibri/launch.py Streaming): the switches change speed only, never a token.
PrefetchOption = typer.Option(
    None, "--prefetch/--no-prefetch",
    help="Read missing experts on I/O threads while resident ones compute "
         "(default: on when the expert cache cannot hold every expert).",
)
LookaheadOption = typer.Option(
    None, "--lookahead/--no-lookahead",
    help="With --prefetch, also read the next layer's experts ahead, as predicted by its router on this layer's "
         "input (default: what coli tune measured for this disk; off without a profile: a wrong guess costs a "
         "whole read on a disk that is usually the bottleneck).",
)
IoThreadsOption = typer.Option(
    None, "--io-threads", min=1, max=8,
    help="Expert reads in flight (default: what coli tune measured for this disk, else 2).",
)
TuneProfileOption = typer.Option(
    True, "--tune-profile/--no-tune-profile",
    help="Use the coli tune profile of the model's disk (I/O threads, staging buffers, prefill chunk, lookahead, "
         "the disk bound); --no-tune-profile ignores it.",
)


def tune_profile(use: bool, model_dir):
    """The coli tune profile of ``model_dir``'s filesystem, or None (``--no-tune-profile``, or none saved)."""
    from ..tune import load_profile

    return load_profile(model_dir) if use else None
PreloadOption = typer.Option(
    None, "--preload/--no-preload",
    help="Read every expert at start when the cache holds them all, so the first requests run from RAM "
         "(default: on when the expert cache can hold every expert).",
)
PinOption = typer.Option(
    None, "--pin/--no-pin",
    help="Eviction policy. --pin: the learned hot set alone (evict the coldest expert, routing count decayed over "
         "the last few tokens and seeded from counts saved next to the model, and pin the hottest in half the "
         "cache); --no-pin: LRU alone. Default, when the expert cache cannot hold every expert: set dueling, each "
         "layer evicting by whichever of the two would have hit more over its recent lookups.",
)
IoOption = typer.Option(
    "auto", "--io", metavar="auto|direct|buffered",
    help="Expert reads: O_DIRECT (probed per disk, buffered where refused) or buffered with readahead off; auto "
         "picks direct when the cache cannot hold every expert.",
)
ExpertsKOption = typer.Option(
    None, "--experts-k", metavar="K", help="LOSSY: run at most K routed experts per token (fewer than the model's).",
)
ExpertsTopPOption = typer.Option(
    None, "--experts-top-p", metavar="P",
    help="LOSSY: run only the fewest experts whose routing weight reaches the share P of the token's total.",
)


def streaming_options(prefetch, pin, io, experts_k, experts_top_p, lookahead=None, preload=None):
    """The Streaming record of the shared flags above."""
    from ..launch import Streaming

    return Streaming(prefetch=prefetch, pin=pin, io=io, experts_k=experts_k, experts_top_p=experts_top_p,
                     lookahead=lookahead, preload=preload)

# Saved conversation KV (colibri/kv_store.py, docs/server.md "Conversations that survive restarts").
KvOption = typer.Option(
    None, "--kv/--no-kv",
    help="Save each conversation's KV to disk at the end of a turn and load it when a later prompt extends it "
         "(default: on for chat and serve, off for run).",
)
KvDirOption = typer.Option(
    None, "--kv-dir", metavar="DIR",
    help="Where saved KV lives, one subdirectory per model (default: $COLIBRI_KV_DIR, else $COLIBRI_CACHE/kv, "
         "else $XDG_CACHE_HOME/colibri/kv); implies --kv.",
)
KvBudgetOption = typer.Option(
    "8G", "--kv-disk-budget", metavar="SIZE",
    help="Disk space for one model's saved KV; the least recently used files go first (e.g. 8G, 500M).",
)


def kv_options(kv: bool | None, kv_dir: str | None, budget: str, default: bool):
    """The KVOptions record of the flags above (``default``: whether saving is on when --kv is not given)."""
    from ..launch import KVOptions
    from .serve import parse_size

    enabled = (default or kv_dir is not None) if kv is None else kv
    return KVOptions(enabled=enabled, directory=kv_dir, budget=parse_size(budget, "--kv-disk-budget"))


ExpertWorkersOption = typer.Option(
    None, "--expert-workers", metavar="N", min=1,
    help="Expert-parallel: hold the routed experts in the RAM of N Ray nodes (each offering a colibri_experts_<name> "
         "resource; needs colibri-core[cluster]).",
)
PartitionOption = typer.Option(
    "expert", "--partition", metavar="layer|expert",
    help="With --expert-workers: split the experts by layer or by expert (balanced by the hot-set counts).",
)
RayAddressOption = typer.Option(
    None, "--address", metavar="RAY_ADDRESS",
    help="With --expert-workers: the Ray cluster to join (default: RAY_ADDRESS, else a local one).",
)
