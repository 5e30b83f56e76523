"""What every engine session script does first: the sessions run from a checkout (``make -C engines test``), so the
repository's packages go on ``sys.path`` before colibri is imported, and the hub stays offline."""

from __future__ import annotations

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def use_packages(*packages: str) -> None:
    """Import colibri-core and ``packages`` (e.g. ``"colibri-decision"``) from this checkout."""
    for package in ("colibri-core", *packages):
        sys.path.insert(0, str(REPO / package / "src"))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
