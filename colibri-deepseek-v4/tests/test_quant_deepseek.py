"""The deepseek engine on colibri-quant containers: MLA and grouped sigmoid routing over the shared blocks, so a
container runs without deepseek-specific code. Quality against the f32 engine over 512 teacher-forced positions.

Measured (seed 5, moe_intermediate_size 64, bf16 dense): deepseek_v3 int8 and int4 top-1 99.2 %, KL mean 3.8e-5 /
max 1.6e-4 nats (int8 and int4 agree to three digits: the bf16 dense rounding dominates). deepseek_v32 is not
asserted here: its DSA indexer picks keys by a hard top-k, and bf16 rounding of the indexer projections flips picks
on this random model (measured top-1 74 %, KL mean 0.053) — an open item of the DeepSeek issue.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

pytest.importorskip("torch")
pytest.importorskip("transformers")

from colibri.testing.quality import check_container_quality  # noqa: E402

CASES = {  # (kind, experts, dense) -> (min top-1 agreement, max mean KL)
    ("deepseek_v3", "int8", "bf16"): (0.98, 2e-4),
    ("deepseek_v3", "int4", "bf16"): (0.98, 2e-4),
}


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("deepseek-quant")


@pytest.mark.parametrize("case", sorted(CASES), ids=lambda c: "-".join(c))
def test_container_quality_against_the_f32_engine(root, case):
    kind, experts, dense = case
    check_container_quality(kind, root, experts, dense, *CASES[case])
