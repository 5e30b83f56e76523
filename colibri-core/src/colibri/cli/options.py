"""Options shared by the commands, so ``--model``/``--family``/``--json`` read the same everywhere."""

from __future__ import annotations

import typer

from ..model import MODEL_ENV

ModelOption = typer.Option(
    None, "--model", "-m", metavar="DIR",
    help=f"Checkpoint directory (Hugging Face layout). Defaults to ${MODEL_ENV}.",
)
FamilyOption = typer.Option(
    None, "--family", metavar="NAME", help="Family to use when several installed families claim the model.",
)
JsonOption = typer.Option(False, "--json", help="Print machine-readable JSON instead of text.")
