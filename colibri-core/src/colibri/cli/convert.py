"""``coli convert``: quantize a checkpoint's routed experts (and optionally its dense weights) into a container."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import typer

from ..console import human_bytes, print_pairs, stdout
from ..model import resolve_model
from ._app import app
from .options import FamilyOption, ModelOption


class RichReporter:
    """A progress bar over source bytes (with speed and ETA) and one line per shard."""

    def __init__(self):
        from rich.progress import (
            BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn,
        )

        self.progress = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                                 TransferSpeedColumn(), TimeRemainingColumn(), console=stdout(), transient=False)
        self.task: Any = None    # rich's TaskID once started
        self.shards = 0

    def start(self, total_bytes: int, shards: int) -> None:
        self.shards = shards
        self.progress.start()
        self.task = self.progress.add_task("converting", total=total_bytes)

    def shard(self, plan, resumed: bool) -> None:
        state = " (done before, kept)" if resumed else ""
        self.progress.update(self.task, description=f"shard {plan.index}/{self.shards} {plan.label}{state}")

    def advance(self, nbytes: int) -> None:
        self.progress.advance(self.task, nbytes)

    def finish(self) -> None:
        self.progress.update(self.task, description="converted")
        self.progress.stop()


@app.command("convert")
def convert_command(
    model: Optional[str] = ModelOption,
    out: Path = typer.Option(..., "--out", "-o", metavar="DIR", help="Output directory (new or empty; an "
                             "interrupted conversion into it resumes)."),
    experts: str = typer.Option("int8", "--experts", metavar="int8|int4",
                                help="Routed experts: int8 per output row, or int4 in groups of 64 inputs."),
    dense: str = typer.Option("bf16", "--dense", metavar="f32|bf16|int8|int4",
                              help="Dense matrices (attention, embeddings, LM head, shared experts): f32 keeps "
                              "the source values exactly, bf16 rounds F32/F16 sources (exact for BF16 ones), "
                              "int8/int4 as for experts. Routers, norms, biases and selection tensors (e.g. "
                              "DSA indexer) always stay F32."),
    verify: bool = typer.Option(False, "--verify", help="Re-read the output and check every tensor against the "
                                "source (exact bits and the scheme's error bound)."),
    family: Optional[str] = FamilyOption,
    repo: Optional[str] = typer.Option(None, "--repo", metavar="REPO[@REV]",
                                       help="Convert a hub repo while downloading it, shard by shard (the disk "
                                            "never holds the release and the container together); resumable."),
) -> None:
    """Convert a checkpoint into a colibri-quant container (safetensors shards; see docs/formats.md)."""
    from ..convert.plan import summarize_fallbacks
    from ..convert.run import convert

    if repo is not None:
        from ..errors import UsageError
        from ..stream_convert import convert_repo

        if model is not None or verify:
            raise UsageError("--repo converts from the hub", "drop --model/--verify (verify the container with "
                             "`coli convert --model SOURCE --verify` when the source is on disk)")
        result, peak = convert_repo(repo, out, experts=experts, dense=dense, family=family,
                                    reporter=RichReporter())
        stdout().print(f"source shards on disk at most: {human_bytes(peak)}")
    else:
        resolved = resolve_model(model, family)
        result = convert(resolved, out, experts=experts, dense=dense, verify=verify, reporter=RichReporter())
    pairs = [
        ("output", str(result.out)),
        ("schemes", f"experts {experts}, dense {dense}"),
        ("shards", f"{result.shards}" + (" (already converted, nothing written)" if result.already_done else
                                         f" ({result.written_shards} written this run)")),
        ("size", f"{human_bytes(result.output_bytes)} from {human_bytes(result.source_bytes)} of source tensors"),
        ("time", f"{result.seconds:.1f} s"),
        ("peak RSS", human_bytes(result.peak_rss_bytes)),
    ]
    pairs += [("fallback", line) for line in summarize_fallbacks(result.fallbacks)]
    if result.verified is not None:
        ratios = ", ".join(f"{k} {v:.3f}" for k, v in sorted(result.verified.max_ratio.items()))
        pairs.append(("verified", f"{result.verified.tensors} tensors, {result.verified.experts} experts contiguous; "
                                  f"max error / (scale/2): {ratios or 'n/a'}"))
    print_pairs(pairs)
