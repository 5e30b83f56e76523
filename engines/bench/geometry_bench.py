"""colibri vs llama.cpp at DeepSeek-V3 / Kimi K2 expert geometry, truncated in depth (``nox -s bench_geometry``).

The model is DeepSeek-V3's real config.json (hidden 7168, 128 MLA heads, q_lora 1536, kv_lora 512, vocab 129280,
256 routed experts of width 2048 + 1 shared, top-8 in 8 groups keeping 4, e4m3 block-FP8 weights with 128x128
``weight_scale_inv``) cut to the dense first layer plus ``--moe-layers`` MoE layers at full width. Stages, each
cached under ``$COLIBRI_BENCH_CACHE/dsv3-trunc`` (default ``~/.cache/colibri/bench``) so reruns reuse them:

1. The FP8 checkpoint, deterministic from seeds, sharded like the release (the globals, each layer's non-expert
   weights, groups of 16 experts), every shard written as its real safetensors header plus a hole of the data's
   size. FP8 bytes are drawn as integers (no float sampling; exponent field 4..7, so never a NaN encoding, and a
   spread of about 15x like a trained matrix's bulk), scales per 128x128 block set for a 1/sqrt(fan-in) RMS.
2. colibri's container: ``coli convert --experts int4 --dense int4`` (the library call), fed through a reporter
   that generates each shard just before the converter reads it and punches it back to a hole once read, so
   about two shards are ever real (at most ~4.4 GB: the globals, embedding and LM head in bf16). Dense FP8
   matrices stay FP8 (the engine reads them natively), as the converter does for the real release. One expert
   per layer is then re-derived from its seed and checked byte for byte against the container.
3. llama.cpp's GGUF (its ``deepseek2`` architecture, Q4_0), written straight from the same seeds by a second
   process while the conversion runs: the metadata is what the sdist's own ``convert_hf_to_gguf.py
   --vocab-only`` writes for this checkpoint, the tensors are named
   and shaped as that converter's DeepseekV2Model emits them (experts stacked, ``kv_b_proj`` split into
   ``attn_k_b`` / ``attn_v_b``), and every FP8 matrix is quantized to Q4_0 from its codes (a Q4_0 block's 32
   values share one FP8 block scale, so the 4-bit levels depend on the codes alone; ggml's reference rounding).
   Routers and biases stay F32, as llama.cpp's quantizer leaves them; the LM head is Q4_0 too.
4. Runs under one cgroup v1 memory cap that holds colibri's dense weights plus a fraction of the experts
   (``--expert-share``): colibri (planning for the whole cap with `coli tune`'s profile of its container, as
   ``nox -s bench``; the disk bound is that profile's bandwidth at the engine's queue depth) and llama.cpp at readahead
   128 KiB and at the disk's own, engines alternated round by round, each run cold (page cache dropped), each
   with its load average and the other processes' CPU share. A 64-token prompt, then 32 teacher-forced decode
   steps.

Writes ``bench-results/geometry_bench.json`` and its own section of ``docs/benchmarks.md``. ``--quick`` runs the
same pipeline on a scaled-down geometry in a few minutes (``bench-results/geometry_bench_quick.json`` only; it
leaves the page cache and readahead alone, and its cap binds only colibri's own budget). ``--engines`` prepares
and runs one engine alone.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import multiprocessing
import os
import random
import shutil
import struct
import subprocess
import sys
import threading
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import stream_bench as sb
from machine_load import LoadWindow

ROOT, RESULTS = sb.ROOT, sb.RESULTS
SEED = 2024
FULL_DEPTH, FULL_MOE = 61, 58          # DeepSeek-V3: 61 layers, the first 3 dense
PROMPT_TOKENS, DECODE_TOKENS = 64, 32

# DeepSeek-V3's config.json (deepseek-ai/DeepSeek-V3); num_hidden_layers and first_k_dense_replace are set per run.
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "attention_bias": False,
    "attention_dropout": 0.0, "aux_loss_alpha": 0.001, "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1,
    "hidden_act": "silu", "hidden_size": 7168, "initializer_range": 0.02, "intermediate_size": 18432,
    "kv_lora_rank": 512, "max_position_embeddings": 163840, "moe_intermediate_size": 2048, "moe_layer_freq": 1,
    "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 128,
    "num_experts_per_tok": 8, "num_key_value_heads": 128, "num_nextn_predict_layers": 0, "pretraining_tp": 1,
    "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": True,
    "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
    "use_cache": True, "v_head_dim": 128, "vocab_size": 129280,
}
# --quick: the same schema scaled down (every width a multiple of 64 for int4-g64 and of 32 for Q4_0).
QUICK = {"hidden_size": 512, "intermediate_size": 1024, "moe_intermediate_size": 256, "n_routed_experts": 64,
         "num_attention_heads": 8, "num_key_value_heads": 8, "q_lora_rank": 192, "kv_lora_rank": 128,
         "qk_nope_head_dim": 64, "qk_rope_head_dim": 32, "v_head_dim": 64, "vocab_size": 4096,
         "max_position_embeddings": 4096,
         "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 4, "mscale": 1.0, "mscale_all_dim": 1.0,
                          "original_max_position_embeddings": 1024, "type": "yarn"}}


def log(msg: str) -> None:
    print(f"[geometry {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def model_config(quick: bool, moe_layers: int) -> dict:
    cfg = dict(DEEPSEEK_V3, **(QUICK if quick else {}))
    cfg.update(num_hidden_layers=1 + moe_layers, first_k_dense_replace=1)
    return cfg


# ---- 1. deterministic weights ------------------------------------------------------------------------------------

def _e4m3_values() -> np.ndarray:
    from colibri.convert.fp8_source import E4M3

    return E4M3


def _rng(name: str, part: int = 0) -> np.random.Generator:
    return np.random.default_rng([SEED, zlib.crc32(name.encode()), part])


def fp8_codes(name: str, rows: int, cols: int) -> np.ndarray:
    """e4m3 codes of a weight: random sign and mantissa, exponent field 4..7 (values 2^-6 .. 1.875, never NaN)."""
    r = np.frombuffer(bytearray(_rng(name).bytes(rows * cols)), dtype=np.uint8).reshape(rows, cols)
    exponent = (r >> 3) & 3
    exponent += 4
    r &= 0x87
    r |= exponent << 3
    return r


def _code_rms() -> float:
    codes = np.arange(256, dtype=np.uint8)
    allowed = ((codes >> 3) & 0xF) >= 4
    allowed &= ((codes >> 3) & 0xF) <= 7
    v = _e4m3_values()[codes[allowed]].astype(np.float64)
    return float(np.sqrt(np.mean(v * v)))


def fp8_scales(name: str, rows: int, cols: int, fan_in: int) -> np.ndarray:
    """F32 ``weight_scale_inv`` per 128x128 block: the weight's RMS near 1/sqrt(fan_in), +-25% per block."""
    grid = (-(-rows // 128), -(-cols // 128))
    jitter = _rng(name, 1).uniform(0.75, 1.25, grid)
    return (jitter * (fan_in ** -0.5 / _code_rms())).astype(np.float32)


BF16_ROWS = 2048     # bf16 matrices are drawn in blocks of rows, each from its own stream, so a part is cheap


def bf16_rows(name: str, shape: tuple[int, int], rms: float, r0: int = 0, r1: int | None = None) -> np.ndarray:
    """Rows [r0, r1) of a bf16 matrix as bit patterns: random sign and mantissa, an exponent within 4 octaves
    around ``rms``."""
    rows, cols = shape
    r1 = rows if r1 is None else r1
    base = 127 + int(math.floor(math.log2(rms))) - 2
    out = []
    for b in range(r0 // BF16_ROWS, -(-r1 // BF16_ROWS)):
        lo, hi = b * BF16_ROWS, min(rows, (b + 1) * BF16_ROWS)
        r = np.frombuffer(bytearray(_rng(name, 16 + b).bytes(2 * (hi - lo) * cols)), dtype="<u2")
        r = r.reshape(hi - lo, cols)
        exponent = (r >> 7) & 3
        exponent += base
        r &= 0x807F
        r |= exponent << 7
        out.append(r[max(r0, lo) - lo:min(r1, hi) - lo])
    return np.concatenate(out) if len(out) > 1 else out[0]


def norm_bits(name: str, count: int) -> np.ndarray:
    """bf16 norm weights in [1, 1.12)."""
    return (_rng(name).integers(0, 16, count, dtype=np.uint16) | 0x3F80).astype(np.uint16)


def dequantize(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    rows, cols = codes.shape
    full = np.repeat(np.repeat(scales, 128, axis=0), 128, axis=1)[:rows, :cols]
    return _e4m3_values()[codes] * full


@dataclass(frozen=True)
class Tensor:
    name: str
    dtype: str                      # safetensors dtype
    shape: tuple[int, ...]
    kind: str                       # fp8 | fp8_scale | bf16 | norm | bias
    fan_in: int = 1
    rms: float = 1.0
    weight_shape: tuple[int, int] = (0, 0)    # a scale tensor's weight

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * {"F8_E4M3": 1, "BF16": 2, "F32": 4}[self.dtype]

    def data(self) -> np.ndarray:
        if self.kind == "fp8":
            return fp8_codes(self.name, *self.shape)
        if self.kind == "fp8_scale":
            return fp8_scales(self.name[:-len("_scale_inv")], *self.weight_shape, self.fan_in)
        if self.kind == "bf16":
            return bf16_rows(self.name, self.shape, self.rms)
        if self.kind == "norm":
            return norm_bits(self.name, math.prod(self.shape))
        return (_rng(self.name).standard_normal(self.shape) * 0.01).astype(np.float32)



def fp8_pair(name: str, rows: int, cols: int) -> list[Tensor]:
    """A block-FP8 weight and its scales, as the release stores them."""
    grid = (-(-rows // 128), -(-cols // 128))
    return [Tensor(name, "F8_E4M3", (rows, cols), "fp8", cols),
            Tensor(name + "_scale_inv", "F32", grid, "fp8_scale", cols, weight_shape=(rows, cols))]


def dense_tensors(cfg: dict) -> list[Tensor]:
    H, V, E = cfg["hidden_size"], cfg["vocab_size"], cfg["n_routed_experts"]
    heads, nope, rope, vdim = (cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"],
                               cfg["v_head_dim"])
    qr, kvr, inter, moe = cfg["q_lora_rank"], cfg["kv_lora_rank"], cfg["intermediate_size"], \
        cfg["moe_intermediate_size"]
    out = [Tensor("model.embed_tokens.weight", "BF16", (V, H), "bf16", rms=1.0),
           Tensor("model.norm.weight", "BF16", (H,), "norm"),
           Tensor("lm_head.weight", "BF16", (V, H), "bf16", rms=H ** -0.5)]
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}"
        out += [Tensor(f"{p}.input_layernorm.weight", "BF16", (H,), "norm"),
                Tensor(f"{p}.post_attention_layernorm.weight", "BF16", (H,), "norm"),
                Tensor(f"{p}.self_attn.q_a_layernorm.weight", "BF16", (qr,), "norm"),
                Tensor(f"{p}.self_attn.kv_a_layernorm.weight", "BF16", (kvr,), "norm")]
        out += fp8_pair(f"{p}.self_attn.q_a_proj.weight", qr, H)
        out += fp8_pair(f"{p}.self_attn.q_b_proj.weight", heads * (nope + rope), qr)
        out += fp8_pair(f"{p}.self_attn.kv_a_proj_with_mqa.weight", kvr + rope, H)
        out += fp8_pair(f"{p}.self_attn.kv_b_proj.weight", heads * (nope + vdim), kvr)
        out += fp8_pair(f"{p}.self_attn.o_proj.weight", H, heads * vdim)
        if layer < cfg["first_k_dense_replace"]:
            out += fp8_pair(f"{p}.mlp.gate_proj.weight", inter, H) + fp8_pair(f"{p}.mlp.up_proj.weight", inter, H)
            out += fp8_pair(f"{p}.mlp.down_proj.weight", H, inter)
            continue
        shared = moe * cfg["n_shared_experts"]
        out += [Tensor(f"{p}.mlp.gate.weight", "BF16", (E, H), "bf16", rms=H ** -0.5),
                Tensor(f"{p}.mlp.gate.e_score_correction_bias", "F32", (E,), "bias")]
        out += fp8_pair(f"{p}.mlp.shared_experts.gate_proj.weight", shared, H)
        out += fp8_pair(f"{p}.mlp.shared_experts.up_proj.weight", shared, H)
        out += fp8_pair(f"{p}.mlp.shared_experts.down_proj.weight", H, shared)
    return out


def expert_names(layer: int, expert: int) -> list[str]:
    p = f"model.layers.{layer}.mlp.experts.{expert}"
    return [f"{p}.gate_proj.weight", f"{p}.up_proj.weight", f"{p}.down_proj.weight"]


def expert_tensors(cfg: dict, layer: int, experts: range) -> list[Tensor]:
    H, moe = cfg["hidden_size"], cfg["moe_intermediate_size"]
    out: list[Tensor] = []
    for e in experts:
        gate, up, down = expert_names(layer, e)
        out += fp8_pair(gate, moe, H) + fp8_pair(up, moe, H) + fp8_pair(down, H, moe)
    return out


def shard_header(tensors: list[Tensor]) -> tuple[bytes, dict[str, tuple[int, int]]]:
    """The safetensors header bytes and each tensor's absolute (offset, size) in the file."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for t in tensors:
        header[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    head = struct.pack("<Q", len(raw)) + raw
    return head, {t.name: (len(head) + header[t.name]["data_offsets"][0], t.nbytes) for t in tensors}


def write_tensors(fh, tensors: list[Tensor], places: dict[str, tuple[int, int]]) -> None:
    for t in tensors:
        data = np.ascontiguousarray(t.data())
        assert data.nbytes == t.nbytes, t.name
        fh.seek(places[t.name][0])
        fh.write(data.tobytes())


def punch(path: Path) -> None:
    """Turn a safetensors file back into its header and a hole of the same size, in place (a reader's open
    descriptor stays valid)."""
    size = path.stat().st_size
    with open(path, "rb") as fh:
        head_len = 8 + int.from_bytes(fh.read(8), "little")
    os.truncate(path, head_len)
    os.truncate(path, size)


class GeneratedSource:
    """The checkpoint's shards, each its real safetensors header and a hole of the data's size, made real just
    before the converter reads them and punched back to a hole after. Each keeps its first modification time, so
    an interrupted conversion resumes (the converter checks that its source shards did not change)."""

    STAMPS = ".colibri-bench-stamps.json"

    def __init__(self, directory: Path, shards: dict[str, list[Tensor]]):
        self.dir, self.groups = directory, shards
        self.stamps = json.loads((directory / self.STAMPS).read_text())
        self.peak_real_bytes = 0

    def path(self, name: str) -> Path:
        return self.dir / name

    def is_real(self, name: str) -> bool:
        st = self.path(name).stat()
        return st.st_blocks * 512 >= st.st_size // 2

    def _restamp(self, name: str) -> None:
        ns = int(self.stamps[name])
        os.utime(self.path(name), ns=(ns, ns))

    def fill(self, name: str) -> None:
        if self.is_real(name):
            return
        tensors = self.groups[name]
        _, places = shard_header(tensors)
        with open(self.path(name), "r+b") as fh:
            write_tensors(fh, tensors, places)
        self._restamp(name)
        self.peak_real_bytes = max(self.peak_real_bytes, self.real_bytes())

    def release(self, name: str) -> None:
        if self.is_real(name):
            punch(self.path(name))
            self._restamp(name)

    def real_bytes(self) -> int:
        return sum(self.path(n).stat().st_blocks * 512 for n in self.groups)


def checkpoint_shards(cfg: dict, group_size: int) -> dict[str, list[Tensor]]:
    """The release-like sharding: the globals, each layer's non-expert weights, and groups of experts."""
    dense = dense_tensors(cfg)
    shards = {"model-globals.safetensors": [t for t in dense if not t.name.startswith("model.layers.")]}
    E = cfg["n_routed_experts"]
    for layer in range(cfg["num_hidden_layers"]):
        prefix = f"model.layers.{layer}."
        shards[f"model-L{layer:02d}-dense.safetensors"] = [t for t in dense if t.name.startswith(prefix)]
        if layer < cfg["first_k_dense_replace"]:
            continue
        for first in range(0, E, group_size):
            shards[f"model-L{layer:02d}-E{first:03d}.safetensors"] = expert_tensors(
                cfg, layer, range(first, min(E, first + group_size)))
    return shards


def build_checkpoint(out: Path, cfg: dict, group_size: int) -> GeneratedSource:
    """The FP8 checkpoint as headers and holes (GeneratedSource makes each shard real when it is read)."""
    shards = checkpoint_shards(cfg, group_size)
    if not (out / "config.json").is_file():
        out.mkdir(parents=True, exist_ok=True)
        stamps, weight_map = {}, {}
        for name, tensors in shards.items():
            head, _ = shard_header(tensors)
            tmp = out / f".{name}.tmp"
            with open(tmp, "wb") as fh:
                fh.write(head)
                fh.truncate(len(head) + sum(t.nbytes for t in tensors))
            os.replace(tmp, out / name)
            stamps[name] = (out / name).stat().st_mtime_ns
            weight_map.update({t.name: name for t in tensors})
        (out / GeneratedSource.STAMPS).write_text(json.dumps(stamps))
        total = sum(t.nbytes for tensors in shards.values() for t in tensors)
        (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                      "weight_map": weight_map}))
        from colibri.testing.tiny import train_tokenizer

        train_tokenizer(out, "deepseek_v3")
        (out / "config.json").write_text(json.dumps(cfg, indent=1))
    return GeneratedSource(out, shards)


# ---- 2. colibri's container --------------------------------------------------------------------------------------

class WindowReporter:
    """convert's reporter: keeps the expert shard being read and the next one real, the spent ones holes.

    The converter reads an output shard's items in order and reports each chunk's source bytes, so the running sum
    says where it reads next; a shard is made real before that position reaches it."""

    def __init__(self, source: GeneratedSource, plan):
        self.source = source
        self.spans: list[list[tuple[int, int, str]]] = []
        for shard in plan.shards:
            pos, spans = 0, {}
            for item in shard.items:
                name = item.source.file.name
                if name in source.groups:
                    start, _ = spans.get(name, (pos, pos))
                    spans[name] = (start, pos + item.source.nbytes)
                pos += item.source.nbytes
            self.spans.append(sorted((a, b, n) for n, (a, b) in spans.items()))
        self.current: list[tuple[int, int, str]] = []
        self.pos, self.last_log = 0, 0.0

    def start(self, total_bytes: int, shards: int) -> None:
        self.total = total_bytes

    def shard(self, plan, resumed: bool) -> None:
        self.current = [] if resumed else self.spans[plan.index - 1]
        self.pos = 0
        log(f"convert: {plan.label}{' (done earlier)' if resumed else ''}")
        self._window()

    def advance(self, nbytes: int) -> None:
        self.pos += nbytes
        if self.current:
            self._window()

    def _window(self) -> None:
        ahead = [n for _, b, n in self.current if b > self.pos][:2]
        for _, b, n in self.current:
            if b <= self.pos:
                self.source.release(n)
        for n in ahead:
            self.source.fill(n)

    def finish(self) -> None:
        for n in self.source.groups:
            self.source.release(n)


def ensure_container(src: Path, source: GeneratedSource, out: Path) -> Path:
    if (out / "config.json").is_file():
        return out
    from colibri.convert.run import convert, make_plan
    from colibri.model import resolve_model

    model = resolve_model(str(src), None)
    plan, _ = make_plan(model, "int4", "int4")
    t = time.perf_counter()
    result = convert(model, out, experts="int4", dense="int4", reporter=WindowReporter(source, plan))
    log(f"container: {result.output_bytes / 1e9:.2f} GB in {time.perf_counter() - t:.0f} s, peak real FP8 "
        f"source {source.peak_real_bytes / 1e9:.2f} GB")
    return out


def check_container(container: Path, cfg: dict, every: int, projections: int = 3) -> int:
    """Every ``every``-th expert (``every`` = the group size: the first of each source shard, so every shard the
    reporter generated, which it writes whole, is covered), its first ``projections`` matrices re-derived from
    their seeds and quantized by colibri's scheme, must equal the container's bytes: a shard read while still a
    hole would not. Returns the number of matrices checked."""
    from colibri.convert.container import qweight_name, scales_name
    from colibri.convert.schemes import INT4, quantize

    index = json.loads((container / "model.safetensors.index.json").read_text())["weight_map"]
    H, moe = cfg["hidden_size"], cfg["moe_intermediate_size"]
    checked = 0
    for layer in range(cfg["first_k_dense_replace"], cfg["num_hidden_layers"]):
        for e in range(0, cfg["n_routed_experts"], every):
            for which, name in enumerate(expert_names(layer, e)[:projections]):
                rows, cols = (moe, H) if which < 2 else (H, moe)
                q, s = quantize(INT4, dequantize(fp8_codes(name, rows, cols), fp8_scales(name, rows, cols, cols)))
                stored = read_tensor(container / index[qweight_name(name)], qweight_name(name))
                scales = read_tensor(container / index[scales_name(name)], scales_name(name))
                if stored != q.tobytes() or scales != s.astype("<f2").tobytes():
                    raise RuntimeError(f"{container}: {name} differs from its regenerated source")
                checked += 1
    return checked


def read_tensor(path: Path, name: str) -> bytes:
    with open(path, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        header = json.loads(fh.read(n))
        a, b = header[name]["data_offsets"]
        fh.seek(8 + n + a)
        return fh.read(b - a)


# ---- 3. llama.cpp's GGUF -----------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=1)
def q4_table() -> np.ndarray:
    """[block max code, code] -> Q4_0 level, ggml's reference rounding: min(15, (int8)(x * (1 / (max / -8)) + 8.5))."""
    v = _e4m3_values().astype(np.float32)
    d = v / np.float32(-8)
    inv = np.where(d != 0, np.float32(1) / np.where(d != 0, d, 1), 0).astype(np.float32)
    x = (v[None, :] * inv[:, None]).astype(np.float32) + np.float32(8.5)
    return np.minimum(15, np.trunc(np.nan_to_num(x)).astype(np.int8)).astype(np.uint8).ravel()


def q4_0_of_fp8(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Q4_0 blocks ([rows, cols / 32, 18]: f16 d, 16 bytes of nibbles) of a block-FP8 matrix, from its codes."""
    rows, cols = codes.shape
    nb = cols // 32
    blocks = codes.reshape(rows, nb, 32)
    peak = np.take_along_axis(blocks, (blocks & 0x7F).argmax(axis=2)[..., None], axis=2)[..., 0]
    q = q4_table()[(peak.astype(np.uint16) << 8)[..., None] | blocks]
    block_scale = np.repeat(np.repeat(scales, 4, axis=1)[:, :nb], 128, axis=0)[:rows]
    d = (_e4m3_values()[peak] * block_scale / np.float32(-8)).astype("<f2")
    out = np.empty((rows, nb, 18), dtype=np.uint8)
    out[..., :2] = d.view(np.uint8).reshape(rows, nb, 2)
    out[..., 2:] = q[..., :16] | (q[..., 16:] << 4)
    return out


def llama_sources() -> Path:
    """The llama.cpp tree vendored in the llama-cpp-python sdist (its converter, gguf-py and libllama), ready for
    the runners (stream_bench.LLAMA_ENV)."""
    return sb.ensure_llama_cpp()


def gguf_module(llama: Path):
    sys.path.insert(0, str(llama / "gguf-py"))
    import gguf

    return gguf


VOCAB_SHIM = """
import runpy, sys
sys.path.insert(0, {llama!r})
sys.path.insert(0, {llama!r} + '/gguf-py')
import conversion.base as base
# The checkpoint's tokenizer is trained offline, so llama.cpp's table of pre-tokenizer hashes cannot know it; the
# token ids are fed directly, so it is declared GPT-2 style (byte-level BPE).
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: 'gpt-2'
sys.argv = ['convert_hf_to_gguf.py', {model!r}, '--vocab-only', '--outtype', 'q8_0', '--outfile', {out!r}]
runpy.run_path({llama!r} + '/convert_hf_to_gguf.py', run_name='__main__')
"""


def q4_bytes(shape: tuple[int, ...]) -> int:
    return math.prod(shape) // 32 * 18


# (GGUF name, numpy shape, "q4_0" | "f32", parts): each part (bytes, callable returning that many bytes as numpy)
GgufTensor = tuple[str, tuple[int, ...], str, list[tuple[int, object]]]


def gguf_plan(gguf, cfg: dict) -> list[GgufTensor]:
    """Every tensor in the order convert_hf_to_gguf emits them, each cut into independent parts (an expert, a
    stretch of embedding rows) that a pool of processes can produce in any order."""
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.DEEPSEEK2, cfg["num_hidden_layers"])
    heads, nope, vdim, kvr = (cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["v_head_dim"],
                              cfg["kv_lora_rank"])
    by_name = {t.name: t for t in dense_tensors(cfg)}

    def gname(hf: str) -> str:
        got = names.get_name(hf.replace("e_score_correction_bias", "e_score_correction.bias"),
                             try_suffixes=(".weight", ".bias"))
        if got is None:
            raise RuntimeError(f"no GGUF name for {hf}")
        return got

    def fp8(hf: str) -> GgufTensor:
        t = by_name[hf]
        return gname(hf), t.shape, "q4_0", [(q4_bytes(t.shape), lambda: q4_0_of_fp8(
            t.data(), by_name[hf + "_scale_inv"].data()))]

    def floats(hf: str) -> GgufTensor:
        t = by_name[hf]
        if t.dtype == "BF16":
            return gname(hf), t.shape, "f32", [(4 * math.prod(t.shape), lambda: (
                t.data().astype(np.uint32) << 16).view(np.float32))]
        return gname(hf), t.shape, "f32", [(4 * math.prod(t.shape), t.data)]

    def bf16_q4(hf: str, name: str) -> GgufTensor:
        t = by_name[hf]
        rows, cols = t.shape
        step = BF16_ROWS

        def part(r: int):
            bits = bf16_rows(t.name, t.shape, t.rms, r, min(rows, r + step))
            return gguf.quants.quantize((bits.astype(np.uint32) << 16).view(np.float32),
                                        gguf.GGMLQuantizationType.Q4_0)
        return name, t.shape, "q4_0", [(q4_bytes((min(step, rows - r), cols)), functools.partial(part, r))
                                       for r in range(0, rows, step)]

    def kv_b(hf: str, part: str, name: str) -> GgufTensor:
        shape = (heads, kvr, nope) if part == "k" else (heads, vdim, kvr)

        def make():
            x = dequantize(by_name[hf].data(), by_name[hf + "_scale_inv"].data()).reshape(heads, nope + vdim, kvr)
            y = np.ascontiguousarray(x[:, :nope].transpose(0, 2, 1) if part == "k" else x[:, nope:])
            return gguf.quants.quantize(y, gguf.GGMLQuantizationType.Q4_0)
        return name, shape, "q4_0", [(q4_bytes(shape), make)]

    def experts(layer: int, which: int, name: str) -> GgufTensor:
        E, H, moe = cfg["n_routed_experts"], cfg["hidden_size"], cfg["moe_intermediate_size"]
        rows, cols = (moe, H) if which < 2 else (H, moe)

        def part(e: int):
            weight = expert_names(layer, e)[which]
            return q4_0_of_fp8(fp8_codes(weight, rows, cols), fp8_scales(weight, rows, cols, cols))
        return name, (E, rows, cols), "q4_0", [(q4_bytes((rows, cols)), functools.partial(part, e)) for e in range(E)]

    plan = [bf16_q4("model.embed_tokens.weight", "token_embd.weight")]
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}"
        plan += [floats(f"{p}.{n}.weight") for n in ("input_layernorm", "post_attention_layernorm",
                                                      "self_attn.q_a_layernorm", "self_attn.kv_a_layernorm")]
        plan += [fp8(f"{p}.self_attn.{proj}.weight") for proj in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa",
                                                                   "o_proj")]
        kv = f"{p}.self_attn.kv_b_proj.weight"
        plan += [kv_b(kv, "k", gname(f"{p}.self_attn.k_b_proj.weight")),
                 kv_b(kv, "v", gname(f"{p}.self_attn.v_b_proj.weight"))]
        if layer < cfg["first_k_dense_replace"]:
            plan += [fp8(f"{p}.mlp.{proj}.weight") for proj in ("gate_proj", "up_proj", "down_proj")]
            continue
        plan += [floats(f"{p}.mlp.gate.weight"), floats(f"{p}.mlp.gate.e_score_correction_bias")]
        plan += [fp8(f"{p}.mlp.shared_experts.{proj}.weight") for proj in ("gate_proj", "up_proj", "down_proj")]
        plan += [experts(layer, which, gname(f"{p}.mlp.experts.{proj}.weight"))
                 for which, proj in enumerate(("gate_proj", "up_proj", "down_proj"))]
    plan += [floats("model.norm.weight"), bf16_q4("lm_head.weight", "output.weight")]
    return plan


_GGUF_TASKS: list[tuple[int, int, object]] = []     # (offset, bytes, producer); inherited by the forked pool


def _write_part(task: tuple[str, int]) -> int:
    path, i = task
    offset, nbytes, make = _GGUF_TASKS[i]
    data = np.ascontiguousarray(make())
    if data.nbytes != nbytes:
        raise RuntimeError(f"GGUF part {i}: {data.nbytes} bytes, planned {nbytes}")
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, data.tobytes(), offset)
    finally:
        os.close(fd)
    return nbytes


def ensure_gguf(llama: Path, src: Path, cfg: dict, out: Path) -> Path:
    """The GGUF: metadata from the sdist's converter (--vocab-only), tensor data produced by a pool of processes
    (one per core), each part written at its place; the file appears under its name only when whole."""
    if out.is_file():
        return out
    gguf = gguf_module(llama)
    vocab = out.with_suffix(".vocab.gguf")
    subprocess.run([sys.executable, "-c", VOCAB_SHIM.format(llama=str(llama), model=str(src), out=str(vocab))],
                   check=True, capture_output=True)
    reader = gguf.GGUFReader(vocab)
    writer = gguf.GGUFWriter(None, "deepseek2")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in ("general.architecture", "general.file_type"):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0)
    plan = gguf_plan(gguf, cfg)
    for name, shape, kind, parts in plan:
        nbytes = sum(n for n, _ in parts)
        assert nbytes == (q4_bytes(shape) if kind == "q4_0" else 4 * math.prod(shape)), name
        writer.add_tensor_info(name, shape, np.dtype(np.float32), nbytes,
                               raw_dtype=gguf.GGMLQuantizationType.Q4_0 if kind == "q4_0" else None)
    tmp = out.with_suffix(".tmp")
    writer.write_header_to_file(path=tmp)
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    fout = writer.fout[0]
    offset = writer.ggml_pad(fout.tell(), writer.data_alignment)
    _GGUF_TASKS.clear()
    for _, _, _, parts in plan:
        start = offset
        for nbytes, make in parts:
            _GGUF_TASKS.append((offset, nbytes, make))
            offset += nbytes
        offset = start + writer.ggml_pad(offset - start, writer.data_alignment)
    writer.close()
    os.truncate(tmp, offset)
    t = time.perf_counter()
    with multiprocessing.get_context("fork").Pool(os.cpu_count() or 2) as pool:
        for _ in pool.imap_unordered(_write_part, [(str(tmp), i) for i in range(len(_GGUF_TASKS))]):
            pass
    fd = os.open(tmp, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
    os.replace(tmp, out)
    vocab.unlink()
    log(f"GGUF Q4_0: {out.stat().st_size / 1e9:.2f} GB in {time.perf_counter() - t:.0f} s")
    return out


def q4_agreement(llama: Path, cfg: dict) -> float:
    """Share of Q4_0 bytes where the code-table quantizer differs from gguf-py's on the dequantized floats."""
    gguf = gguf_module(llama)
    name = expert_names(cfg["first_k_dense_replace"], 0)[2]
    rows, cols = cfg["hidden_size"], cfg["moe_intermediate_size"]
    codes, scales = fp8_codes(name, rows, cols), fp8_scales(name, rows, cols, cols)
    ours = q4_0_of_fp8(codes, scales).reshape(rows, -1)
    ref = gguf.quants.quantize(dequantize(codes, scales), gguf.GGMLQuantizationType.Q4_0)
    return float(np.mean(ours != ref))


# ---- 4. runs -----------------------------------------------------------------------------------------------------

def workload(vocab: int, seed: int = 1234) -> tuple[list[int], list[int]]:
    rng = random.Random(seed)
    draw = [rng.randrange(2, vocab) for _ in range(PROMPT_TOKENS + DECODE_TOKENS)]
    return draw[:PROMPT_TOKENS], draw[PROMPT_TOKENS:]


def run_colibri(container: Path, cfg: dict, ram: int, group, tune: object = None) -> dict:
    from colibri import launch
    from colibri.engine import Engine
    from colibri.model import resolve_model

    spec = launch.prepare(resolve_model(str(container), None), ram_gib=ram / launch.GIB, ctx=256, threads=2,
                          streaming=launch.Streaming(), tune=tune)
    prompt, forced = workload(cfg["vocab_size"])
    t = time.perf_counter()
    with Engine(group.wrap(list(spec.argv)), env=spec.env, ready_timeout=3600) as eng:
        load_s = time.perf_counter() - t
        with LoadWindow((eng.proc.pid,)) as window:
            result = eng.generate(prompt, max_tokens=DECODE_TOKENS, forced=forced)
        rss = sb.peak_rss(eng.proc.pid)
    stats = dict(result.stats)
    stats.update({"load_s": load_s, "peak_rss_bytes": rss, "cap": int(spec.argv[spec.argv.index("--cap") + 1]),
                  "routed_bytes_per_token": spec.plan.routed_bytes_per_token,
                  "load_average": window.load_average, "other_cpu_share": window.other_cpu_share})
    return stats


# llama.cpp's CPU backend repacks Q4_0 weights into its own layout at load (extra buffer types), which copies every
# weight into anonymous memory: under a cap below the model that is an OOM kill. `--no-repack` (use_extra_bufts
# false) keeps the weights in the mmap, as a llama.cpp user streaming a model larger than RAM must.
NO_REPACK = """
import llama_cpp.llama_cpp as _c
_defaults = _c.llama_model_default_params
def _no_repack():
    params = _defaults()
    params.use_extra_bufts = False
    return params
_c.llama_model_default_params = _no_repack
"""


def run_llama(gguf_path: Path, cfg: dict, group, env: dict[str, str]) -> dict:
    prompt, forced = workload(cfg["vocab_size"])
    argv = [sys.executable, "-c", NO_REPACK + sb.LLAMA_RUNNER, str(gguf_path), json.dumps(prompt),
            json.dumps(forced)]
    proc = subprocess.Popen(group.wrap(argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **env})
    streams: dict[str, str] = {}
    readers = [threading.Thread(target=lambda k=k, f=f: streams.__setitem__(k, f.read()))
               for k, f in (("out", proc.stdout), ("err", proc.stderr))]
    with LoadWindow((proc.pid,)) as window:
        for t in readers:
            t.start()
        for t in readers:
            t.join(7200)
        # the window closes while the runner is an unreaped zombie: its CPU ticks are still readable
        os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)
    proc.wait()
    out, err = streams.get("out", ""), streams.get("err", "")
    if proc.returncode != 0:
        return {"error": err.strip().splitlines()[-1] if err.strip() else f"exit {proc.returncode}"}
    stats = json.loads(out.strip().splitlines()[-1])
    stats.update({"load_average": window.load_average, "other_cpu_share": window.other_cpu_share})
    return stats


def bytes_by_role(named: list[tuple[str, int]], cfg: dict) -> dict[str, int]:
    """Container bytes by role: routed experts, everything else, the embedding (only gathered per token), and the
    non-expert weights of the dense layer 0 and of the first MoE layer."""
    out = dict.fromkeys(("experts", "other", "embedding", "dense_layer", "moe_layer"), 0)
    moe_prefix = f"model.layers.{cfg['first_k_dense_replace']}."
    for name, size in named:
        expert = ".mlp.experts." in name
        out["experts" if expert else "other"] += size
        if name.startswith("model.embed_tokens."):
            out["embedding"] += size
        elif name.startswith("model.layers.0."):
            out["dense_layer"] += size
        elif name.startswith(moe_prefix) and not expert:
            out["moe_layer"] += size
    return out


def container_sizes(src: Path, cfg: dict) -> dict[str, int]:
    """What the container of ``src`` holds, by role, from the conversion's plan (the same with or without the
    container on disk)."""
    from colibri.convert.run import make_plan
    from colibri.model import resolve_model

    plan, _ = make_plan(resolve_model(str(src), None), "int4", "int4")
    return bytes_by_role([(p.name, p.nbytes) for sh in plan.shards for it in sh.items for p in it.parts], cfg)


def measure_disk(files: list[Path]) -> dict:
    """Sequential O_DIRECT bandwidth on the benchmark's own files (the two largest), at queue depth 1 and with 4
    readers, each after dropping the page cache; the bound uses the better."""
    first, second = (sorted(files, key=lambda f: f.stat().st_size) * 2)[-2:]
    sb.drop_caches()
    qd1 = sb.disk_bandwidth(first)
    sb.drop_caches()
    qd4 = sb.disk_bandwidth(second, readers=4)
    log(f"disk: {qd1 / 1e9:.2f} GB/s at queue depth 1, {qd4 / 1e9:.2f} GB/s with 4 readers")
    return {"disk_bandwidth": max(qd1, qd4), "disk_bandwidth_qd1": qd1, "disk_bandwidth_4_readers": qd4,
            "disk_measured_on": [first.name, second.name]}


def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def needed_bytes(cfg: dict, group_size: int) -> int:
    """Peak disk: while converting, the FP8 dense shard, two expert shards and the container (dense FP8 at 1 B per
    parameter, the rest int4-g64 at 0.53); then the container and the GGUF (Q4_0, 0.5625)."""
    dense = dense_tensors(cfg)
    fp8 = sum(math.prod(t.shape) for t in dense if t.kind == "fp8")
    floats = sum(math.prod(t.shape) for t in dense if t.kind == "bf16")
    H, moe, E = cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["n_routed_experts"]
    experts = (cfg["num_hidden_layers"] - cfg["first_k_dense_replace"]) * E * 3 * H * moe
    container = fp8 + (floats + experts) * 0.53
    converting = fp8 + 2 * floats + 2 * group_size * 3 * H * moe + container
    return int(max(converting, container + (fp8 + floats + experts) * 0.5625))


def prepare(args, cfg: dict, tag: str) -> dict:
    """Build what the selected engines need (cached); returns the paths and the preparation's checks."""
    cache = sb.CACHE / "dsv3-trunc"
    cache.mkdir(parents=True, exist_ok=True)
    group_size = 16
    src_dir, container, gguf_path = cache / f"{tag}-fp8", cache / f"{tag}-int4", cache / f"{tag}-q4_0.gguf"
    want_colibri, want_llama = "colibri" in args.engines, "llama.cpp" in args.engines
    if (want_colibri and not (container / "config.json").is_file()) or (want_llama and not gguf_path.is_file()):
        need, free = needed_bytes(cfg, group_size), free_bytes(cache)
        if need + (4 << 30) > free:
            raise SystemExit(f"error: {tag} needs {need / 1e9:.1f} GB of disk (+4 GiB margin) under {cache}; "
                             f"{free / 1e9:.1f} GB free (lower --moe-layers, or free space)")
    t0 = time.perf_counter()
    source = build_checkpoint(src_dir, cfg, group_size)
    out: dict = {"container": container, "gguf": gguf_path, "container_by_role": container_sizes(src_dir, cfg)}
    llama = llama_sources()
    # The GGUF comes from the seeds, not from the source files: it is written beside the conversion, in a
    # process of its own (the two share nothing but the checkpoint's headers).
    gguf_job = None
    if want_llama and not gguf_path.is_file():
        gguf_job = multiprocessing.get_context("fork").Process(target=ensure_gguf,
                                                                args=(llama, src_dir, cfg, gguf_path))
        gguf_job.start()
    if want_colibri:
        ensure_container(src_dir, source, container)
        out["container_matrices_checked"] = (check_container(container, cfg, 4, 3) if args.quick else
                                             check_container(container, cfg, group_size, 1))
        log(f"container: {out['container_matrices_checked']} expert matrices equal their regenerated source")
    if gguf_job is not None:
        gguf_job.join()
        if gguf_job.exitcode != 0:
            raise SystemExit(f"error: writing {gguf_path} failed (exit {gguf_job.exitcode})")
    if want_llama:
        out["runner_env"] = sb.llama_env(llama)
        out["q4_0_differs_from_gguf_py"] = q4_agreement(llama, cfg)
    out["prepare_s"] = time.perf_counter() - t0
    if not args.keep_fp8 and (container / "config.json").is_file() and gguf_path.is_file():
        shutil.rmtree(src_dir)     # the FP8 shards are holes by now; the container and GGUF stay cached
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the scaled-down geometry (about a minute)")
    ap.add_argument("--moe-layers", type=int, default=2, help="MoE layers after the dense first one (default 2)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of alternated runs (default 3)")
    ap.add_argument("--expert-share", type=float, default=0.25,
                    help="share of the routed experts the cap holds beyond the dense weights (default 0.25)")
    ap.add_argument("--engines", default="colibri,llama.cpp",
                    help="comma-separated engines to prepare and run (default colibri,llama.cpp)")
    ap.add_argument("--keep-fp8", action="store_true", help="keep the (sparse) FP8 checkpoint after the runs")
    args = ap.parse_args(argv)
    args.engines = [e for e in args.engines.split(",") if e]
    if args.moe_layers < 1 or args.rounds < 1 or not 0 < args.expert_share < 1:
        ap.error("--moe-layers and --rounds must be >= 1 and --expert-share within (0, 1)")
    if not args.engines or set(args.engines) - {"colibri", "llama.cpp"}:
        ap.error("--engines: a comma-separated subset of colibri,llama.cpp")
    cfg = model_config(args.quick, args.moe_layers)
    tag = f"{'quick' if args.quick else 'full'}-{args.moe_layers}moe"
    RESULTS.mkdir(exist_ok=True)
    prep = prepare(args, cfg, tag)
    container, gguf_path, sizes = prep["container"], prep["gguf"], prep["container_by_role"]
    e_bytes, dense_bytes = sizes["experts"], sizes["other"]
    reserve = 512 << 20     # the engine's own memory beyond weights
    cap = int(dense_bytes + reserve + args.expert_share * e_bytes)
    colibri_ram = cap      # the planner's reserve is what the engine allocates beyond tensors, KV and cache
    if args.quick:
        # the quick model is smaller than a Python process running llama.cpp: the group gets room for that, and
        # colibri's own budget (its planner's reserve is ~66 MiB) is what makes it stream
        colibri_ram = int(dense_bytes + (68 << 20) + args.expert_share * e_bytes)
        cap = max(cap, 1 << 30)
    disk = sb.root_disk()
    original_ra = int(sb.readahead_file(disk).read_text()) if sb.readahead_file(disk).is_file() else 0
    files = [*container.glob("*.safetensors")] if "colibri" in args.engines else [gguf_path]
    # --quick is a smoke test that may run beside another benchmark: it leaves the machine-wide state (page
    # cache, the disk's readahead) alone, so its runs are warm and llama.cpp runs at the disk's readahead only
    touch_machine = not args.quick
    profile = None
    if touch_machine:
        bandwidth = measure_disk(files)
        if "colibri" in args.engines:   # every colibri run uses the profile, as `coli run` would
            profile, tuned = sb.run_tune(container)
            bandwidth.update({"disk_bandwidth": tuned["disk_bandwidth"], "tune": tuned})
    else:
        bw = sb.disk_bandwidth(max(files, key=lambda f: f.stat().st_size))
        bandwidth = {"disk_bandwidth": bw, "disk_bandwidth_qd1": bw, "disk_measured_on": ["its largest file"]}
    readaheads = sorted({128, original_ra}) if touch_machine else [original_ra]
    results = {"machine": sb.machine(), "config": cfg, "tag": tag, "quick": args.quick, "engines": args.engines,
               "moe_layers": args.moe_layers, "prompt_tokens": PROMPT_TOKENS, "decode_tokens": DECODE_TOKENS,
               "container_bytes": e_bytes + dense_bytes, "container_expert_bytes": e_bytes,
               "container_dense_bytes": dense_bytes, "container_by_role": sizes, "reserve_bytes": reserve,
               "colibri_ram_bytes": colibri_ram,
               "gguf_bytes": gguf_path.stat().st_size if gguf_path.is_file() else None, "cap_bytes": cap,
               "expert_share": args.expert_share, "disk": disk, **bandwidth,
               **{k: v for k, v in prep.items() if k in ("q4_0_differs_from_gguf_py", "container_matrices_checked",
                                                          "prepare_s")}, "runs": []}
    group = sb.CappedGroup(cap, "geometry")
    try:
        for r in range(args.rounds):
            order = [("colibri", original_ra)] * ("colibri" in args.engines) + \
                [("llama.cpp", ra) for ra in readaheads] * ("llama.cpp" in args.engines)
            if r % 2:
                order.reverse()
            for engine, ra in order:
                if touch_machine:
                    sb.set_readahead(disk, ra)
                    sb.drop_caches()
                log(f"round {r + 1}/{args.rounds}: {engine} readahead {ra} KiB, cap {cap / 2**30:.2f} GiB")
                try:
                    stats = (run_colibri(container, cfg, colibri_ram, group, profile) if engine == "colibri"
                             else run_llama(gguf_path, cfg, group, prep["runner_env"]))
                except Exception as exc:   # one failed run must not lose the others
                    stats = {"error": f"{type(exc).__name__}: {exc}"}
                log(json.dumps(stats)[:300])
                results["runs"].append({"engine": engine, "round": r, "readahead_kb": ra, **stats})
                results_file(results).write_text(json.dumps(results, indent=1, default=str))
    finally:
        if touch_machine:
            sb.set_readahead(disk, original_ra)
        group.close()
    report(results)
    os.sync()
    log(f"disk free after: {free_bytes(sb.CACHE) / 1e9:.1f} GB")
    return 0


# ---- 5. report ---------------------------------------------------------------------------------------------------

def decode_ms(run: dict) -> float:
    return 1000.0 / run["decode_tps"]


def median_of(runs: list[dict]) -> dict | None:
    ok = sorted((r for r in runs if "decode_tps" in r), key=lambda r: r["decode_tps"])
    return ok[(len(ok) - 1) // 2] if ok else None


def colibri_split(run: dict, cfg: dict) -> dict:
    """Per decode token: the routed-expert time per MoE layer (I/O wait + expert matmuls, from done.decode) and
    the rest (attention, dense and shared MLPs, routers, LM head)."""
    d = run.get("decode") or run
    steps = max(1, d.get("steps", DECODE_TOKENS))
    n_moe = cfg["num_hidden_layers"] - cfg["first_k_dense_replace"]
    moe_s = (d.get("io_wait_s", 0) + d.get("expert_s", 0)) / steps
    return {"moe_layer_ms": 1000 * moe_s / n_moe, "rest_ms": decode_ms(run) - 1000 * moe_s,
            "bytes_per_token": d.get("bytes_read", 0) / steps, "hit_rate": float(d.get("hit_rate", 0))}


def missing_rest_ms(results: dict, rest_ms: float) -> float:
    """The non-expert time the layers cut away would add, at the measured rate per byte of resident weights (decode
    matmuls stream their weights from RAM): 2 more dense layers and the missing MoE layers' attention, shared
    expert and router."""
    cfg, by_role = results["config"], results["container_by_role"]
    n_moe = cfg["num_hidden_layers"] - cfg["first_k_dense_replace"]
    touched = by_role["other"] - by_role["embedding"]     # the embedding is one row per token
    missing = (FULL_DEPTH - FULL_MOE - cfg["first_k_dense_replace"]) * by_role["dense_layer"] + \
        (FULL_MOE - n_moe) * by_role["moe_layer"]
    return rest_ms * missing / touched


def summarize(results: dict) -> dict:
    cfg = results["config"]
    n_moe = cfg["num_hidden_layers"] - cfg["first_k_dense_replace"]
    runs = results["runs"]
    col = median_of([r for r in runs if r["engine"] == "colibri"])
    per_ra = {ra: median_of([r for r in runs if r["engine"] == "llama.cpp" and r["readahead_kb"] == ra])
              for ra in sorted({r["readahead_kb"] for r in runs if r["engine"] == "llama.cpp"})}
    llama = max((r for r in per_ra.values() if r), key=lambda r: r["decode_tps"], default=None)
    out: dict = {"n_moe": n_moe, "colibri": col, "llama": llama, "llama_by_readahead": per_ra}
    bw = results["disk_bandwidth"]
    if llama:
        out["llama_bytes_per_token"] = llama.get("bytes_read_decode", 0) / DECODE_TOKENS
        out["llama_token_over_moe_ms"] = decode_ms(llama) / n_moe   # an upper bound of its per-MoE-layer time
    if col:
        split = colibri_split(col, cfg)
        extra_moe, extra_rest = FULL_MOE - n_moe, missing_rest_ms(results, split["rest_ms"])
        routed = col["routed_bytes_per_token"] / n_moe * FULL_MOE
        miss = (1 - split["hit_rate"]) * routed
        out.update(colibri_split=split, missing_rest_ms=extra_rest, routed_bytes_61=routed,
                   colibri_61_tps=1e3 / (decode_ms(col) + extra_moe * split["moe_layer_ms"] + extra_rest),
                   bound_61_tps=bw / miss if miss > 0 else None)
        if llama:
            # llama.cpp reports no phases: its non-expert time per token is taken as colibri's
            l_moe = max(0.0, (decode_ms(llama) - split["rest_ms"]) / n_moe)
            out.update(llama_moe_layer_ms=l_moe,
                       llama_61_tps=1e3 / (decode_ms(llama) + extra_moe * l_moe + extra_rest))
    return out


def results_file(results: dict) -> Path:
    """bench-results/geometry_bench.json (geometry_bench_quick.json for --quick, which never replaces it)."""
    return RESULTS / ("geometry_bench_quick.json" if results["quick"] else "geometry_bench.json")


def fmt(v, spec=".2f") -> str:
    return "–" if v is None else format(v, spec)


def report(results: dict) -> None:
    s = summarize(results)
    results["summary"] = s
    results_file(results).write_text(json.dumps(results, indent=1, default=str))
    if results["quick"]:
        log("quick run: docs/benchmarks.md left as it is")
        log(json.dumps({k: v for k, v in s.items() if k not in ("colibri", "llama", "llama_by_readahead")},
                       default=str))
        return
    m = results["machine"]
    col, llama = s.get("colibri"), s.get("llama")
    split = s.get("colibri_split", {})
    lines = [f"Generated by `nox -s bench_geometry` (`engines/bench/geometry_bench.py`); raw figures in "
             "`bench-results/geometry_bench.json`. DeepSeek-V3's real config (hidden 7168, 128 MLA heads, q_lora "
             "1536, kv_lora 512, vocab 129280, 256 routed experts of width 2048 + 1 shared, top-8 in 8 groups "
             f"keeping 4) truncated to the dense first layer plus {s['n_moe']} MoE layer(s) at full width: "
             "random block-FP8 weights (e4m3, 128x128 `weight_scale_inv`, like the release) generated shard by "
             "shard, converted by `coli convert --experts int4 --dense int4` (dense FP8 matrices stay FP8, read "
             "natively; experts int4-g64) and written as llama.cpp `deepseek2` Q4_0 GGUF from the same weights. "
             f"colibri's container {results['container_bytes'] / 1e9:.2f} GB (experts "
             f"{results['container_expert_bytes'] / 1e9:.2f} GB), GGUF {results['gguf_bytes'] / 1e9:.2f} GB.", "",
             f"Machine: {m['cpu']}, {m['cores']} cores, {m['ram_bytes'] / 2**30:.0f} GiB RAM. Disk "
             f"`{results['disk']}` {results['disk_bandwidth'] / 1e9:.2f} GB/s (" +
             (f"`coli tune --model` on the container, at the {results['tune']['io_threads']} I/O threads "
              f"({results['tune']['io']}) it chose for the engine; sequential O_DIRECT gave "
              f"{results['disk_bandwidth_qd1'] / 1e9:.2f} GB/s at queue depth 1" if results.get("tune") else
              "sequential O_DIRECT, best of queue depth 1 and 4 readers") +
             f", on the benchmark's own files {', '.join(dict.fromkeys(results['disk_measured_on']))}, same run). "
             "Cap: a cgroup v1 memory limit of "
             f"{results['cap_bytes'] / 2**30:.2f} GiB = colibri's dense weights + 0.5 GiB + "
             f"{100 * results['expert_share']:.0f}% of its routed experts (colibri plans for all of it; llama.cpp's "
             "smaller Q4_0 dense part leaves its page cache more room). Every run cold (page cache dropped); "
             f"{PROMPT_TOKENS}-token prompt, {DECODE_TOKENS} teacher-forced decode steps; medians over "
             f"{max(r['round'] for r in results['runs']) + 1} alternated rounds; llama.cpp at its better readahead.",
             "", "| engine | decode tok/s | per-MoE-layer decode ms | read per token | hit rate | load avg | "
             "other CPU | extrapolated 61 layers tok/s | disk bound 61 layers tok/s |",
             "|---|---|---|---|---|---|---|---|---|"]
    if col:
        lines.append(f"| colibri int4-g64 | {col['decode_tps']:.3f} | {split['moe_layer_ms']:.0f} | "
                     f"{split['bytes_per_token'] / 1e6:.0f} MB | {100 * split['hit_rate']:.0f}% | "
                     f"{col['load_average']:.1f} | {100 * col['other_cpu_share']:.0f}% | "
                     f"{fmt(s.get('colibri_61_tps'), '.3f')} | {fmt(s.get('bound_61_tps'), '.3f')} |")
    if llama:
        lines.append(f"| llama.cpp Q4_0 (readahead {llama['readahead_kb']} KiB) | {llama['decode_tps']:.3f} | "
                     f"{fmt(s.get('llama_moe_layer_ms', s['llama_token_over_moe_ms']), '.0f')} | "
                     f"{s['llama_bytes_per_token'] / 1e6:.0f} MB | – | "
                     f"{llama['load_average']:.1f} | {100 * llama['other_cpu_share']:.0f}% | "
                     f"{fmt(s.get('llama_61_tps'), '.3f')} | – |")
    if not col:
        lines.append("| colibri int4-g64 | not run | | | | | | | |")
    lines += ["", "Per-MoE-layer time: colibri's I/O wait + expert matmuls per decode token (`done.decode`) over the "
              "MoE layers; llama.cpp reports no phases, so its figure is its decode time minus colibri's non-MoE "
              "time, over the MoE layers. Extrapolation to the real 61 layers (3 dense, 58 MoE): the measured "
              f"token plus {FULL_MOE - s['n_moe']} more MoE layers at that time plus the non-expert work of the "
              "missing layers at the measured time per byte of resident weights "
              f"({fmt(s.get('missing_rest_ms'), '.0f')} ms). Disk bound: bandwidth / ((1 - hit rate) x routed "
              "bytes per token of 58 MoE layers). Random weights route near uniformly, so the hit rate is about "
              "the cache's share of the experts; a trained model's skew would raise it.", ""]
    if "colibri" not in results.get("engines", ["colibri"]):
        lines += ["This run measured llama.cpp alone (`--engines llama.cpp`): colibri's container of this checkpoint "
                  "was not converted in its time, so the colibri row, the per-MoE-layer split and the "
                  "extrapolations (which take the non-expert time from colibri's phases) come with the next "
                  "full `nox -s bench_geometry` run, which reuses the cached GGUF. llama.cpp's per-MoE-layer figure "
                  "here is its whole decode time over the MoE layers (an upper bound).", ""]
    lines += ["Every run, in the order made:", "", "| round | engine | readahead KiB | prefill tok/s | decode tok/s | "
              "read per decode token | load avg | other CPU |", "|---|---|---|---|---|---|---|---|"]
    for r in results["runs"]:
        read = ((r.get("decode") or {}).get("bytes_read", 0) / max(1, (r.get("decode") or {}).get("steps", 1))
                if r["engine"] == "colibri" else r.get("bytes_read_decode", 0) / DECODE_TOKENS)
        lines.append(f"| {r['round'] + 1} | {r['engine']} | {r['readahead_kb']} | {fmt(r.get('prefill_tps'), '.1f')} | "
                     f"{fmt(r.get('decode_tps'), '.3f')} | {read / 1e6:.0f} MB | {fmt(r.get('load_average'), '.1f')} | "
                     f"{100 * r.get('other_cpu_share', 0):.0f}% |" if "error" not in r else
                     f"| {r['round'] + 1} | {r['engine']} | {r['readahead_kb']} | failed: {r['error'][:120]} | | | | |")
    lines.append("")
    sb.write_section(ROOT / "docs" / "benchmarks.md", "geometry-bench", "\n".join(lines),
                     title="Real expert geometry: DeepSeek-V3 truncated, streamed under a RAM cap")


if __name__ == "__main__":
    if sys.argv[1:] == ["--report"]:     # rewrite the docs section from the saved results (no engine is run)
        report(json.loads((RESULTS / "geometry_bench.json").read_text()))
        sys.exit(0)
    sys.exit(main())
