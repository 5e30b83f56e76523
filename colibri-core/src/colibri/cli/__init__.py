"""The ``coli`` command line.

Each command lives in a small module that registers itself on :data:`app` when imported; adding a command is
one import line below. The order of the imports is the order of ``coli --help``.
"""
# ruff: noqa: I001  (the import order is the help order)

from __future__ import annotations

from ._app import app, main

from . import families  # noqa: E402,F401  (coli families)
from . import inspect  # noqa: E402,F401  (coli info, plan, doctor)
from . import demo  # noqa: E402,F401  (coli demo)
from . import run  # noqa: E402,F401  (coli run)
from . import chat  # noqa: E402,F401  (coli chat)
from . import serve  # noqa: E402,F401  (coli serve)
from . import build  # noqa: E402,F401  (coli build)
from . import convert  # noqa: E402,F401  (coli convert)
from . import setup  # noqa: E402,F401  (coli setup)
from . import models  # noqa: E402,F401  (coli pull, list, rm)
from . import daemon  # noqa: E402,F401  (coli start, status, logs, stop)
from . import bench  # noqa: E402,F401  (coli bench quality)

__all__ = ["app", "main"]
