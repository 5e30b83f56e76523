"""colibri vs llama.cpp on a synthetic checkpoint at the real OLMoE-1B-7B geometry (``nox -s bench``).

Stages, each cached under ``$COLIBRI_BENCH_CACHE`` (default ``~/.cache/colibri/bench``), never in the repository:

1. Checkpoints: random bf16 weights at OLMoE-1B-7B's geometry, written shard by shard with numpy (one dense shard,
   one expert shard per layer; never the whole model in memory), plus a router-skewed variant that shares the
   expert shards (hard links) and differs in its embeddings and routers: every embedding carries a common
   direction and router row e leans on it by a Zipf-like amount, so expert popularity falls off with rank.
2. llama.cpp: the ``llama-cpp-python`` sdist's libllama built once (native; on AMX CPUs without AMX, whose matmul
   crashes on this model) beside the sdist's own Python package, and each checkpoint converted by the sdist's own
   ``convert_hf_to_gguf.py`` (its gguf-py first on sys.path) to bf16 GGUF.
3. Runs, A/B alternated: (a) model in RAM, page cache warm; (b) RAM capped at ~1/3 of the model by a cgroup v1
   memory child group under this process's own group, page cache dropped first. The same 64-token prompt, then
   32 teacher-forced decode steps (the protocol's ``forced`` field; greedy decode of a random model loops on two
   tokens and flatters any cache). llama.cpp runs with readahead at 128 KiB and at the disk's setting; the better
   is the peer. (c) Concurrency under the tight cap and in RAM: 1, 2 and 4 streams started together on one
   engine of 4 slots
   (colibri decodes them in one batched pass per token, each expert any stream chose read once per layer) against
   llama.cpp's parallel sequences (one ``llama_decode`` of one token per sequence, as llama-server's slots do),
   aggregate decode tok/s over wall time, with the load average and other processes' CPU share of each run.

Writes ``bench-results/stream_bench.json`` and ``.png`` and ``docs/benchmarks.md``. Figures on a loaded 2-core
VM are noisy; the report says so rather than smoothing them.
"""

from __future__ import annotations

import json
import mmap
import os
import platform
import random
import shutil
import statistics
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("COLIBRI_BENCH_CACHE", Path.home() / ".cache" / "colibri" / "bench"))
RESULTS = ROOT / "bench-results"
LLAMA_VERSION = "0.3.36"
GEOM = {"hidden": 2048, "layers": 16, "heads": 16, "inter": 1024, "experts": 64, "top_k": 8, "vocab": 50304}
PROMPT_TOKENS, DECODE_TOKENS = 64, 32
# COLIBRI_BENCH_ENGINES=colibri measures colibri alone (e.g. while the llama.cpp wheel still builds);
# COLIBRI_BENCH_MODELS=olmoe-synth leaves out the router-skewed variant, which is measured by colibri alone and only
# in the scenarios of COLIBRI_BENCH_SKEW_SCENARIOS: concurrency, where how much the streams' experts overlap
# decides what sharing reads can gain (uniform random routing is the worst case; a trained model's is skewed).
ENGINES = tuple(os.environ.get("COLIBRI_BENCH_ENGINES", "colibri,llama.cpp").split(","))
MODELS = tuple(os.environ.get("COLIBRI_BENCH_MODELS", "olmoe-synth,olmoe-skew").split(","))
SKEW_SCENARIOS = tuple(os.environ.get("COLIBRI_BENCH_SKEW_SCENARIOS", "concurrency").split(","))
# Both bit widths in RAM: int8 per row vs Q8_0 and int4-g64 vs Q4_0. The capped and concurrency scenarios run on the
# first (int8's 6.9 GB container is the model that "barely does not fit" a 6 GiB cap; int4's would fit).
SELECTED_PRECISIONS = tuple(os.environ.get("COLIBRI_BENCH_PRECISIONS", "int8,int4").split(","))
# COLIBRI_BENCH_SCENARIOS=capped re-measures one scenario; COLIBRI_BENCH_MERGE=1 then replaces only the kind of
# runs it made (same scenario, cap, prompt, engine and variant) in bench-results/stream_bench.json and keeps the
# others and the session's header (machine, `coli tune` profile, reused rather than re-measured): a partial re-run
# after a fix, or another policy under some caps (COLIBRI_BENCH_POLICIES=lookahead COLIBRI_BENCH_CAPS=5GiB).
SCENARIOS = tuple(os.environ.get("COLIBRI_BENCH_SCENARIOS", "capped,concurrency,in_ram").split(","))
# In RAM, prefill is measured at a short and a long prompt (llama.cpp batches a whole prompt at once; colibri
# chunks it), decode after each.
IN_RAM_PROMPTS = tuple(int(n) for n in os.environ.get("COLIBRI_BENCH_PROMPTS", "64,512").split(","))
# The caps: a third of the container (the tight case), then fixed budgets up to one the model barely misses.
CAPS = tuple(os.environ.get("COLIBRI_BENCH_CAPS", "third,3GiB,5GiB,6GiB").split(","))
# The concurrency scenario's stream counts (COLIBRI_BENCH_STREAMS=1,4 measures fewer), and its caps: the tight one,
# where the disk is the bottleneck and streams can only share what their experts have in common (64 experts top-8:
# four streams' union is ~26 experts a layer against one stream's 8, so the reads per token fall by at most 1.2x),
# and "ram" (no cap, page cache warm), where batching can only share the compute's weight traffic
# (COLIBRI_BENCH_STREAM_CAPS=5GiB adds a cap where most experts are cached but the streams' working sets compete).
STREAMS = tuple(int(n) for n in os.environ.get("COLIBRI_BENCH_STREAMS", "1,2,4").split(","))
STREAM_CAPS = tuple(os.environ.get("COLIBRI_BENCH_STREAM_CAPS", "third,ram").split(","))
MERGE = os.environ.get("COLIBRI_BENCH_MERGE") == "1"
# Every scenario runs this many rounds, the engines alternating (each round starts with the other one), and the
# report takes medians over the quiet runs: one 32-token run on a shared virtual machine can be 15% off either way.
ROUNDS = int(os.environ.get("COLIBRI_BENCH_ROUNDS", "3"))
# colibri's policies measured under each cap (`auto` is what `coli run` does; see POLICIES for the others; the
# policy comparison has its own section, "Set dueling").
CAPPED_POLICIES = tuple(os.environ.get("COLIBRI_BENCH_POLICIES", "auto").split(","))
# llama.cpp runs under a cap at 128 KiB readahead and at the disk's own setting; the better is the peer. Below
# LLAMA_DISK_READAHEAD_FROM the disk's setting is skipped: at 8192 KiB every fault drags in megabytes that are
# evicted before use, and llama.cpp was 2.7-12x slower there in every earlier run (0.13 tok/s at a third).
LLAMA_READAHEADS = os.environ.get("COLIBRI_BENCH_LLAMA_READAHEAD", "128,disk").split(",")
LLAMA_DISK_READAHEAD_FROM = float(os.environ.get("COLIBRI_BENCH_LLAMA_DISK_RA_FROM_GIB", "4")) * 2**30
# llama.cpp is the peer on the plain synthetic model; the skewed one measures colibri's caching policies.
LLAMA_MODELS = ("olmoe-synth",)
# A run is contended, and left out of the medians, when other processes took more than this share of the machine's
# CPU time during it (machine_load.LoadWindow; the bench's own processes are in its cpuacct group).
QUIET_OTHER_CPU = float(os.environ.get("COLIBRI_BENCH_QUIET_OTHER_CPU", "0.10"))


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---- 1. checkpoints -------------------------------------------------------------------------------------------

def config() -> dict:
    g = GEOM
    return {"architectures": ["OlmoeForCausalLM"], "model_type": "olmoe", "hidden_size": g["hidden"],
            "intermediate_size": g["inter"], "num_hidden_layers": g["layers"], "num_attention_heads": g["heads"],
            "num_key_value_heads": g["heads"], "num_experts": g["experts"], "num_experts_per_tok": g["top_k"],
            "vocab_size": g["vocab"], "max_position_embeddings": 4096, "rope_theta": 10000.0,
            "rms_norm_eps": 1e-5, "norm_topk_prob": False, "tie_word_embeddings": False, "clip_qkv": None,
            "attention_bias": False, "hidden_act": "silu", "torch_dtype": "bfloat16", "bos_token_id": None,
            "eos_token_id": 50279, "pad_token_id": 1, "output_router_logits": False, "router_aux_loss_coef": 0.01}


class Pool:
    """Random bf16 values: one N(0,1) pool truncated to bf16 once per scale, sliced at random offsets. Distinct
    slices keep every expert distinct, and writing becomes a copy of existing bytes (the disk is the limit)."""

    def __init__(self, seed: int, n: int = 1 << 27):
        self.rng = np.random.default_rng(seed)
        self.f32 = self.rng.standard_normal(n, dtype=np.float32)
        self.scaled: dict[float, np.ndarray] = {}

    def bf16(self, count: int, scale: float) -> np.ndarray:
        if scale not in self.scaled:
            self.scaled[scale] = ((self.f32 * np.float32(scale)).view(np.uint32) >> 16).astype(np.uint16)
        start = int(self.rng.integers(0, self.f32.size - count))
        return self.scaled[scale][start:start + count]


def bf16_of(x: np.ndarray) -> np.ndarray:
    return (x.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)


def write_shard(path: Path, tensors: list[tuple[str, tuple[int, ...], object]]) -> None:
    """Stream tensors (name, shape, callable returning uint16 bf16 data) into one safetensors file."""
    header, offset = {}, 0
    for name, shape, _ in tensors:
        n = int(np.prod(shape)) * 2
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as fh:
        fh.write(struct.pack("<Q", len(raw)))
        fh.write(raw)
        for name, shape, make in tensors:
            data = make()
            assert data.size == int(np.prod(shape)), name
            fh.write(data.tobytes())
    os.replace(tmp, path)


