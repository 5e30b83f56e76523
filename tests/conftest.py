"""Fixtures of the cross-package tests: the family packages installed in the environment, as a user has them."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from colibri import plugins


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


@pytest.fixture(scope="module", autouse=True)
def private_kv_dir(tmp_path_factory):
    """Each module saves conversation KV (on by default in coli chat and serve) in its own directory, so no test
    loads what another module's requests saved (that would change their reuse counts, never their tokens)."""
    before = os.environ.get("COLIBRI_KV_DIR")
    os.environ["COLIBRI_KV_DIR"] = str(tmp_path_factory.mktemp("kv"))
    yield
    if before is None:
        os.environ.pop("COLIBRI_KV_DIR", None)
    else:
        os.environ["COLIBRI_KV_DIR"] = before
