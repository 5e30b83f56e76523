"""``coli bench``: measurements of a model, as opposed to runs of it. ``coli bench quality`` compares a converted
container with its source by teacher-forcing the same tokens through both engines (colibri.convert.quality)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from ..console import emit_json, print_heading, print_pairs
from ..errors import UsageError
from ..model import resolve_model
from ._app import ColiGroup, app
from .options import FamilyOption, JsonOption, ModelOption

bench_app = typer.Typer(cls=ColiGroup, name="bench", no_args_is_help=True,
                        help="Measure a model: quality of a conversion against its source.")
app.add_typer(bench_app, name="bench")


@bench_app.command("quality")
def quality_command(
    model: Optional[str] = ModelOption,
    reference: str = typer.Option(..., "--reference", "-r", metavar="DIR",
                                  help="The checkpoint the model was converted from (same tokenizer)."),
    positions: Optional[int] = typer.Option(None, "--positions", "-n", help="Next-token predictions compared "
                                            "(>= 1; default 512, or fewer when the models' context is shorter)."),
    text_file: Optional[Path] = typer.Option(None, "--text-file", metavar="FILE",
                                             help="UTF-8 text to teacher-force (default: a fixed passage shipped "
                                                  "with colibri, so runs are comparable)."),
    ram: Optional[float] = typer.Option(None, "--ram", metavar="GB", help="RAM budget in GiB per engine."),
    threads: Optional[int] = typer.Option(None, "--threads", help="Compute threads (default: all cores)."),
    family: Optional[str] = FamilyOption,
    as_json: bool = JsonOption,
) -> None:
    """Top-1 agreement, mean and max KL divergence and perplexity of MODEL against REFERENCE over one text.

    Every position's logits come from submitting the text as one prompt with logits on; the two engines run one
    after the other, so peak RAM is one model's.
    """
    from ..convert.quality import default_text, run_quality

    if text_file is not None:
        try:
            text = text_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise UsageError(f"--text-file {text_file}: cannot read it ({exc.__class__.__name__})",
                             "pass a readable UTF-8 text file") from None
    else:
        text = default_text()
    candidate = resolve_model(model, family)
    ref = resolve_model(reference, family)
    if ref.family != candidate.family:
        raise UsageError(f"--reference {ref.path} is a {ref.family} model, --model {candidate.path} is "
                         f"{candidate.family}", "compare a container with the checkpoint it was converted from")
    options = {"ram_gib": ram, "threads": threads}
    report = run_quality(candidate, ref, [text], positions="fit" if positions is None else positions,
                         **{k: v for k, v in options.items() if v is not None})
    data = {"model": str(candidate.path), "reference": str(ref.path), "positions": report.positions,
            "top1_agreement": report.top1_agreement, "mean_kl": report.mean_kl, "max_kl": report.max_kl,
            "reference_ppl": report.reference_ppl, "model_ppl": report.candidate_ppl}
    if as_json:
        emit_json(data)
        return
    print_heading(f"{candidate.path.name} against {ref.path.name}")
    print_pairs([("positions", report.positions),
                 ("top-1 agreement", f"{100 * report.top1_agreement:.2f}%"),
                 ("KL mean", f"{report.mean_kl:.3g} nats"),
                 ("KL max", f"{report.max_kl:.3g} nats"),
                 ("perplexity", f"{report.candidate_ppl:.4g} (reference {report.reference_ppl:.4g}, "
                                f"ratio {report.ppl_ratio:.4f})")])