def dense_tensors(pool: Pool, skew: bool) -> list:
    g = GEOM
    H, V, L, E = g["hidden"], g["vocab"], g["layers"], g["experts"]
    direction = np.random.default_rng(7).standard_normal(H).astype(np.float32)
    direction /= np.linalg.norm(direction)

    def embed():
        e = pool.bf16(V * H, 1.0)
        if not skew:
            return e
        # every token shares a component along `direction`: the routers below can then prefer experts by rank
        f = (e.astype(np.uint32) << 16).view(np.float32).reshape(V, H) + 3.0 * direction
        return bf16_of(f).ravel()

    def norm():
        return bf16_of(1.0 + 0.1 * np.random.default_rng(1).standard_normal(H).astype(np.float32))

    def router(layer):
        def make():
            w = (pool.bf16(E * H, H ** -0.5).astype(np.uint32) << 16).view(np.float32).reshape(E, H)
            if skew:
                rank = np.random.default_rng(100 + layer).permutation(E) + 1
                lean = 2.5 * (1.0 / rank) ** 0.8      # Zipf-like: popularity falls with rank
                w = w + lean[:, None] * direction[None, :]
            return bf16_of(w).ravel()
        return make

    out = [("model.embed_tokens.weight", (V, H), embed), ("model.norm.weight", (H,), norm),
           ("lm_head.weight", (V, H), lambda: pool.bf16(V * H, H ** -0.5))]
    for layer in range(L):
        p = f"model.layers.{layer}"
        out += [(f"{p}.input_layernorm.weight", (H,), norm), (f"{p}.post_attention_layernorm.weight", (H,), norm),
                (f"{p}.self_attn.q_norm.weight", (H,), norm), (f"{p}.self_attn.k_norm.weight", (H,), norm)]
        out += [(f"{p}.self_attn.{m}_proj.weight", (H, H), lambda: pool.bf16(H * H, H ** -0.5)) for m in "qkvo"]
        out.append((f"{p}.mlp.gate.weight", (E, H), router(layer)))
    return out


def expert_tensors(pool: Pool, layer: int) -> list:
    H, inter, E = GEOM["hidden"], GEOM["inter"], GEOM["experts"]
    out = []
    for e in range(E):
        p = f"model.layers.{layer}.mlp.experts.{e}"
        out += [(f"{p}.gate_proj.weight", (inter, H), lambda: pool.bf16(inter * H, H ** -0.5)),
                (f"{p}.up_proj.weight", (inter, H), lambda: pool.bf16(inter * H, H ** -0.5)),
                (f"{p}.down_proj.weight", (H, inter), lambda: pool.bf16(H * inter, inter ** -0.5))]
    return out


def shard_names(tensors: list) -> list[str]:
    return [name for name, _, _ in tensors]


def build_checkpoint(out: Path, skew: bool, experts_from: Path | None) -> Path:
    if (out / "config.json").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    pool = Pool(seed=2 if skew else 1)
    weight_map = {}
    dense = dense_tensors(pool, skew)
    if not (out / "model-dense.safetensors").is_file():   # shards appear atomically: a present one is whole
        log(f"writing {out.name}: dense shard")
        write_shard(out / "model-dense.safetensors", dense)
    weight_map.update({n: "model-dense.safetensors" for n in shard_names(dense)})
    for layer in range(GEOM["layers"]):
        name = f"model-experts-{layer:02d}.safetensors"
        tensors = expert_tensors(pool, layer)
        if (out / name).is_file():
            pass
        elif experts_from is not None:
            os.link(experts_from / name, out / name)   # the variant differs only in embeddings and routers
        else:
            log(f"writing {out.name}: experts of layer {layer}")
            write_shard(out / name, tensors)
        weight_map.update({n: name for n in shard_names(tensors)})
    total = sum((out / f).stat().st_size for f in set(weight_map.values()))
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                  "weight_map": weight_map}))
    from colibri.testing.tiny import train_tokenizer

    train_tokenizer(out, "olmoe")
    (out / "config.json").write_text(json.dumps(config(), indent=1))
    return out


# ---- 2. llama.cpp -----------------------------------------------------------------------------------------------

def cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


CPU_FLAGS = cpu_flags()
# ggml's AMX matmul, which a native build turns on, segfaults in this model's first llama_decode (seen on a Sapphire
# Rapids VM; llama.cpp issue #20824 reports the same crash in ggml_backend_amx_mul_mat): leave it out where it exists.
LLAMA_WITHOUT_AMX = "amx_int8" in CPU_FLAGS
# Under the bench cache: the sdist's Python package + its libraries (a build of its own when AMX is left out).
LLAMA_LITE = "llama-cpp-lite" + ("-noamx" if LLAMA_WITHOUT_AMX else "")
LLAMA_NATIVE_NOTE = "native (-march=native)"
# What the runners' and the quantizer's environment needs for `import llama_cpp` (set by ensure_llama_cpp).
LLAMA_ENV: dict[str, str] = {}


def ensure_llama_cpp() -> Path:
    """llama.cpp from the llama-cpp-python sdist, ready for the runners; returns the vendored llama.cpp tree."""
    sdist_dir = CACHE / "sdist"
    tree = sdist_dir / f"llama_cpp_python-{LLAMA_VERSION}" / "vendor" / "llama.cpp"
    if not tree.is_dir():
        sdist_dir.mkdir(parents=True, exist_ok=True)
        sdist = sdist_dir / f"llama_cpp_python-{LLAMA_VERSION}.tar.gz"
        if not sdist.is_file():
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-python",
                            f"llama-cpp-python=={LLAMA_VERSION}", "-d", str(sdist_dir)], check=True)
        subprocess.run(["tar", "xzf", str(sdist), "-C", str(sdist_dir)], check=True)
    LLAMA_ENV.update(llama_env(tree))
    return tree


def llama_env(llama: Path) -> dict[str, str]:
    """What ``import llama_cpp`` needs in a runner: nothing when the package is installed; else the sdist's own
    Python package beside ``libllama`` built from the same sdist with the wheel's CMake options (native CPU, no
    tests, examples or server), library targets only: the wheel also builds llama.cpp's tools and common library,
    most of its build time, and none of them is used here."""
    import importlib.util

    if importlib.util.find_spec("llama_cpp") is not None:
        return {}
    missing = [m for m in ("diskcache", "jinja2", "typing_extensions") if importlib.util.find_spec(m) is None]
    if missing:     # the package's own dependencies (numpy is there)
        subprocess.run([sys.executable, "-m", "pip", "install", *(m.replace("_", "-") for m in missing)], check=True)
    lite = CACHE / LLAMA_LITE
    lib = lite / "llama_cpp" / "lib"
    if not (lib / "libllama.so").is_file():
        sdist_root = llama.parents[1]
        build = CACHE / LLAMA_LITE.replace("cpp-lite", "build")
        log("building libllama from the llama-cpp-python sdist (library targets only)")
        subprocess.run(["cmake", "-S", str(sdist_root), "-B", str(build), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
                        *llama_isa_options(), "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
                        "-DLLAMA_BUILD_SERVER=OFF"], check=True, capture_output=True)
        subprocess.run(["cmake", "--build", str(build), "--target", "llama", "-j", str(os.cpu_count() or 2)],
                       check=True, capture_output=True)
        install_lite(sdist_root, build / "bin", lite)
    return {"PYTHONPATH": str(lite), "LD_LIBRARY_PATH": str(lib)}


# ggml's CMake option for each /proc/cpuinfo flag: the extensions a native build would target.
GGML_ISA_FLAGS = {"avx": "AVX", "avx2": "AVX2", "fma": "FMA", "f16c": "F16C", "bmi2": "BMI2", "avx_vnni": "AVX_VNNI",
                  "avx512f": "AVX512", "avx512vbmi": "AVX512_VBMI", "avx512_vnni": "AVX512_VNNI",
                  "avx512_bf16": "AVX512_BF16"}


