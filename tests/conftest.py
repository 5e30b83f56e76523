"""Fixtures of the cross-package tests: the family packages installed in the environment, as a user has them."""

from __future__ import annotations

from pathlib import Path

import pytest

from colibri import plugins
from colibri.testing.kv_dir import private_kv_dir  # noqa: F401  (each module its own COLIBRI_KV_DIR)


@pytest.fixture(scope="module")
def tiny_root(tmp_path_factory) -> Path:
    """Where a module's tiny models are built (colibri.testing.tiny memoises them across modules anyway)."""
    return tmp_path_factory.mktemp("tiny")


@pytest.fixture
def installed_families(monkeypatch):
    """Every installed family plugin loaded, whatever COLIBRI_LOAD_PLUGINS / COLIBRI_DISABLE_PLUGINS say."""
    monkeypatch.delenv("COLIBRI_LOAD_PLUGINS", raising=False)
    monkeypatch.delenv("COLIBRI_DISABLE_PLUGINS", raising=False)
    plugins.reset()
    yield
    plugins.reset()
