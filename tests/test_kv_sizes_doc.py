"""docs/formats.md reports the saved KV bytes per token of each real release as tests/kv_sizes.py computes them
from the releases' config.json and their families' geometry (no figure typed by hand)."""

from __future__ import annotations

from pathlib import Path

import pytest

import kv_sizes

DOC = Path(__file__).resolve().parents[1] / "docs" / "formats.md"


def test_formats_doc_has_the_saved_kv_table(installed_families):
    for package in ("colibri_olmoe", "colibri_qwen", "colibri_glm", "colibri_deepseek_v4", "colibri_kimi"):
        pytest.importorskip(package)
    table = kv_sizes.table()
    assert table in DOC.read_text(encoding="utf-8"), f"regenerate with python tests/kv_sizes.py:\n{table}"
