"""torch's CPU ``randn`` for a seed, without torch: the pipeline's initial noise.

diffusers draws the latents with ``torch.randn(shape, generator=torch.Generator("cpu").manual_seed(seed))``.
torch's CPU generator is an MT19937 seeded the textbook way (numpy's legacy ``RandomState`` seeding is the same),
a float32 uniform keeps the low 24 bits of one 32-bit draw, and a contiguous float32 tensor of 16 or more elements
is filled in blocks of 16 by Box-Muller over (1 - u[j], u[j + 8]); a tail that is not a whole block redraws the
last 16. torch evaluates log/cos/sin in float32 (vectorised with AVX2), this module in float64 rounded to float32,
so a draw may differ from torch's in the last bit: far inside the parity tolerance, and identical across runs here.
"""

from __future__ import annotations

import math

import numpy as np


def torch_randn(seed: int, count: int) -> np.ndarray:
    """``torch.randn(count, generator=torch.Generator().manual_seed(seed))`` as float32 (count >= 16)."""
    if count < 16:
        raise ValueError("torch_randn reproduces the block path (16 or more elements) only")
    bits = np.random.RandomState(seed & 0xFFFFFFFF)._bit_generator.random_raw(count + 16)
    uniform = ((bits & ((1 << 24) - 1)).astype(np.float64) * 2.0 ** -24).astype(np.float32)
    data = uniform[:count].astype(np.float64)
    whole = count - count % 16
    _box_muller(data, whole)
    out = data.astype(np.float32)
    if count % 16:
        tail = uniform[count:count + 16].astype(np.float64)
        out[count - 16:] = tail
        tail_out = out[count - 16:].astype(np.float64)
        _box_muller(tail_out, 16)
        out[count - 16:] = tail_out.astype(np.float32)
    return out


def _box_muller(data: np.ndarray, whole: int) -> None:
    blocks = data[:whole].reshape(-1, 16)
    u1 = 1.0 - blocks[:, :8].astype(np.float32).astype(np.float64)
    u2 = blocks[:, 8:]
    radius = np.sqrt(-2.0 * np.log(u1))
    theta = 2.0 * math.pi * u2
    blocks[:, :8] = radius * np.cos(theta)
    blocks[:, 8:] = radius * np.sin(theta)
    data[:whole] = blocks.reshape(-1)
