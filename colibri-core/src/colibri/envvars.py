"""colibri's environment variables: every name starts with ``COLIBRI_``.

The first releases read ``COLI_MODEL``, ``COLI_DEBUG`` and ``COLI_API_KEY``; those names still work as aliases
(the ``COLIBRI_`` name wins when both are set), so existing shells and unit files keep working.
"""

from __future__ import annotations

import os

MODEL = "COLIBRI_MODEL"
DEBUG = "COLIBRI_DEBUG"
API_KEY = "COLIBRI_API_KEY"
ALIASES = {MODEL: "COLI_MODEL", DEBUG: "COLI_DEBUG", API_KEY: "COLI_API_KEY"}


def names(name: str) -> list[str]:
    """The variable and its old alias, in the order they are read."""
    return [name, ALIASES[name]] if name in ALIASES else [name]


def getenv(name: str) -> str | None:
    """The value of ``name``, else of its old alias, else None."""
    return next((os.environ[n] for n in names(name) if n in os.environ), None)