def llama_isa_options() -> list[str]:
    """A native build; without AMX (see LLAMA_WITHOUT_AMX), every other ISA extension this CPU has, named one by
    one: the llama.cpp a user of this machine can actually run."""
    if not LLAMA_WITHOUT_AMX:
        return ["-DGGML_NATIVE=ON"]
    named = [f"-DGGML_{v}={'ON' if k in CPU_FLAGS else 'OFF'}" for k, v in GGML_ISA_FLAGS.items()]
    return ["-DGGML_NATIVE=OFF", *named, "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]


def llama_build_note() -> str:
    """How libllama was built, for the report."""
    if not LLAMA_WITHOUT_AMX:
        return LLAMA_NATIVE_NOTE
    return ("without AMX (ggml's AMX matmul segfaults in this model's first decode here; llama.cpp issue #20824), "
            "with every other extension this CPU has: " + ", ".join(sorted(CPU_FLAGS & GGML_ISA_FLAGS.keys())))


def install_lite(sdist_root: Path, built: Path, lite: Path) -> None:
    """The sdist's ``llama_cpp`` package with the built shared libraries in its ``lib/``, as the wheel lays it out
    (written beside, then renamed into place)."""
    tmp = lite.with_name(lite.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(sdist_root / "llama_cpp", tmp / "llama_cpp")
    (tmp / "llama_cpp" / "lib").mkdir(exist_ok=True)
    for so in built.glob("lib*.so*"):
        shutil.copy2(so, tmp / "llama_cpp" / "lib" / so.name, follow_symlinks=True)
    shutil.rmtree(lite, ignore_errors=True)
    os.replace(tmp, lite)


CONVERT_SHIM = """
import runpy, sys
sys.path.insert(0, {llama!r})
sys.path.insert(0, {llama!r} + '/gguf-py')
import conversion.base as base
# The synthetic checkpoint's tokenizer is trained offline, so llama.cpp's table of known pre-tokenizer hashes
# cannot contain it; it changes no weight and no timing, so it is declared GPT-2 style (byte-level BPE).
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: 'gpt-2'
sys.argv = ['convert_hf_to_gguf.py', {model!r}, '--outtype', {outtype!r}, '--outfile', {out!r}]
runpy.run_path({llama!r} + '/convert_hf_to_gguf.py', run_name='__main__')
"""

QUANTIZE_SHIM = """
import ctypes, sys
import llama_cpp
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = getattr(llama_cpp, sys.argv[3])
params.nthread = 2
rc = llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), ctypes.byref(params))
sys.exit(0 if rc == 0 else 1)
"""

# Bit widths compared like for like: colibri's container scheme (experts and dense alike) against llama.cpp's
# type of about the same bits per weight (int8-row ~8.0 vs Q8_0 8.5; int4-g64 4.25 vs Q4_0 4.5).
PRECISIONS = {"int8": {"colibri": ("int8", "int8"), "gguf": "q8_0"},
              "int4": {"colibri": ("int4", "int4"), "gguf": "q4_0"}}


def ensure_gguf(llama: Path, model: Path, gguf_type: str) -> Path:
    """The checkpoint as GGUF of this type, made by the sdist's own converter (q4_0 via llama.cpp's quantizer
    from a temporary bf16 GGUF, which the converter cannot write directly)."""
    out = CACHE / f"{model.name}-{gguf_type}.gguf"
    if out.is_file():
        return out
    direct = gguf_type in ("bf16", "q8_0", "f16")
    source = out if direct else CACHE / f"{model.name}-bf16.gguf"
    if not source.is_file():
        log(f"converting {model.name} to GGUF {'bf16' if not direct else gguf_type}")
        tmp = source.with_suffix(".tmp.gguf")
        code = CONVERT_SHIM.format(llama=str(llama), model=str(model), out=str(tmp),
                                   outtype=gguf_type if direct else "bf16")
        subprocess.run([sys.executable, "-c", code], check=True)
        os.replace(tmp, source)
    if not direct:
        log(f"quantizing {source.name} to {gguf_type}")
        tmp = out.with_suffix(".tmp.gguf")
        subprocess.run([sys.executable, "-c", QUANTIZE_SHIM, str(source), str(tmp),
                        f"LLAMA_FTYPE_MOSTLY_{gguf_type.upper()}"], check=True, env={**os.environ, **LLAMA_ENV})
        os.replace(tmp, out)
        source.unlink()     # 14 GB of disk: the bf16 GGUF was only a stepping stone
    return out


def ensure_container(model: Path, precision: str) -> Path:
    """colibri's quantized container of the checkpoint (``coli convert``; resumable, so a killed run continues)."""
    out = CACHE / f"{model.name}-{precision}"
    if not (out / "config.json").is_file():
        experts, dense = PRECISIONS[precision]["colibri"]
        log(f"converting {model.name} to a colibri {precision} container")
        subprocess.run([sys.executable, "-c", "from colibri.cli import main; main()", "convert", "--model",
                        str(model), "--out", str(out), "--experts", experts, "--dense", dense], check=True)
    return out


LLAMA_RUNNER = """
import json, os, resource, sys, time
from llama_cpp import Llama
prompt, forced = json.loads(sys.argv[2]), json.loads(sys.argv[3])
def read_bytes():
    for line in open('/proc/self/io'):
        if line.startswith('read_bytes'):
            return int(line.split()[1])
    return 0
r0 = read_bytes(); t = time.perf_counter()
# n_ctx and n_batch (argv 4 and 5): the whole prompt in one batch, as llama.cpp's own tools feed it
n_ctx, n_batch = (int(sys.argv[4]), int(sys.argv[5])) if len(sys.argv) > 5 else (512, 64)
llm = Llama(model_path=sys.argv[1], n_ctx=n_ctx, n_threads=2, n_threads_batch=2, n_batch=n_batch, verbose=False)
load_s = time.perf_counter() - t
r1 = read_bytes(); t = time.perf_counter()
llm.eval(prompt)
prefill_s = time.perf_counter() - t
r2 = read_bytes(); t = time.perf_counter()
for tok in forced:
    llm.eval([tok])
decode_s = time.perf_counter() - t
r3 = read_bytes()
print(json.dumps({"load_s": load_s, "prefill_tps": len(prompt) / prefill_s, "decode_tps": len(forced) / decode_s,
                  "bytes_read_load": r1 - r0, "bytes_read_prefill": r2 - r1, "bytes_read_decode": r3 - r2,
                  "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


# ---- measurement helpers ----------------------------------------------------------------------------------------

def own_memory_cgroup() -> Path | None:
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            base = Path("/sys/fs/cgroup/memory") / path.lstrip("/")
            return base if base.is_dir() else None
    return None


class CappedGroup:
    """A cgroup v1 memory child of our own group with a hard limit; commands run inside it via a shell shim."""

    def __init__(self, limit: int, name: str = ""):
        parent = own_memory_cgroup()
        if parent is None:
            raise RuntimeError("no cgroup v1 memory hierarchy for this process")
        self.path = parent / f"colibri-bench-{os.getpid()}{'-' + name if name else ''}"
        self.path.mkdir(exist_ok=True)
        # memsw (memory + swap) may never be below the memory limit: lift it first, or raising the limit of a
        # group made earlier with a smaller one fails with EINVAL.
        memsw = self.path / "memory.memsw.limit_in_bytes"
        try:
            memsw.write_text("-1")
        except OSError:
            memsw = None
        (self.path / "memory.limit_in_bytes").write_text(str(limit))
        if memsw is not None:
            memsw.write_text(str(limit))

    def wrap(self, argv: list[str]) -> list[str]:
        return ["sh", "-c", f'echo $$ > {self.path}/cgroup.procs && exec "$@"', "sh", *argv]

    def close(self, wait_s: float = 10.0) -> None:
        """Remove the group once its processes are gone (a killed engine may take a moment to exit)."""
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            try:
                if not (self.path / "cgroup.procs").read_text().strip():
                    break
            except OSError:
                break
            time.sleep(0.1)
        try:
            self.path.rmdir()
        except OSError:
            pass


def drop_caches() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def readahead_file(disk: str) -> Path:
    return Path(f"/sys/block/{disk}/queue/read_ahead_kb")


def root_disk() -> str:
    dev = os.stat(CACHE).st_dev
    name = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}").resolve().name
    parent = Path(f"/sys/class/block/{name}/..").resolve()
    return parent.name if (parent / "queue").is_dir() else name


def set_readahead(disk: str, kb: int) -> bool:
    try:
        readahead_file(disk).write_text(str(kb))
        return True
    except OSError:
        return False


def disk_bandwidth(path: Path, limit: int = 2 << 30, readers: int = 1) -> float:
    """Sequential O_DIRECT reads (8 MiB requests) of up to 2 GiB of ``path``: the disk, not the page cache.

    ``readers`` > 1 splits the span into that many contiguous stretches read concurrently (os.preadv releases the
    GIL), the queue depth an engine with an I/O pool reaches; one reader is queue depth 1."""
    from concurrent.futures import ThreadPoolExecutor

    block = 8 << 20
    size = min(limit, path.stat().st_size) // block * block
    stretch = size // readers // block * block
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))

    def read(first: int) -> int:
        buf, done = mmap.mmap(-1, block), 0
        while done < stretch:
            got = os.preadv(fd, [buf], first + done)
            if got <= 0:
                break
            done += got
        return done

    try:
        t = time.perf_counter()
        with ThreadPoolExecutor(readers) as pool:
            total = sum(pool.map(read, [i * stretch for i in range(readers)]))
        return total / (time.perf_counter() - t)
    finally:
        os.close(fd)


def peak_rss(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def workload(vocab: int, locality: bool, seed: int = 1234,
             prompt_tokens: int = PROMPT_TOKENS) -> tuple[list[int], list[int]]:
    rng = random.Random(seed)
    prompt = [rng.randrange(2, vocab) for _ in range(prompt_tokens)]
    forced: list[int] = []
    for _ in range(DECODE_TOKENS):   # with locality, half the steps revisit one of the last 8 tokens
        if locality and forced and rng.random() < 0.5:
            forced.append(rng.choice(forced[-8:]))
        else:
            forced.append(rng.randrange(2, vocab))
    return prompt, forced


# The policies compared under the cap, as launch.Streaming switches: "auto" is what `coli run` does when the cache
# is partial (set dueling of the learned hot set with LRU, and prefetching of each block's misses), "lru" the plain
# LRU cache, "hotset" the hot set alone, and the others take one piece away or add router lookahead, so each piece's
# share shows.
POLICIES = {"auto": {}, "lru": {"prefetch": False, "pin": False}, "hotset": {"prefetch": False, "pin": True},
            "prefetch": {"pin": False}, "lookahead": {"lookahead": True}, "no-lookahead": {"lookahead": False}}
POLICY_LABELS = {"lru": "LRU", "hotset": "hot set", "prefetch": "LRU + prefetch",
                 "auto": "duel + prefetch (default)", "lookahead": "default + lookahead",
                 "no-lookahead": "default, lookahead off"}


def context_for(prompt_tokens: int) -> int:
    """The context both engines get: the prompt and its decode steps, with room to spare, as a power of two."""
    ctx = 256
    while ctx < 2 * (prompt_tokens + DECODE_TOKENS):
        ctx *= 2
    return ctx


def run_colibri(model: Path, ram: int | None, group: CappedGroup | None, locality: bool, policy: str = "auto",
                warm_request: bool = False, seed: int = 1234, prompt_tokens: int = PROMPT_TOKENS,
                tune: object = None) -> dict:
    """One engine process: load, (optionally one unrelated warm-up request), then the measured request.

    ``policy``: a key of POLICIES; ``tune``: the `coli tune` profile `coli run` would use (None: untuned)."""
    from colibri import launch
    from colibri.engine import Engine
    from colibri.model import resolve_model

    resolved = resolve_model(str(model), None)
    streaming = launch.Streaming(**POLICIES[policy])
    spec = launch.prepare(resolved, ram_gib=(ram / launch.GIB) if ram else None, ctx=context_for(prompt_tokens),
                          threads=2, streaming=streaming, tune=tune)
    argv = group.wrap(list(spec.argv)) if group else list(spec.argv)
    prompt, forced = workload(GEOM["vocab"], locality, seed, prompt_tokens)
    t = time.perf_counter()
    with Engine(argv, env=spec.env, ready_timeout=1800) as eng:
        load_s = time.perf_counter() - t
        if warm_request:
            # colibri's cache fills lazily while llama.cpp's mmap is populated at load: in the warm in-RAM
            # scenario one unrelated request (another prompt: no prefix to reuse) makes both start warm.
            warm_prompt, warm_forced = workload(GEOM["vocab"], locality, seed=99, prompt_tokens=prompt_tokens)
            eng.generate(warm_prompt, max_tokens=DECODE_TOKENS, forced=warm_forced)
        result = eng.generate(prompt, max_tokens=DECODE_TOKENS, forced=forced)
        rss = peak_rss(eng.proc.pid)
    stats = dict(result.stats)
    stats.update({"load_s": load_s, "peak_rss_bytes": rss, "cap": int(spec.argv[spec.argv.index("--cap") + 1]),
                  "routed_bytes_per_token": spec.plan.routed_bytes_per_token, "policy": policy})
    return stats


def run_llama(gguf: Path, group: CappedGroup | None, locality: bool, prompt_tokens: int = PROMPT_TOKENS) -> dict:
    prompt, forced = workload(GEOM["vocab"], locality, prompt_tokens=prompt_tokens)
    argv = [sys.executable, "-c", LLAMA_RUNNER, str(gguf), json.dumps(prompt), json.dumps(forced),
            str(context_for(prompt_tokens)), str(min(512, prompt_tokens))]
    proc = subprocess.run(group.wrap(argv) if group else argv, capture_output=True, text=True, timeout=7200,
                          env={**os.environ, **LLAMA_ENV})
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


# llama.cpp's parallel slots through llama-cpp-python's low-level bindings: its high-level Llama object holds one
# sequence, so the runner drives llama_decode itself with a batch of one token per sequence (seq_id i at its own
# position), the way llama-server's --parallel slots decode. Each prompt is prefilled by itself first, as colibri's
# slots are; every decode row asks for its logits, as each of colibri's does.
LLAMA_PARALLEL_RUNNER = """
import ctypes, json, sys, time
import llama_cpp as L
streams = json.loads(sys.argv[2])
n = len(streams)
width = max(len(p) for p, _ in streams)
L.llama_backend_init()
model = L.llama_model_load_from_file(sys.argv[1].encode(), L.llama_model_default_params())
cp = L.llama_context_default_params()
cp.n_ctx, cp.n_seq_max = 512 * n, n
cp.n_batch = cp.n_ubatch = max(width, n)
cp.n_threads = cp.n_threads_batch = 2
ctx = L.llama_init_from_model(model, cp)
batch = L.llama_batch_init(max(width, n), 0, n)
def decode(rows):
    batch.n_tokens = len(rows)
    for i, (tok, pos, seq, logits) in enumerate(rows):
        batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = tok, pos, 1, logits
        batch.seq_id[i][0] = seq
    if L.llama_decode(ctx, batch) != 0:
        sys.exit('llama_decode failed')
t = time.perf_counter()
for seq, (prompt, _) in enumerate(streams):
    decode([(tok, pos, seq, int(pos == len(prompt) - 1)) for pos, tok in enumerate(prompt)])
prefill_s = time.perf_counter() - t
t = time.perf_counter()
steps = len(streams[0][1])
for j in range(steps):
    decode([(forced[j], len(prompt) + j, seq, 1) for seq, (prompt, forced) in enumerate(streams)])
decode_s = time.perf_counter() - t
L.llama_batch_free(batch)
print(json.dumps({"aggregate_tps": n * steps / decode_s, "prefill_s": prefill_s, "decode_s": decode_s}))
"""


def stream_workloads(vocab: int, locality: bool, n: int) -> list[tuple[list[int], list[int]]]:
    """n distinct prompts and forced continuations (stream i is workload seed 1234 + i)."""
    return [workload(vocab, locality, seed=1234 + i) for i in range(n)]


def token_times(req) -> list[float]:
    """Consume a request's events, returning when each of its tokens arrived (perf_counter)."""
    times = []
    for ev in req.events():
        if ev.get("ev") == "token":
            times.append(time.perf_counter())
    return times


def load_window(*pids: int):
    """A LoadWindow that counts every process of this bench as its own (OWN_CPU, when root made the group)."""
    from machine_load import LoadWindow

    return LoadWindow(pids, group=OWN_CPU)


def run_colibri_streams(model: Path, ram: int | None, group: CappedGroup | None, locality: bool, n: int,
                        slots: int, tune: object = None) -> dict:
    """One engine of ``slots`` slots under the budget: an unmeasured warm-up request, then n streams sent in one
    write, so they prefill in the same round and decode together. Aggregate decode tok/s is the tokens that came
    after the last stream's first token over the wall time from then to the last one."""
    from concurrent.futures import ThreadPoolExecutor

    from colibri import launch
    from colibri.engine import Engine
    from colibri.model import resolve_model

    spec = launch.prepare(resolve_model(str(model), None), ram_gib=ram / launch.GIB if ram else None, ctx=256,
                          slots=slots, threads=2, tune=tune)
    argv = group.wrap(list(spec.argv)) if group else list(spec.argv)
    with Engine(argv, env=spec.env, ready_timeout=1800) as eng:
        warm_prompt, warm_forced = workload(GEOM["vocab"], locality, seed=99)
        eng.generate(warm_prompt, max_tokens=DECODE_TOKENS, forced=warm_forced)
        eng.reset(0)
        with load_window(eng.proc.pid) as window, ThreadPoolExecutor(n) as pool:
            with eng.together():
                reqs = [eng.submit(p, slot=i, max_tokens=DECODE_TOKENS, forced=f)
                        for i, (p, f) in enumerate(stream_workloads(GEOM["vocab"], locality, n))]
            times = list(pool.map(token_times, reqs))
        rss = peak_rss(eng.proc.pid)
    start = max(t[0] for t in times)
    end = max(t[-1] for t in times)
    after = sum(1 for ts in times for x in ts if x > start)
    decode = [r.stats.get("decode", {}) for r in reqs]
    hits = sum(d.get("expert_hits", 0) for d in decode)
    misses = sum(d.get("expert_misses", 0) for d in decode)
    steps = sum(d.get("steps", 0) for d in decode)
    return {"aggregate_tps": after / (end - start) if end > start else None, "streams": n,
            "batched_steps": [r.stats.get("batched_steps", 0) for r in reqs],
            "decode": {"steps": steps, "hit_rate": hits / (hits + misses) if hits + misses else 0.0,
                       "bytes_read": sum(d.get("bytes_read", 0) for d in decode)},
            "cap": int(spec.argv[spec.argv.index("--cap") + 1]), "peak_rss_bytes": rss,
            "load_average": window.load_average, "other_cpu_share": window.other_cpu_share}


def run_llama_streams(gguf: Path, group: CappedGroup | None, locality: bool, n: int) -> dict:
    argv = [sys.executable, "-c", LLAMA_PARALLEL_RUNNER, str(gguf),
            json.dumps(stream_workloads(GEOM["vocab"], locality, n))]
    with load_window() as window:
        proc = subprocess.run(group.wrap(argv) if group else argv, capture_output=True, text=True, timeout=7200,
                              env={**os.environ, **LLAMA_ENV})
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"}
    return {**json.loads(proc.stdout.strip().splitlines()[-1]), "streams": n, "load_average": window.load_average,
            "other_cpu_share": window.other_cpu_share}


# ---- 3. the scenarios -------------------------------------------------------------------------------------------

OWN_CPU = None   # machine_load.OwnCpuGroup of this bench, made in main()


class Session:
    """What every scenario of one `nox -s bench` shares: the results so far, the disk, its readahead before the
    bench, the `coli tune` profile `coli run` would use, and llama.cpp's GGUFs (made on first use)."""

    def __init__(self, results: dict, disk: str, original_ra: int, tune: object):
        self.results, self.disk, self.original_ra, self.tune = results, disk, original_ra, tune
        self.llama_dir: Path | None = None
        self.llama_tried = False

    def gguf(self, model: Path, precision: str) -> Path | None:
        """llama.cpp set up on first use, so colibri's figures arrive even if llama.cpp cannot be built."""
        if "llama.cpp" not in ENGINES or model.name not in LLAMA_MODELS:
            return None
        if not self.llama_tried:
            self.llama_tried = True
            try:
                self.llama_dir = ensure_llama_cpp()
            except (subprocess.CalledProcessError, OSError) as exc:
                log(f"llama.cpp unavailable: {exc}")
        if self.llama_dir is None:
            return None
        try:
            return ensure_gguf(self.llama_dir, model, PRECISIONS[precision]["gguf"])
        except (subprocess.CalledProcessError, OSError) as exc:
            log(f"GGUF conversion failed: {exc}")
            return None

    def save(self, run: dict) -> None:
        log(json.dumps({k: v for k, v in run.items() if k in ("decode_tps", "prefill_tps", "aggregate_tps",
                                                              "load_average", "other_cpu_share", "error")}))
        self.results["runs"].append(run)
        (RESULTS / "stream_bench.json").write_text(json.dumps(self.results, indent=1, default=str))


def measured(fn, *args, **kwargs) -> dict:
    """Run one engine run inside a LoadWindow; a failed run is recorded, never fatal to the others."""
    with load_window() as window:
        try:
            stats = fn(*args, **kwargs)
        except Exception as exc:   # one failed run must not lose the others
            stats = {"error": f"{type(exc).__name__}: {exc}"}
    return {**stats, "load_average": window.load_average, "other_cpu_share": window.other_cpu_share}


def quiet(stats: dict) -> dict:
    return {**stats, "quiet": stats.get("other_cpu_share", 1.0) <= QUIET_OTHER_CPU}


def engine_order(round_index: int) -> list[str]:
    """The engines of one round: each round starts with the other engine, so neither always runs first."""
    return list(ENGINES) if round_index % 2 == 0 else list(reversed(ENGINES))


def warm_page_cache(files: list[Path]) -> None:
    subprocess.run(["cat", *map(str, files)], stdout=subprocess.DEVNULL, check=False)


def run_in_ram(S: Session, model: Path, precision: str, container: Path, locality: bool) -> None:
    """Scenario (a): the model in RAM, page cache warm (files read first; colibri answers one unrelated request
    first, its cache filled as llama.cpp's mmap is at load), at each prompt length, ROUNDS alternated rounds."""
    for prompt in IN_RAM_PROMPTS:
        for r in range(ROUNDS):
            for engine in engine_order(r):
                gguf = S.gguf(model, precision) if engine == "llama.cpp" else None
                if engine == "llama.cpp" and gguf is None:
                    continue
                set_readahead(S.disk, S.original_ra)
                warm_page_cache([*container.glob("*.safetensors")] if engine == "colibri" else [gguf])
                log(f"{model.name}/{precision} in RAM, {prompt}-token prompt, {engine} (round {r + 1})")
                (container / ".colibri-hotset").unlink(missing_ok=True)
                stats = (measured(run_colibri, container, None, None, locality, "auto", warm_request=True,
                                  prompt_tokens=prompt, tune=S.tune) if engine == "colibri"
                         else measured(run_llama, gguf, None, locality, prompt))
                S.save(quiet({"model": model.name, "precision": precision, "scenario": "in_ram", "temp": "warm",
                              "engine": engine, "variant": "auto" if engine == "colibri" else "mmap",
                              "readahead_kb": S.original_ra, "prompt_tokens": prompt, "round": r + 1, **stats}))


def cap_bytes_of(name: str, container_size: int) -> int:
    """A cap's bytes: ``third`` (of the container) or a size such as ``5GiB``."""
    if name == "third":
        return container_size // 3
    if name.endswith("GiB"):
        return int(float(name[:-3]) * 2**30)
    raise SystemExit(f"COLIBRI_BENCH_CAPS: {name!r} is neither 'third' nor a size like '5GiB'")


def llama_readaheads(S: Session, cap: int) -> list[int]:
    wanted = {S.original_ra if ra == "disk" else int(ra) for ra in LLAMA_READAHEADS}
    if cap < LLAMA_DISK_READAHEAD_FROM and len(wanted) > 1:
        wanted.discard(S.original_ra)
    return sorted(wanted)


def run_capped(S: Session, model: Path, precision: str, container: Path, locality: bool, cap_name: str) -> None:
    """Scenario (b): RAM capped by a cgroup v1 memory group (page cache included), each engine cold (page cache
    dropped) then warm (run again at once: under the cap the group's page cache is charged to it, so a warm run
    after the other engine's would inherit that engine's pages), ROUNDS alternated rounds."""
    cap = cap_bytes_of(cap_name, container_bytes(container))
    group = CappedGroup(cap, f"cap-{cap_name}")
    sidecar = container / ".colibri-hotset"
    try:
        # One unmeasured run on another stretch of the same kind of text, under the same budget: on olmoe-skew the
        # learned hot set comes from it (earlier traffic), and on every model it brings the virtual disk's host
        # cache to the state the later runs see, so the first measured run does not pay for it alone.
        sidecar.unlink(missing_ok=True)
        log(f"{model.name}/{precision} cap {cap_name}: a first, unmeasured run")
        measured(run_colibri, container, cap, group, locality, seed=77, tune=S.tune)
        learned = sidecar.read_bytes() if model.name == "olmoe-skew" and sidecar.is_file() else None
        for r in range(ROUNDS):
            for engine in engine_order(r):
                gguf = S.gguf(model, precision) if engine == "llama.cpp" else None
                if engine == "llama.cpp" and gguf is None:
                    continue
                variants = ([(p, S.original_ra) for p in CAPPED_POLICIES] if engine == "colibri"
                            else [("mmap", ra) for ra in llama_readaheads(S, cap)[::1 if r % 2 == 0 else -1]])
                for variant, ra in variants:
                    for temp in ("cold", "warm"):
                        set_readahead(S.disk, ra)
                        if temp == "cold":
                            drop_caches()
                        if learned is None:   # a run's own counts, saved at its exit, must not teach the next
                            sidecar.unlink(missing_ok=True)
                        else:
                            sidecar.write_bytes(learned)
                        log(f"{model.name}/{precision} cap {cap_name} {temp} {engine} {variant} readahead {ra} KiB "
                            f"(round {r + 1})")
                        stats = (measured(run_colibri, container, cap, group, locality, variant, tune=S.tune)
                                 if engine == "colibri" else measured(run_llama, gguf, group, locality))
                        S.save(quiet({"model": model.name, "precision": precision, "scenario": "capped",
                                      "cap_name": cap_name, "cap_bytes": cap, "temp": temp, "engine": engine,
                                      "variant": variant, "readahead_kb": ra, "prompt_tokens": PROMPT_TOKENS,
                                      "round": r + 1, **stats}))
    finally:
        set_readahead(S.disk, S.original_ra)
        group.close()


def run_concurrency(S: Session, model: Path, precision: str, container: Path, locality: bool,
                    cap_name: str) -> None:
    """Scenario (c): ROUNDS rounds, each every stream count on each engine in turn (the engines alternate, and each
    round starts one stream count later), all under one cap, each run from a dropped page cache (colibri's engine
    answers one unmeasured request first; llama.cpp's load populates its mmap under the cap)."""
    cap = None if cap_name == "ram" else cap_bytes_of(cap_name, container_bytes(container))
    group = CappedGroup(cap, f"streams-{cap_name}") if cap else None
    try:
        for r in range(ROUNDS):
            for k in range(len(STREAMS)):
                n = STREAMS[(r + k) % len(STREAMS)]
                for engine in engine_order(r + k):
                    gguf = S.gguf(model, precision) if engine == "llama.cpp" else None
                    if engine == "llama.cpp" and gguf is None:
                        continue
                    # llama.cpp at its better readahead under a cap (128 KiB: see LLAMA_READAHEADS); colibri reads
                    # its experts with O_DIRECT when tuned so, and at the disk's setting otherwise, as capped.
                    ra = min(llama_readaheads(S, cap)) if engine == "llama.cpp" and cap else S.original_ra
                    set_readahead(S.disk, ra)
                    if cap:
                        # Cold, as each capped scenario starts: a page cached by an earlier run stays charged to
                        # that run's group (reparented when it is removed), so llama.cpp's mmap would read it here
                        # for free, outside this cap (measured: in-RAM speed under a third); colibri's O_DIRECT
                        # reads never are.
                        drop_caches()
                    else:   # in RAM, as the in-RAM scenario: both engines start from a warm page cache
                        warm_page_cache([*container.glob("*.safetensors")] if engine == "colibri" else [gguf])
                    log(f"{model.name}/{precision} concurrency {cap_name} {n} streams {engine} readahead {ra} KiB "
                        f"(round {r + 1})")
                    (container / ".colibri-hotset").unlink(missing_ok=True)   # no run teaches the next
                    try:
                        stats = (run_colibri_streams(container, cap, group, locality, n, max(STREAMS), S.tune)
                                 if engine == "colibri" else run_llama_streams(gguf, group, locality, n))
                    except Exception as exc:   # one failed run must not lose the others
                        stats = {"error": f"{type(exc).__name__}: {exc}"}
                    S.save(quiet({"model": model.name, "precision": precision, "scenario": "concurrency",
                                  "cap_name": cap_name, "cap_bytes": cap, "temp": "warm", "engine": engine,
                                  "variant": f"{n} streams", "readahead_kb": ra, "round": r + 1, **stats,
                                  "streams": n}))
    finally:
        set_readahead(S.disk, S.original_ra)
        if group:
            group.close()


# ---- 4. the session ---------------------------------------------------------------------------------------------

def machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    mem = next(int(line.split()[1]) * 1024 for line in Path("/proc/meminfo").read_text().splitlines()
               if line.startswith("MemTotal"))
    flags = Path("/proc/cpuinfo").read_text()
    isa = ("avx512-vnni" if " avx512_vnni" in flags else "avx512" if " avx512f" in flags
           else "avx2" if " avx2" in flags else "scalar")
    return {"cpu": cpu, "cores": os.cpu_count(), "ram_bytes": mem, "isa": isa, "kernel": platform.release(),
            "load_average": os.getloadavg(), "llama_build": llama_build_note()}


def measure_disk(model: Path) -> dict:
    """The disk's sequential O_DIRECT bandwidth on the files the engines read (the two largest shards of ``model``:
    a virtual disk may be cached by its host, so other files can be slower or faster than the model's), at queue
    depth 1 and with 4 concurrent readers, each on a cold page cache and a different shard. For reference only:
    the disk bound is `coli tune`'s, at the engine's own queue depth."""
    first, second = sorted(model.glob("*.safetensors"), key=lambda f: f.stat().st_size)[-2:]
    drop_caches()
    qd1 = disk_bandwidth(first)
    drop_caches()
    qd4 = disk_bandwidth(second, readers=4)
    log(f"disk: {qd1 / 1e9:.2f} GB/s sequential O_DIRECT at queue depth 1, {qd4 / 1e9:.2f} GB/s with 4 readers "
        f"({model.name})")
    return {"disk_bandwidth_qd1": qd1, "disk_bandwidth_4_readers": qd4, "disk_measured_on": model.name}


def run_tune(container: Path) -> tuple[object, dict]:
    """`coli tune --model` on the container (random expert-sized reads of its own shards at queue depths 1-8,
    buffered and O_DIRECT, and the expert kernels' time), saved where `coli run` finds it: every colibri run of the
    bench uses it as `coli run` would, and the disk bound is its bandwidth at the depth it chose."""
    from colibri import tune

    drop_caches()
    subprocess.run([sys.executable, "-c", "from colibri.cli import main; main()", "tune", "--model", str(container)],
                   check=True)
    profile = tune.load_profile(container)
    if profile is None:
        raise SystemExit(f"coli tune saved no profile for {container}")
    c = profile.choices
    summary = {"disk_bandwidth": c.disk_bandwidth, "io_threads": c.io_threads, "io": c.io,
               "staging_buffers": c.staging_buffers, "prefill_chunk": c.prefill_chunk, "lookahead": c.lookahead,
               "expert_bytes": profile.expert_bytes, "qpath": profile.qpath,
               "reads": [{"depth": p.depth, "direct": p.direct, "bytes_per_s": p.bytes_per_s} for p in profile.reads]}
    log(f"coli tune: {c.disk_bandwidth / 1e9:.2f} GB/s at {c.io_threads} I/O threads ({c.io}), prefill chunk "
        f"{c.prefill_chunk}, lookahead {'on' if c.lookahead else 'off'}")
    return profile, summary


def container_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def main() -> int:
    global OWN_CPU
    from machine_load import OwnCpuGroup

    OWN_CPU = OwnCpuGroup.create()
    CACHE.mkdir(parents=True, exist_ok=True)
    RESULTS.mkdir(exist_ok=True)
    base = build_checkpoint(CACHE / "olmoe-synth", skew=False, experts_from=None)
    models = [(base, False)]
    if "olmoe-skew" in MODELS:
        models.append((build_checkpoint(CACHE / "olmoe-skew", skew=True, experts_from=base), True))
    models = [(m, loc) for m, loc in models if m.name in MODELS]
    disk = root_disk()
    first = ensure_container(base, SELECTED_PRECISIONS[0])
    original_ra = int(readahead_file(disk).read_text()) if readahead_file(disk).is_file() else 0
    earlier = None
    if MERGE and (RESULTS / "stream_bench.json").is_file():   # the runs this partial re-run does not repeat
        earlier = json.loads((RESULTS / "stream_bench.json").read_text())
        (RESULTS / "stream_bench.json.prev").write_text(json.dumps(earlier))
    if earlier is not None and earlier.get("tune"):
        from colibri import tune

        profile = tune.load_profile(first)
        results: dict = {**earlier, "runs": []}
    else:
        profile, tuned = run_tune(first)
        results = {"machine": machine(), "disk": disk, **measure_disk(first), "tune": tuned,
                   "disk_bandwidth": tuned["disk_bandwidth"], "prompt_tokens": PROMPT_TOKENS,
                   "decode_tokens": DECODE_TOKENS, "rounds": ROUNDS, "quiet_other_cpu": QUIET_OTHER_CPU,
                   "models": {}, "runs": [], "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    S = Session(results, disk, original_ra, profile)
    # Scenario by scenario, in SCENARIOS' order (the CPU-bound in-RAM runs last by default, when a machine that
    # was busy at the start has most likely calmed down); caps and streams on the first bit width only.
    for scenario in SCENARIOS:
        for i, precision in enumerate(SELECTED_PRECISIONS):
            for model, locality in models:
                if (scenario not in (SKEW_SCENARIOS if model.name == "olmoe-skew" else SCENARIOS)
                        or (i > 0 and scenario != "in_ram")):
                    continue
                container = ensure_container(model, precision)
                size = container_bytes(container)
                caps = {name: cap_bytes_of(name, size) for name in (*CAPS, *STREAM_CAPS) if name != "ram"}
                results["models"][f"{model.name}/{precision}"] = {"bytes": size, "caps": caps}
                if scenario == "in_ram":
                    run_in_ram(S, model, precision, container, locality)
                elif scenario == "capped":
                    for cap_name in CAPS:
                        run_capped(S, model, precision, container, locality, cap_name)
                elif scenario == "concurrency":
                    for cap_name in STREAM_CAPS:
                        run_concurrency(S, model, precision, container, locality, cap_name)
    set_readahead(disk, original_ra)
    results["finished"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    if earlier is not None:
        made = {run_kind(r) for r in results["runs"]}
        results["runs"] = [r for r in earlier["runs"] if run_kind(r) not in made] + results["runs"]
        results["models"] = {**earlier.get("models", {}), **results["models"]}
        results["merged"] = [*earlier.get("merged", []), results["finished"]]
    report(results)
    return 0


def run_kind(run: dict) -> tuple:
    """What a partial re-run replaces: every run of the same scenario, cap, prompt, engine and variant."""
    return tuple(run.get(k) for k in ("model", "precision", "scenario", "cap_name", "prompt_tokens", "engine",
                                      "variant", "streams"))


# ---- 5. the report ----------------------------------------------------------------------------------------------

def runs_of(results: dict, **where) -> list[dict]:
    """The finished runs matching ``where`` (a failed run carries "error" and no speed)."""
    return [r for r in results["runs"] if "error" not in r and all(r.get(k) == v for k, v in where.items())
            and ("decode_tps" in r or "aggregate_tps" in r)]


def chosen(runs: list[dict]) -> tuple[list[dict], bool]:
    """The quiet runs, or every run (flagged contended) when none was quiet."""
    calm = [r for r in runs if r.get("quiet")]
    return (calm, False) if calm else (runs, bool(runs))


def decode_of(run: dict) -> dict:
    """The decode phase's counters (the engine's done.decode), falling back to the whole request's."""
    return run.get("decode") or run


def med(runs: list[dict], value) -> float | None:
    """Median of ``value(run)`` (a key, or a function of a run) over the runs that have it."""
    got = [v for v in ((r.get(value) if isinstance(value, str) else value(r)) for r in runs) if v is not None]
    return statistics.median(got) if got else None


def per_token(key: str):
    def value(run: dict) -> float | None:
        d = decode_of(run)
        return d[key] / max(1, d.get("steps", DECODE_TOKENS)) if d.get(key) is not None else None
    return value


def hit_rate(run: dict) -> float | None:
    d = decode_of(run)
    return float(d["hit_rate"]) if "hit_rate" in d else None


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def calm_note(runs: list[dict], total: int) -> str:
    loads = [r["load_average"] for r in runs if "load_average" in r]
    others = [r["other_cpu_share"] for r in runs if "other_cpu_share" in r]
    if not loads:
        return f"{len(runs)}/{total}"
    return (f"{len(runs)}/{total}, load {min(loads):.1f}-{max(loads):.1f}, others <= "
            f"{100 * max(others):.0f}%")


SPLIT_KEYS = ("io_wait_s", "expert_s", "attention_s", "other_s")   # done.decode's phases, seconds


def summarize(results: dict) -> dict:
    """Medians over quiet runs for every table of the report."""
    bw = results["disk_bandwidth"]
    first = SELECTED_PRECISIONS[0]
    summary: dict = {"in_ram": [], "capped": [], "concurrency": []}
    for precision in SELECTED_PRECISIONS:
        for prompt in IN_RAM_PROMPTS:
            where = dict(model="olmoe-synth", precision=precision, scenario="in_ram", prompt_tokens=prompt)
            c_all, l_all = runs_of(results, engine="colibri", **where), runs_of(results, engine="llama.cpp", **where)
            if not c_all and not l_all:
                continue
            (c, c_busy), (ll, l_busy) = chosen(c_all), chosen(l_all)
            row = {"precision": precision, "prompt": prompt, "contended": c_busy or l_busy,
                   "colibri_prefill": med(c, "prefill_tps"), "colibri_decode": med(c, "decode_tps"),
                   "llama_prefill": med(ll, "prefill_tps"), "llama_decode": med(ll, "decode_tps"),
                   "colibri_runs": calm_note(c, len(c_all)), "llama_runs": calm_note(ll, len(l_all)),
                   "split": {k: med(c, per_token(k)) for k in SPLIT_KEYS}}
            row["prefill_ratio"] = ratio(row["colibri_prefill"], row["llama_prefill"])
            row["decode_ratio"] = ratio(row["colibri_decode"], row["llama_decode"])
            summary["in_ram"].append(row)
    # Where most experts are cached the disk bound exceeds what the cores compute: the machine's bound is then the
    # engine's own in-RAM decode (same bits, same prompt, this session), the speed with every read hidden.
    in_ram_decode = next((r["colibri_decode"] for r in summary["in_ram"]
                          if r["precision"] == first and r["prompt"] == PROMPT_TOKENS), None)
    for cap_name in CAPS:
        for temp in ("cold", "warm"):
            where = dict(model="olmoe-synth", precision=first, scenario="capped", cap_name=cap_name, temp=temp)
            c_all = runs_of(results, engine="colibri", variant="auto", **where)
            if not c_all:
                continue
            c, c_busy = chosen(c_all)
            peers = {}
            for ra in sorted({r["readahead_kb"] for r in runs_of(results, engine="llama.cpp", **where)}):
                l_all = runs_of(results, engine="llama.cpp", readahead_kb=ra, **where)
                ll, l_busy = chosen(l_all)
                peers[ra] = {"decode": med(ll, "decode_tps"), "prefill": med(ll, "prefill_tps"),
                             "read": med(ll, lambda r: r.get("bytes_read_decode", 0) / DECODE_TOKENS),
                             "load_s": med(ll, "load_s"),
                             "runs": calm_note(ll, len(l_all)), "contended": l_busy}
            best_ra = max(peers, key=lambda ra: peers[ra]["decode"] or 0) if peers else None
            peer = peers.get(best_ra, {})
            hit = med(c, hit_rate)
            routed = c[0].get("routed_bytes_per_token", 0)
            miss_bytes = (1 - (hit or 0)) * routed
            bound = bw / miss_bytes if miss_bytes > 0 else None
            row = {"cap_name": cap_name, "cap_bytes": c[0].get("cap_bytes"), "temp": temp,
                   "contended": c_busy or peer.get("contended", False),
                   "colibri_prefill": med(c, "prefill_tps"), "colibri_decode": med(c, "decode_tps"),
                   "hit_rate": hit, "read": med(c, per_token("bytes_read")),
                   "rss": max(r.get("peak_rss_bytes", 0) for r in c), "bound": bound, "load_s": med(c, "load_s"),
                   "split": {k: med(c, per_token(k)) for k in SPLIT_KEYS},
                   "colibri_runs": calm_note(c, len(c_all)), "llama": peers, "llama_best_ra": best_ra,
                   "llama_decode": peer.get("decode"), "llama_prefill": peer.get("prefill")}
            row["decode_ratio"] = ratio(row["colibri_decode"], row["llama_decode"])
            row["prefill_ratio"] = ratio(row["colibri_prefill"], row["llama_prefill"])
            row["share_of_bound"] = ratio(row["colibri_decode"], bound)
            row["machine_bound"] = min((b for b in (bound, in_ram_decode) if b), default=None)
            row["share_of_machine_bound"] = ratio(row["colibri_decode"], row["machine_bound"])
            row["policies"] = {}
            for variant in sorted({r["variant"] for r in runs_of(results, engine="colibri", **where)} - {"auto"}):
                v_all = runs_of(results, engine="colibri", variant=variant, **where)
                v, v_busy = chosen(v_all)
                row["policies"][variant] = {"decode": med(v, "decode_tps"), "hit_rate": med(v, hit_rate),
                                            "io_wait": med(v, per_token("io_wait_s")),
                                            "runs": calm_note(v, len(v_all)), "contended": v_busy,
                                            "prefetch_used": med(v, lambda r: decode_of(r).get("prefetch_used")),
                                            "prefetch_issued": med(v, lambda r: decode_of(r).get("prefetch_issued"))}
            summary["capped"].append(row)
    made = {r.get("cap_name") for r in results["runs"] if r.get("scenario") == "concurrency"}
    stream_caps = [c for c in STREAM_CAPS if c in made] + sorted(c for c in made if c not in STREAM_CAPS)
    for cap_name, model in ((c, m) for c in stream_caps for m in MODELS):
        one: dict = {}
        rows = []
        for n in STREAMS:
            row: dict = {"model": model, "streams": n, "cap_name": cap_name}
            for engine in ENGINES:
                all_runs = [r for r in runs_of(results, model=model, engine=engine, precision=first,
                                               scenario="concurrency", streams=n, cap_name=cap_name)
                            if r.get("aggregate_tps")]
                runs, busy = chosen(all_runs)
                row[engine] = {"aggregate": med(runs, "aggregate_tps"), "hit_rate": med(runs, hit_rate),
                               "read": med(runs, per_token("bytes_read")), "runs": calm_note(runs, len(all_runs)),
                               "contended": busy}
                if n == 1:
                    one[engine] = row[engine]["aggregate"]
            if any(row[e]["aggregate"] for e in ENGINES):
                rows.append(row)
        for row in rows:
            for engine in ENGINES:
                row[engine]["x_one"] = ratio(row[engine]["aggregate"], one.get(engine))
        summary["concurrency"] += rows
    summary["targets"] = targets(summary)
    return summary


def targets(summary: dict) -> list[tuple[str, str, bool | None]]:
    """The issue's targets, each (what, the measured figures, met?)."""
    out: list[tuple[str, str, bool | None]] = []
    ram = summary["in_ram"]
    ratios = [(f"{r['precision']} {r['prompt']}", r["prefill_ratio"], r["decode_ratio"]) for r in ram]
    if ratios:
        out.append(("in RAM, prefill and decode >= 1.0x llama.cpp (Q8_0, Q4_0)",
                    "; ".join(f"{k}: prefill {fmt(p)}x, decode {fmt(d)}x" for k, p, d in ratios),
                    all(p is not None and d is not None and p >= 1.0 and d >= 1.0 for _, p, d in ratios)))
    capped = summary["capped"]
    if capped:
        out.append(("capped decode >= 3x llama.cpp's best readahead",
                    "; ".join(f"{r['cap_name']} {r['temp']}: {fmt(r['decode_ratio'])}x" for r in capped),
                    all(r["decode_ratio"] is not None and r["decode_ratio"] >= 3.0 for r in capped)))
        out.append(("capped decode >= 80% of the disk bound (coli tune's bandwidth at the engine's queue depth)",
                    "; ".join(f"{r['cap_name']} {r['temp']}: {pct(r['share_of_bound'])}" for r in capped),
                    all(r["share_of_bound"] is not None and r["share_of_bound"] >= 0.8 for r in capped)))
        out.append(("(context, not the issue's target) capped decode >= 80% of the machine bound: the disk bound, "
                    "or colibri's own in-RAM decode where that is lower",
                    "; ".join(f"{r['cap_name']} {r['temp']}: {pct(r['share_of_machine_bound'])}" for r in capped),
                    all(r["share_of_machine_bound"] is not None and r["share_of_machine_bound"] >= 0.8
                        for r in capped)))
    for what, in_ram in (("aggregate decode at 4 streams >= 2x one stream under the cap", False),
                         ("(context, not the issue's target) the same in RAM", True)):
        fours = [(f"{r['model']} {r['cap_name']}", r["colibri"].get("x_one")) for r in summary["concurrency"]
                 if r["streams"] == 4 and "colibri" in r and (r["cap_name"] == "ram") == in_ram]
        if fours:
            out.append((what, "; ".join(f"{m}: {fmt(x)}x" for m, x in fours),
                        all(x is not None and x >= 2.0 for _, x in fours)))
    return out


def fmt(v, spec=".2f") -> str:
    return "–" if v is None else format(v, spec)


def mb(v: float | None) -> str:
    return "–" if v is None else f"{v / 1e6:.0f} MB"


def pct(v: float | None) -> str:
    return "–" if v is None else f"{100 * v:.0f}%"


def report(results: dict) -> None:
    summary = summarize(results)
    results["summary"] = summary
    (RESULTS / "stream_bench.json").write_text(json.dumps(results, indent=1, default=str))
    chart = ([(f"{r['precision']} in RAM\n{r['prompt']}-token", r["colibri_decode"], r["llama_decode"])
              for r in summary["in_ram"]] +
             [(f"cap {r['cap_name']}\n{r['temp']}", r["colibri_decode"], r["llama_decode"])
              for r in summary["capped"]])
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(max(8, 1.1 * len(chart)), 4.5))
        xs = np.arange(len(chart))
        ax.bar(xs - 0.2, [c[1] or 0 for c in chart], 0.4, label="colibri (container)")
        ax.bar(xs + 0.2, [c[2] or 0 for c in chart], 0.4, label="llama.cpp (GGUF, best readahead)")
        ax.set_xticks(xs, [c[0] for c in chart], fontsize=7)
        ax.set_ylabel("decode tok/s (teacher-forced)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(RESULTS / "stream_bench.png", dpi=120)
        fig.savefig(ROOT / "docs" / "stream-bench.png", dpi=120)   # the chart docs/benchmarks.md shows
    except ImportError:
        log("matplotlib missing: no chart")
    write_markdown(results, summary)


def write_markdown(results: dict, summary: dict) -> None:
    m, t = results["machine"], results["tune"]
    first = SELECTED_PRECISIONS[0]
    sizes = ", ".join(f"{k} {v['bytes'] / 1e9:.2f} GB" for k, v in results["models"].items())
    caps = results["models"].get(f"olmoe-synth/{first}", {}).get("caps", {})
    depth = next((p for p in t["reads"] if p["depth"] == t["io_threads"] and p["direct"] == (t["io"] == "direct")),
                 None)
    lines = [
        f"Generated by `nox -s bench` (`engines/bench/stream_bench.py`), {results.get('started', '')} to "
        f"{results.get('finished', '')}" +
        (f" (including partial re-runs merged at {', '.join(results['merged'])})" if results.get("merged") else "") +
        "; raw figures, every run with its load, in `bench-results/stream_bench.json`. "
        "A synthetic random-weight checkpoint at the real OLMoE-1B-7B geometry (16 layers, hidden 2048, 64 experts "
        "top-8, expert width 1024, vocab 50304). Same bit width on both sides: colibri's int8 container (experts "
        "and dense int8 per row, f16 scales) against llama.cpp's Q8_0, and int4-g64 against Q4_0, each GGUF made by "
        "the llama-cpp-python 0.3.36 sdist's own converter and quantizer; libllama built "
        + m.get("llama_build", LLAMA_NATIVE_NOTE) + ". Sizes: " + sizes + ". Workload: a "
        f"{PROMPT_TOKENS}-token prompt (in RAM also {', '.join(str(p) for p in IN_RAM_PROMPTS if p != PROMPT_TOKENS)})"
        f", then {DECODE_TOKENS} teacher-forced decode steps (greedy decoding of a random model loops and flatters "
        "any cache). Both engines 2 threads; llama.cpp gets the whole prompt in one batch.", "",
        f"Machine: {m['cpu']}, {m['cores']} cores ({m['isa']}), {m['ram_bytes'] / 2**30:.0f} GiB RAM, kernel "
        f"{m['kernel']}. Disk `{results['disk']}`: `coli tune --model` on the int8 container measured "
        f"{t['disk_bandwidth'] / 1e9:.2f} GB/s at {t['io_threads']} I/O threads ({t['io']}), the depth it chose "
        f"for the engine" + (f" ({depth['bytes_per_s'] / 1e9:.2f} GB/s)" if depth else "") + "; sequential "
        f"O_DIRECT reads gave {results['disk_bandwidth_qd1'] / 1e9:.2f} GB/s (one reader) and "
        f"{results['disk_bandwidth_4_readers'] / 1e9:.2f} GB/s (four). Every colibri run uses that profile, as "
        "`coli run` does. The disk bound is tune's bandwidth / ((1 - decode hit rate) x routed bytes per token); "
        "the machine bound is the lower of it and colibri's own in-RAM decode measured here (same bits and prompt): "
        "a token can go no faster than its compute with every read hidden.",
        "",
        f"Method: {results['rounds']} rounds per scenario, the engines alternating (each round starts with the "
        "other). Every run records the 1-minute load average and the share of the machine's CPU other processes "
        f"took while it ran (the bench's own processes are in a cpuacct group); a run with others above "
        f"{100 * results['quiet_other_cpu']:.0f}% is contended and left out of the medians (the `runs` columns say "
        "how many were kept, of how many). Caps are cgroup v1 memory limits, page cache included "
        f"({', '.join(f'{k} = {v / 2**30:.2f} GiB' for k, v in caps.items())}); colibri plans for the whole cap. "
        "Cold: page cache dropped before the run; warm: each engine's run again at once (under a cap the group's "
        "page cache is charged to it). In RAM: files read first, and colibri answers one unrelated request first "
        "(its cache fills lazily; llama.cpp's mmap is populated at load).", "",
        "### In RAM, warm", "",
        "| bits | prompt | colibri prefill tok/s | colibri decode tok/s | llama.cpp prefill | llama.cpp decode | "
        "prefill ratio | decode ratio | colibri runs | llama.cpp runs |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in summary["in_ram"]:
        lines.append(f"| {r['precision']} | {r['prompt']} | {fmt(r['colibri_prefill'], '.1f')} | "
                     f"{fmt(r['colibri_decode'])} | {fmt(r['llama_prefill'], '.1f')} | {fmt(r['llama_decode'])} | "
                     f"{fmt(r['prefill_ratio'])} | {fmt(r['decode_ratio'])} | {r['colibri_runs']} | "
                     f"{r['llama_runs']} |")
    lines += ["", f"### Under a RAM cap ({first})", "",
              "llama.cpp's figure is its better readahead (the KiB column); its other readahead is in the JSON.", "",
              "| cap | run | colibri prefill | colibri decode | hit rate | read/token | peak RSS | load s | llama.cpp "
              "prefill | llama.cpp decode (readahead KiB) | llama.cpp read/token | llama.cpp load s | decode ratio | "
              "prefill ratio | disk bound tok/s | share of bound | machine bound tok/s | share of machine bound | "
              "colibri runs | llama.cpp runs |",
              "|" + "---|" * 20]
    for r in summary["capped"]:
        peer = r["llama"].get(r["llama_best_ra"], {})
        lines.append(f"| {r['cap_name']} ({r['cap_bytes'] / 2**30:.2f} GiB) | {r['temp']} | "
                     f"{fmt(r['colibri_prefill'], '.1f')} | {fmt(r['colibri_decode'])} | {pct(r['hit_rate'])} | "
                     f"{mb(r['read'])} | {r['rss'] / 2**30:.2f} GiB | {fmt(r['load_s'], '.1f')} | "
                     f"{fmt(r['llama_prefill'], '.1f')} | {fmt(r['llama_decode'])} ({r['llama_best_ra']}) | "
                     f"{mb(peer.get('read'))} | {fmt(peer.get('load_s'), '.1f')} | "
                     f"{fmt(r['decode_ratio'])} | {fmt(r['prefill_ratio'])} | {fmt(r['bound'])} | "
                     f"{pct(r['share_of_bound'])} | {fmt(r['machine_bound'])} | {pct(r['share_of_machine_bound'])} | "
                     f"{r['colibri_runs']} | {peer.get('runs', '–')} |")
    variants = sorted({v for r in summary["capped"] for v in r["policies"]})
    if variants:
        lines += ["", "Other caching policies under the same caps (colibri alone, same rounds; each cell decode tok/s, "
                  "hit rate, I/O wait ms per token; the default's figures for comparison):", "",
                  "| cap | run | default (" + POLICY_LABELS["auto"] + ") | " +
                  " | ".join(POLICY_LABELS.get(v, v) for v in variants) + " |",
                  "|---|---|---|" + "---|" * len(variants)]
        for r in summary["capped"]:
            cells = [f"{fmt(r['colibri_decode'])}, {pct(r['hit_rate'])}, "
                     f"{fmt(1000 * r['split']['io_wait_s'] if r['split']['io_wait_s'] is not None else None, '.0f')}"]
            for v in variants:
                p = r["policies"].get(v)
                cells.append(f"{fmt(p['decode'])}, {pct(p['hit_rate'])}, "
                             f"{fmt(1000 * p['io_wait'] if p['io_wait'] is not None else None, '.0f')} "
                             f"({p['runs'].split(',')[0]} runs)" if p else "–")
            lines.append(f"| {r['cap_name']} | {r['temp']} | " + " | ".join(cells) + " |")
    lines += ["", "Where colibri's decode time went (milliseconds per decode token, `done.decode`):", "",
              "| scenario | run | I/O wait | expert matmul | attention | other |", "|---|---|---|---|---|---|"]
    for label, r in ([(f"in RAM {r['precision']}", r) for r in summary["in_ram"]] +
                     [(f"cap {r['cap_name']}", r) for r in summary["capped"]]):
        s = r["split"]
        run = f"warm, {r['prompt']}-token prompt" if "prompt" in r else r["temp"]
        lines.append(f"| {label} | {run} | " +
                     " | ".join(fmt(1000 * s[k] if s[k] is not None else None, ".1f") for k in SPLIT_KEYS) + " |")
    if summary["concurrency"]:
        lines += ["", f"### Concurrency ({first}): under a cap, and in RAM", "",
                  f"One engine of {max(STREAMS)} slots for every stream count; the streams start together, each a "
                  f"different {PROMPT_TOKENS}-token prompt and {DECODE_TOKENS} teacher-forced steps. Aggregate "
                  "decode tok/s: colibri, tokens after the last stream's first one over the wall time from then to "
                  "the last token; llama.cpp (parallel sequences through llama-cpp-python's batch API, one "
                  "`llama_decode` of one token per sequence, as llama-server's slots do), every sequence's steps "
                  "over the batched decode loop's time. llama.cpp runs on the plain model only.", "",
                  "| cap | model | streams | colibri aggregate tok/s | x one stream | hit rate | read/token | "
                  "colibri runs | llama.cpp aggregate tok/s | x one stream | llama.cpp runs | colibri / llama.cpp |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in summary["concurrency"]:
            c, ll = r.get("colibri", {}), r.get("llama.cpp", {})
            lines.append(f"| {r['cap_name']} | {r['model']} | {r['streams']} | {fmt(c.get('aggregate'))} | "
                         f"{fmt(c.get('x_one'))} | "
                         f"{pct(c.get('hit_rate'))} | {mb(c.get('read'))} | {c.get('runs', '–')} | "
                         f"{fmt(ll.get('aggregate'))} | {fmt(ll.get('x_one'))} | {ll.get('runs', '–')} | "
                         f"{fmt(ratio(c.get('aggregate'), ll.get('aggregate')))} |")
    lines += ["", "### Targets (issue 24)", "", "| target | measured | met |", "|---|---|---|"]
    for what, figures, met in summary["targets"]:
        lines.append(f"| {what} | {figures} | {'yes' if met else 'no'} |")
    lines += ["", "![decode tok/s, colibri vs llama.cpp](stream-bench.png)", "",
              "<details><summary>Every run, in the order made</summary>", "",
              "| scenario | bits | prompt | cap | run | engine | variant | readahead | round | prefill tok/s | "
              "decode tok/s | load avg | others' CPU | kept |", "|" + "---|" * 14]
    for r in results["runs"]:
        speed = (fmt(r.get("decode_tps") or r.get("aggregate_tps")) if "error" not in r
                 else f"error: {r['error'][:60]}")
        lines.append(f"| {r.get('scenario')} | {r.get('precision')} | {r.get('prompt_tokens', '–')} | "
                     f"{r.get('cap_name', '–')} | {r.get('temp', '–')} | {r.get('engine')} | {r.get('variant')} | "
                     f"{r.get('readahead_kb', '–')} | {r.get('round', '–')} | {fmt(r.get('prefill_tps'), '.1f')} | "
                     f"{speed} | {fmt(r.get('load_average'), '.1f')} | {pct(r.get('other_cpu_share'))} | "
                     f"{'yes' if r.get('quiet') else 'no'} |")
    lines += ["", "</details>", ""]
    write_section(ROOT / "docs" / "benchmarks.md", "stream-bench", "\n".join(lines))


def write_section(path: Path, name: str, body: str,
                  title: str = "Streaming: colibri vs llama.cpp at OLMoE-1B-7B geometry") -> None:
    """Replace a bench's marked section of the page (other benches own other sections), atomically."""
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    text = path.read_text() if path.is_file() else "# Benchmarks\n"
    block = f"{begin}\n## {title}\n\n{body.rstrip()}\n{end}\n"
    if begin in text and end in text:
        text = text[:text.index(begin)] + block + text[text.index(end) + len(end) + 1:]
    else:
        text = text.rstrip("\n") + "\n\n" + block
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def report_again() -> int:
    """``--report``: rewrite the report from the saved runs (no engine is run)."""
    report(json.loads((RESULTS / "stream_bench.json").read_text()))
    return 0


if __name__ == "__main__":
    sys.exit(report_again() if sys.argv[1:] == ["--report"] else main())
