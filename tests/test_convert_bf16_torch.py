"""coli convert's f32 -> bf16 rounding is torch's, bit for bit (round to nearest even, signed zeros, infinities,
subnormals). Core's own tests run without torch, so this comparison lives here."""

from __future__ import annotations

import numpy as np
import pytest


def test_bf16_rounding_matches_torch():
    torch = pytest.importorskip("torch")
    from colibri.convert.schemes import f32_to_bf16_bits

    rng = np.random.default_rng(3)
    x = np.concatenate([rng.standard_normal(4096).astype(np.float32) * 1e3,
                        np.array([np.inf, -np.inf, 0.0, -0.0, 1e-40], dtype=np.float32)])
    want = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(f32_to_bf16_bits(x), want)
