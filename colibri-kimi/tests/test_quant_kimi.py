"""The kimi engine on colibri-quant containers (Kimi K2: DeepSeek-V3 geometry over the shared MLA and grouped
routing blocks). Quality against the f32 engine over 512 teacher-forced positions.

Measured (seed 5, moe_intermediate_size 64, bf16 dense): kimi_k2 int8 and int4 top-1 97.85 %, KL mean 3.5e-5 / max
1.6e-4 nats; int8 and int4 are equal to three digits, so the gap to the f32 engine is the bf16 rounding of the dense
weights flipping near-ties of this random model, not the expert scheme (as for glm4_moe). Asserted: the measured
97 % with the KL ceiling.
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
    ("kimi_k2", "int8", "bf16"): (0.97, 2e-4),
    ("kimi_k2", "int4", "bf16"): (0.97, 2e-4),
}


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("kimi-quant")


@pytest.mark.parametrize("case", sorted(CASES), ids=lambda c: "-".join(c))
def test_container_quality_against_the_f32_engine(root, case):
    kind, experts, dense = case
    check_container_quality(kind, root, experts, dense, *CASES[case])
