"""The ``coli`` command line.

Each command lives in a small module that registers itself on :data:`app` when imported; adding a command is
one import line below. The order of the imports is the order of ``coli --help`` (ruff's isort rule is not
enabled, so nothing reorders them).
"""

from __future__ import annotations

from ._app import app, main

from . import families  # noqa: F401  (coli families)
from . import inspect  # noqa: F401  (coli info, plan, doctor)
from . import demo  # noqa: F401  (coli demo)
from . import run  # noqa: F401  (coli run)
from . import chat  # noqa: F401  (coli chat)
from . import decide  # noqa: F401  (coli decide)
from . import serve  # noqa: F401  (coli serve)
from . import cluster  # noqa: F401  (coli cluster serve, status)
from . import build  # noqa: F401  (coli build)
from . import convert  # noqa: F401  (coli convert)
from . import setup  # noqa: F401  (coli setup)
from . import models  # noqa: F401  (coli pull, list, rm)
from . import daemon  # noqa: F401  (coli start, status, logs, stop)
from . import bench  # noqa: F401  (coli bench quality)
from . import kv  # noqa: F401  (coli kv list, clear)
from . import tune  # noqa: F401  (coli tune)

__all__ = ["app", "main"]
