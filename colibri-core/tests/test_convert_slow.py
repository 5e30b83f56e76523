"""The bounded-memory claim of coli convert on a checkpoint larger than 2 GB (slow: run by `nox -s convert_slow`).

Skipped unless COLIBRI_SLOW_TESTS=1. The source (BF16, ~2.4 GB, one 256 MiB embedding among ~200 expert
matrices of 4 MiB) is streamed to disk chunk by chunk, so the test itself also stays small in memory; the
conversion and --verify run in a child process whose peak RSS (getrusage) must stay below 1 GiB.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

TESTS_DIR = Path(__file__).resolve().parent
SLOW = os.environ.get("COLIBRI_SLOW_TESTS") == "1"
RSS_LIMIT = 1 << 30

pytestmark = pytest.mark.skipif(not SLOW, reason="slow: set COLIBRI_SLOW_TESTS=1 (nox -s convert_slow)")

LAYERS, EXPERTS, HIDDEN, INTER, VOCAB = 6, 32, 2048, 1024, 65536


def _tensor_shapes() -> list[tuple[str, tuple[int, ...]]]:
    shapes = [("model.embed_tokens.weight", (VOCAB, HIDDEN)), ("lm_head.weight", (VOCAB // 8, HIDDEN)),
              ("model.norm.weight", (HIDDEN,))]
    for L in range(LAYERS):
        p = f"model.layers.{L}."
        shapes += [(p + "input_layernorm.weight", (HIDDEN,)), (p + "post_attention_layernorm.weight", (HIDDEN,)),
                   (p + "self_attn.q_norm.weight", (HIDDEN,)), (p + "self_attn.k_norm.weight", (HIDDEN,)),
                   (p + "mlp.gate.weight", (EXPERTS, HIDDEN))]
        shapes += [(p + f"self_attn.{w}_proj.weight", (HIDDEN, HIDDEN)) for w in "qkvo"]
        for e in range(EXPERTS):
            shapes += [(p + f"mlp.experts.{e}.gate_proj.weight", (INTER, HIDDEN)),
                       (p + f"mlp.experts.{e}.up_proj.weight", (INTER, HIDDEN)),
                       (p + f"mlp.experts.{e}.down_proj.weight", (HIDDEN, INTER))]
    return shapes


def _write_streamed_bf16(path: Path, shapes: list[tuple[str, tuple[int, ...]]], seed: int) -> int:
    """One safetensors file written tensor by tensor, 16 MiB at a time (BF16 N(0, 1/fan_in), norms 1 + 0.1 N)."""
    from colibri.convert.schemes import f32_to_bf16_bits

    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape in shapes:
        n = int(np.prod(shape)) * 2
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 8)
    rng = np.random.default_rng(seed)
    # A pool of BF16 N(0, 1) bits, sliced at random offsets and shifted by exponent steps: realistic values at
    # disk speed (drawing and rounding 1.2 G normals would take most of the test's time).
    pool = f32_to_bf16_bits(rng.standard_normal(16 << 20, dtype=np.float32))
    with open(path, "wb") as fh:
        fh.write(len(raw).to_bytes(8, "little") + raw)
        for _name, shape in shapes:
            if len(shape) == 1:
                fh.write(f32_to_bf16_bits(1 + 0.1 * rng.standard_normal(shape[0], dtype=np.float32)).tobytes())
                continue
            left = int(np.prod(shape))
            while left:
                n = min(left, 4 << 20)
                start = int(rng.integers(0, pool.size - n + 1))
                block = pool[start:start + n]
                # Scale by 2^-k (k = 4..6, about 1/sqrt(fan_in)) by lowering the exponent; zeros stay zero.
                k = int(rng.integers(4, 7))
                shifted = np.where((block & 0x7F80) > (k << 7), block - np.uint16(k << 7), block & 0x8000)
                fh.write(shifted.astype("<u2").tobytes())
                left -= n
    return offset


@pytest.fixture(scope="module")
def big_src(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("big") / "src"
    src.mkdir()
    shapes = _tensor_shapes()
    half = len(shapes) // 2
    total, weight_map = 0, {}
    for i, part in enumerate((shapes[:half], shapes[half:]), start=1):
        name = f"model-{i:05d}-of-00002.safetensors"
        total += _write_streamed_bf16(src / name, part, seed=i)
        weight_map.update({n: name for n, _ in part})
    (src / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                  "weight_map": weight_map}))
    (src / "config.json").write_text(json.dumps({"model_type": "colibri_tiny_moe", "num_hidden_layers": LAYERS,
                                                 "num_experts": EXPERTS, "hidden_size": HIDDEN,
                                                 "intermediate_size": INTER, "vocab_size": VOCAB}))
    from test_convert import write_word_tokenizer

    write_word_tokenizer(src / "tokenizer.json", VOCAB)   # convert refuses a source `coli doctor --deep` fails
    assert total >= 2 * 10**9
    return src


CHILD = r"""
import json, sys
sys.path.insert(0, {tests!r})
import test_convert as t
t.register_test_families()
from pathlib import Path
r = t.run_convert(Path({src!r}), Path({out!r}), experts={experts!r}, dense={dense!r}, verify=True)
print(json.dumps({{"peak_rss": r.peak_rss_bytes, "seconds": r.seconds, "source_bytes": r.source_bytes,
                  "output_bytes": r.output_bytes, "experts": r.verified.experts,
                  "max_ratio": r.verified.max_ratio}}))
"""


@pytest.mark.parametrize("experts,dense", [("int4", "int8")])
def test_big_checkpoint_converts_in_bounded_memory(big_src, tmp_path, experts, dense):
    out = tmp_path / "out"
    code = CHILD.format(tests=str(TESTS_DIR), src=str(big_src), out=str(out), experts=experts, dense=dense)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=3600,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"\nconvert {report['source_bytes'] / 1e9:.2f} GB -> {report['output_bytes'] / 1e9:.2f} GB "
          f"({experts} experts, {dense} dense) in {report['seconds']:.0f} s incl. --verify, "
          f"peak RSS {report['peak_rss'] / 2**20:.0f} MiB")
    assert report["source_bytes"] >= 2 * 10**9
    assert report["experts"] == LAYERS * EXPERTS
    assert report["peak_rss"] < RSS_LIMIT, f"peak RSS {report['peak_rss'] / 2**20:.0f} MiB"
    assert max(report["max_ratio"].values()) <= 1.0
