"""A pytest fixture for suites that start ``coli chat`` or ``coli serve``: saved conversation KV is on by default
there, so each test module gets a KV directory of its own (``COLIBRI_KV_DIR``) and no test loads what another
module's requests saved (that would change their reuse counts, never their tokens).

    from colibri.testing.kv_dir import private_kv_dir  # noqa: F401   (in a conftest.py)
"""

from __future__ import annotations

import os

import pytest

from ..kv_store import KV_DIR_ENV


@pytest.fixture(scope="module", autouse=True)
def private_kv_dir(tmp_path_factory):
    before = os.environ.get(KV_DIR_ENV)
    os.environ[KV_DIR_ENV] = str(tmp_path_factory.mktemp("kv"))
    yield
    if before is None:
        os.environ.pop(KV_DIR_ENV, None)
    else:
        os.environ[KV_DIR_ENV] = before
