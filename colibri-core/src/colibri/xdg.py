"""The per-user directories colibri writes to, each overridable by one environment variable.

Precedence for every one: the ``COLIBRI_*`` variable (the directory itself), then the XDG base-directory variable
(with ``colibri`` appended), then the XDG default under ``$HOME``. Caches live in :mod:`colibri.cachedir`.
"""

from __future__ import annotations

import os
from pathlib import Path

MODELS_ENV = "COLIBRI_MODELS"
CONFIG_ENV = "COLIBRI_CONFIG"
STATE_ENV = "COLIBRI_STATE"


def _xdg(xdg: str, fallback: str) -> Path:
    base = os.environ.get(xdg)
    return (Path(base).expanduser() if base else Path.home() / fallback) / "colibri"


def _user_dir(override: str, xdg: str, fallback: str) -> Path:
    explicit = os.environ.get(override)
    return Path(explicit).expanduser() if explicit else _xdg(xdg, fallback)


def models_root() -> Path:
    """Where ``coli pull`` stores models: ``$COLIBRI_MODELS``, else ``$XDG_DATA_HOME/colibri/models``."""
    explicit = os.environ.get(MODELS_ENV)
    return Path(explicit).expanduser() if explicit else _xdg("XDG_DATA_HOME", ".local/share") / "models"


def config_dir() -> Path:
    """Where ``coli setup`` writes its choices: ``$COLIBRI_CONFIG``, else ``$XDG_CONFIG_HOME/colibri``."""
    return _user_dir(CONFIG_ENV, "XDG_CONFIG_HOME", ".config")


def state_dir() -> Path:
    """The background server's pidfile and log: ``$COLIBRI_STATE``, else ``$XDG_STATE_HOME/colibri``."""
    return _user_dir(STATE_ENV, "XDG_STATE_HOME", ".local/state")
