"""colibri vs llama.cpp on a synthetic checkpoint at the real OLMoE-1B-7B geometry (``nox -s bench``).

Stages, each cached under ``$COLIBRI_BENCH_CACHE`` (default ``~/.cache/colibri/bench``), never in the repository:

1. Checkpoints: random bf16 weights at OLMoE-1B-7B's geometry, written shard by shard with numpy (one dense shard,
   one expert shard per layer; never the whole model in memory), plus a router-skewed variant that shares the
   expert shards (hard links) and differs in its embeddings and routers: every embedding carries a common
   direction and router row e leans on it by a Zipf-like amount, so expert popularity falls off with rank.
2. llama.cpp: the ``llama-cpp-python`` sdist built once into a cached wheel, and each checkpoint converted by the
   sdist's own ``convert_hf_to_gguf.py`` (its gguf-py first on sys.path) to bf16 GGUF.
3. Runs, A/B alternated: (a) model in RAM, page cache warm; (b) RAM capped at ~1/3 of the model by a cgroup v1
   memory child group under this process's own group, page cache dropped first. The same 64-token prompt, then
   32 teacher-forced decode steps (the protocol's ``forced`` field; greedy decode of a random model loops on two
   tokens and flatters any cache). llama.cpp runs with readahead at 128 KiB and at the disk's setting; the better
   is the peer. (c) Concurrency under the same cap: 1, 2 and 4 streams started together on one engine of 4 slots
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
# COLIBRI_BENCH_MODELS=olmoe-synth skips the skewed variant.
ENGINES = tuple(os.environ.get("COLIBRI_BENCH_ENGINES", "colibri,llama.cpp").split(","))
MODELS = tuple(os.environ.get("COLIBRI_BENCH_MODELS", "olmoe-synth,olmoe-skew").split(","))
# COLIBRI_BENCH_PRECISIONS=int8,int4 adds the 4-bit comparison (int4-g64 vs Q4_0); int8 vs Q8_0 is the default.
SELECTED_PRECISIONS = tuple(os.environ.get("COLIBRI_BENCH_PRECISIONS", "int8").split(","))
# COLIBRI_BENCH_SCENARIOS=capped re-measures one scenario; COLIBRI_BENCH_MERGE=1 then replaces only the runs it
# made in bench-results/stream_bench.json and keeps the others (a partial re-run after a fix).
SCENARIOS = tuple(os.environ.get("COLIBRI_BENCH_SCENARIOS", "in_ram,capped,concurrency").split(","))
# The concurrency scenario's stream counts (COLIBRI_BENCH_STREAMS=1,4 measures fewer).
STREAMS = tuple(int(n) for n in os.environ.get("COLIBRI_BENCH_STREAMS", "1,2,4").split(","))
MERGE = os.environ.get("COLIBRI_BENCH_MERGE") == "1"
# Under the cap every colibri policy runs this many times, the policies interleaved round by round, and the report
# takes each one's median: one 32-token run on a shared virtual machine can be 15% off either way.
ROUNDS = int(os.environ.get("COLIBRI_BENCH_ROUNDS", "3"))
# COLIBRI_BENCH_LLAMA_READAHEAD=128 skips llama.cpp at the disk's own readahead under the cap (12x slower there).
LLAMA_READAHEADS = os.environ.get("COLIBRI_BENCH_LLAMA_READAHEAD", "128,disk").split(",")
# llama.cpp is the peer on the plain synthetic model; the skewed one measures colibri's caching policies.
LLAMA_MODELS = ("olmoe-synth",)


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

def wheel_build_running(sdist: Path) -> bool:
    """Whether another process is building the wheel from this sdist (pip is silent while cmake runs)."""
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"wheel" in cmd and any(sdist.name.encode() in part for part in cmd) and int(proc.name) != os.getpid():
            return True
    return False


def ensure_llama_cpp() -> Path:
    """Install the cached wheel (building it from the sdist once); returns the unpacked sdist."""
    sdist_dir, wheel_dir = CACHE / "sdist", CACHE / "wheels"
    sdist_dir.mkdir(parents=True, exist_ok=True)
    wheel_dir.mkdir(parents=True, exist_ok=True)
    sdist = sdist_dir / f"llama_cpp_python-{LLAMA_VERSION}.tar.gz"
    if not sdist.is_file():
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        f"llama-cpp-python=={LLAMA_VERSION}", "-d", str(sdist_dir)], check=True)
    wheels = sorted(wheel_dir.glob("llama_cpp_python-*.whl"))
    build_log = wheel_dir / "build.log"
    while not wheels and wheel_build_running(sdist):
        time.sleep(15)   # another bench run is building the wheel: wait for it rather than build twice
        wheels = sorted(wheel_dir.glob("llama_cpp_python-*.whl"))
    if not wheels:
        log("building llama-cpp-python from its sdist (several minutes)")
        env = {**os.environ, "CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count() or 2),
               "CMAKE_ARGS": "-DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF "
                             "-DLLAMA_BUILD_SERVER=OFF"}
        with open(build_log, "w") as fh:
            subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", str(sdist), "-w", str(wheel_dir)],
                           check=True, env=env, stdout=fh, stderr=subprocess.STDOUT)
        wheels = sorted(wheel_dir.glob("llama_cpp_python-*.whl"))
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", str(wheels[-1])], check=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "diskcache", "typing-extensions", "sentencepiece"],
                   check=False)
    unpacked = CACHE / "sdist" / f"llama_cpp_python-{LLAMA_VERSION}"
    if not unpacked.is_dir():
        subprocess.run(["tar", "xzf", str(sdist), "-C", str(sdist_dir)], check=True)
    return unpacked / "vendor" / "llama.cpp"


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
                        f"LLAMA_FTYPE_MOSTLY_{gguf_type.upper()}"], check=True)
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
llm = Llama(model_path=sys.argv[1], n_ctx=512, n_threads=2, n_threads_batch=2, n_batch=64, verbose=False)
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


def workload(vocab: int, locality: bool, seed: int = 1234) -> tuple[list[int], list[int]]:
    rng = random.Random(seed)
    prompt = [rng.randrange(2, vocab) for _ in range(PROMPT_TOKENS)]
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
            "prefetch": {"pin": False}, "lookahead": {"lookahead": True}}
POLICY_LABELS = {"lru": "LRU", "hotset": "hot set", "prefetch": "LRU + prefetch",
                 "auto": "duel + prefetch (default)", "lookahead": "default + lookahead"}


def run_colibri(model: Path, ram: int | None, group: CappedGroup | None, locality: bool, policy: str = "auto",
                warm_request: bool = False, seed: int = 1234) -> dict:
    """One engine process: load, (optionally one unrelated warm-up request), then the measured request.

    ``policy``: a key of POLICIES."""
    from colibri import launch
    from colibri.engine import Engine
    from colibri.model import resolve_model

    resolved = resolve_model(str(model), None)
    streaming = launch.Streaming(**POLICIES[policy])
    spec = launch.prepare(resolved, ram_gib=(ram / launch.GIB) if ram else None, ctx=256, threads=2,
                          streaming=streaming)
    argv = group.wrap(list(spec.argv)) if group else list(spec.argv)
    prompt, forced = workload(GEOM["vocab"], locality, seed)
    t = time.perf_counter()
    with Engine(argv, env=spec.env, ready_timeout=1800) as eng:
        load_s = time.perf_counter() - t
        if warm_request:
            # colibri's cache fills lazily while llama.cpp's mmap is populated at load: in the warm in-RAM
            # scenario one unrelated request (another prompt: no prefix to reuse) makes both start warm.
            warm_prompt, warm_forced = workload(GEOM["vocab"], locality, seed=99)
            eng.generate(warm_prompt, max_tokens=DECODE_TOKENS, forced=warm_forced)
        result = eng.generate(prompt, max_tokens=DECODE_TOKENS, forced=forced)
        rss = peak_rss(eng.proc.pid)
    stats = dict(result.stats)
    stats.update({"load_s": load_s, "peak_rss_bytes": rss, "cap": int(spec.argv[spec.argv.index("--cap") + 1]),
                  "routed_bytes_per_token": spec.plan.routed_bytes_per_token, "policy": policy})
    return stats


def run_llama(gguf: Path, group: CappedGroup | None, locality: bool) -> dict:
    prompt, forced = workload(GEOM["vocab"], locality)
    argv = [sys.executable, "-c", LLAMA_RUNNER, str(gguf), json.dumps(prompt), json.dumps(forced)]
    proc = subprocess.run(group.wrap(argv) if group else argv, capture_output=True, text=True, timeout=7200)
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


def run_colibri_streams(model: Path, ram: int, group: CappedGroup | None, locality: bool, n: int,
                        slots: int) -> dict:
    """One engine of ``slots`` slots under the budget: an unmeasured warm-up request, then n streams sent in one
    write, so they prefill in the same round and decode together. Aggregate decode tok/s is the tokens that came
    after the last stream's first token over the wall time from then to the last one."""
    from concurrent.futures import ThreadPoolExecutor

    from colibri import launch
    from colibri.engine import Engine
    from colibri.model import resolve_model
    from machine_load import LoadWindow

    spec = launch.prepare(resolve_model(str(model), None), ram_gib=ram / launch.GIB, ctx=256, slots=slots,
                          threads=2)
    argv = group.wrap(list(spec.argv)) if group else list(spec.argv)
    with Engine(argv, env=spec.env, ready_timeout=1800) as eng:
        warm_prompt, warm_forced = workload(GEOM["vocab"], locality, seed=99)
        eng.generate(warm_prompt, max_tokens=DECODE_TOKENS, forced=warm_forced)
        eng.reset(0)
        with LoadWindow((eng.proc.pid,)) as window, ThreadPoolExecutor(n) as pool:
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
    from machine_load import LoadWindow

    argv = [sys.executable, "-c", LLAMA_PARALLEL_RUNNER, str(gguf),
            json.dumps(stream_workloads(GEOM["vocab"], locality, n))]
    with LoadWindow() as window:
        proc = subprocess.run(group.wrap(argv) if group else argv, capture_output=True, text=True, timeout=7200)
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"}
    return {**json.loads(proc.stdout.strip().splitlines()[-1]), "streams": n, "load_average": window.load_average,
            "other_cpu_share": window.other_cpu_share}


def run_concurrency(results: dict, model: Path, precision: str, container: Path, gguf, cap_bytes: int,
                    locality: bool) -> None:
    """Scenario (c): ROUNDS rounds, each every stream count on each engine in turn (the engines alternate, and each
    round starts one stream count later), all under the capped group, the page cache warm from earlier runs."""
    group = CappedGroup(cap_bytes, "streams")
    try:
        for r in range(ROUNDS):
            for k in range(len(STREAMS)):
                n = STREAMS[(r + k) % len(STREAMS)]
                for engine in ENGINES:
                    path = gguf(model, precision) if engine == "llama.cpp" else container
                    if path is None:
                        continue
                    log(f"{model.name}/{precision} concurrency {n} streams {engine} (round {r + 1})")
                    (container / ".colibri-hotset").unlink(missing_ok=True)   # no run teaches the next
                    try:
                        stats = (run_colibri_streams(container, int(cap_bytes * 0.9), group, locality, n, max(STREAMS))
                                 if engine == "colibri" else run_llama_streams(path, group, locality, n))
                    except Exception as exc:   # one failed run must not lose the others
                        stats = {"error": f"{type(exc).__name__}: {exc}"}
                    log(json.dumps(stats)[:300])
                    results["runs"].append({"model": model.name, "precision": precision, "scenario": "concurrency",
                                            "temp": "warm", "engine": engine, "variant": f"{n} streams",
                                            **stats, "streams": n})
                    (RESULTS / "stream_bench.json").write_text(json.dumps(results, indent=1))
    finally:
        group.close()


# ---- 3. the runs and the report ---------------------------------------------------------------------------------

def machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    mem = next(int(line.split()[1]) * 1024 for line in Path("/proc/meminfo").read_text().splitlines()
               if line.startswith("MemTotal"))
    flags = Path("/proc/cpuinfo").read_text()
    isa = "avx512" if " avx512f" in flags else "avx2" if " avx2" in flags else "scalar"
    return {"cpu": cpu, "cores": os.cpu_count(), "ram_bytes": mem, "isa": isa, "kernel": platform.release(),
            "load_average": os.getloadavg()}


def measure_disk(model: Path) -> dict:
    """The disk's sequential O_DIRECT bandwidth on the files the engines read (the two largest shards of ``model``:
    a virtual disk may be cached by its host, so other files can be slower or faster than the model's), at queue
    depth 1 and with 4 concurrent readers (colibri's I/O pool reads several experts at once), each on a cold page
    cache and a different shard; the bound uses the better."""
    first, second = sorted(model.glob("*.safetensors"), key=lambda f: f.stat().st_size)[-2:]
    drop_caches()
    qd1 = disk_bandwidth(first)
    drop_caches()
    qd4 = disk_bandwidth(second, readers=4)
    log(f"disk: {qd1 / 1e9:.2f} GB/s sequential O_DIRECT at queue depth 1, {qd4 / 1e9:.2f} GB/s with 4 readers "
        f"({model.name})")
    return {"disk_bandwidth": max(qd1, qd4), "disk_bandwidth_qd1": qd1, "disk_bandwidth_4_readers": qd4,
            "disk_measured_on": model.name}


def container_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def plan_runs(scenario: str, model_name: str, original_ra: int) -> list[tuple[str, str, int]]:
    """(engine, variant, readahead KiB) in A/B order for one scenario: colibri as `coli run` would start it, the
    other POLICIES under the cap (the policy comparison), llama.cpp at each readahead worth trying (the better one
    is the peer; readahead only matters when pages are evicted)."""
    runs = []
    for engine in ENGINES:
        if engine == "colibri":
            rounds = ROUNDS if scenario == "capped" else 1
            policies = list(POLICIES) if scenario == "capped" else ["auto"]
            for r in range(rounds):   # each round starts one policy later, so none is always first
                runs += [("colibri", policies[(r + i) % len(policies)], original_ra) for i in range(len(policies))]
        elif engine == "llama.cpp" and model_name in LLAMA_MODELS:
            wanted = {original_ra if r == "disk" else int(r) for r in LLAMA_READAHEADS}
            for ra in (sorted(wanted) if scenario == "capped" else [original_ra]):
                runs.append(("llama.cpp", "mmap", ra))
    return runs


def main() -> int:
    CACHE.mkdir(parents=True, exist_ok=True)
    RESULTS.mkdir(exist_ok=True)
    base = build_checkpoint(CACHE / "olmoe-synth", skew=False, experts_from=None)
    skew = build_checkpoint(CACHE / "olmoe-skew", skew=True, experts_from=base)
    disk = root_disk()
    bandwidth = measure_disk(ensure_container(base, SELECTED_PRECISIONS[0]))
    llama_state: dict = {}

    def llama_gguf(model: Path, precision: str) -> Path | None:
        """llama.cpp set up on first use, so colibri's figures arrive even if the wheel cannot be built."""
        if "dir" not in llama_state:
            try:
                llama_state["dir"] = ensure_llama_cpp()
            except (subprocess.CalledProcessError, OSError) as exc:
                log(f"llama.cpp unavailable: {exc}")
                llama_state["dir"] = None
        if llama_state["dir"] is None:
            return None
        try:
            return ensure_gguf(llama_state["dir"], model, PRECISIONS[precision]["gguf"])
        except (subprocess.CalledProcessError, OSError) as exc:
            log(f"GGUF conversion failed: {exc}")
            return None

    original_ra = int(readahead_file(disk).read_text()) if readahead_file(disk).is_file() else 0
    if MERGE and (RESULTS / "stream_bench.json").is_file():   # the runs this partial re-run does not repeat
        (RESULTS / "stream_bench.json.prev").write_text((RESULTS / "stream_bench.json").read_text())
    results: dict = {"machine": machine(), "disk": disk, **bandwidth, "prompt_tokens": PROMPT_TOKENS,
                     "decode_tokens": DECODE_TOKENS, "models": {}, "runs": []}
    for precision in SELECTED_PRECISIONS:
        for model, locality in [(m, loc) for m, loc in ((base, False), (skew, True)) if m.name in MODELS]:
            container = ensure_container(model, precision)
            size = container_bytes(container)
            cap_bytes = size // 3
            results["models"][f"{model.name}/{precision}"] = {"bytes": size, "cap_bytes": cap_bytes}
            for scenario in SCENARIOS:
                if scenario == "concurrency":
                    if model.name in LLAMA_MODELS:   # the plain model: llama.cpp's peer figures are on it
                        run_concurrency(results, model, precision, container, llama_gguf, cap_bytes, locality)
                    continue
                group = None
                sidecar = container / ".colibri-hotset"
                learned = None   # what every measured run starts from: no sidecar, or the learning run's
                sidecar.unlink(missing_ok=True)
                try:
                    if scenario == "capped":
                        group = CappedGroup(cap_bytes)
                        # One unmeasured run on another stretch of the same kind of text, under the same budget:
                        # on olmoe-skew the learned hot set comes from it (earlier traffic), and on every model it
                        # brings the virtual disk's host cache to the state the later runs see, so the first
                        # measured policy does not pay for it alone.
                        log(f"{model.name}/{precision}: a first, unmeasured run (learning the hot set)")
                        run_colibri(container, cap_bytes, group, locality, seed=77)
                        if model.name == "olmoe-skew":
                            learned = sidecar.read_bytes()
                    # Each engine's warm run follows its own cold one: under the cap, the group's page cache is
                    # charged to it, so a run after the other engine's would inherit that engine's pages.
                    for engine, variant, ra in plan_runs(scenario, model.name, original_ra):
                        for temp in ("cold", "warm"):
                            gguf = llama_gguf(model, precision) if engine == "llama.cpp" else None
                            if engine == "llama.cpp" and not gguf:
                                continue
                            set_readahead(disk, ra)
                            files = [*container.glob("*.safetensors")] if engine == "colibri" else [gguf]
                            if temp == "cold":
                                drop_caches()
                            elif scenario == "in_ram":
                                subprocess.run(["cat", *map(str, files)], stdout=subprocess.DEVNULL, check=False)
                            log(f"{model.name}/{precision} {scenario} {temp} {engine} {variant} readahead {ra} KiB")
                            if learned is None:
                                sidecar.unlink(missing_ok=True)
                            else:   # a run's own counts, saved at its exit, must not teach the next run
                                sidecar.write_bytes(learned)
                            try:
                                if engine == "colibri":
                                    ram = cap_bytes if scenario == "capped" else None
                                    stats = run_colibri(container, ram, group, locality, variant,
                                                        warm_request=scenario == "in_ram" and temp == "warm")
                                else:
                                    stats = run_llama(gguf, group, locality)
                            except Exception as exc:   # one failed run must not lose the others
                                stats = {"error": f"{type(exc).__name__}: {exc}"}
                            log(json.dumps(stats)[:300])
                            results["runs"].append({"model": model.name, "precision": precision,
                                                    "scenario": scenario, "temp": temp, "engine": engine,
                                                    "variant": variant, "readahead_kb": ra, **stats})
                            (RESULTS / "stream_bench.json").write_text(json.dumps(results, indent=1))
                except (RuntimeError, OSError) as exc:
                    results["runs"].append({"model": model.name, "precision": precision, "scenario": scenario,
                                            "error": str(exc)})
                finally:
                    if group:
                        group.close()
    set_readahead(disk, original_ra)
    if MERGE and (RESULTS / "stream_bench.json.prev").is_file():
        earlier = json.loads((RESULTS / "stream_bench.json.prev").read_text())
        made = {(r["model"], r.get("precision"), r["scenario"]) for r in results["runs"]}
        results["runs"] = [r for r in earlier["runs"] if (r["model"], r.get("precision"), r["scenario"]) not in made] \
            + results["runs"]
        results["models"] = {**earlier.get("models", {}), **results["models"]}
    report(results)
    return 0


def median_run(runs: list[dict], **where) -> dict | None:
    """The run with the median decode speed among the matching ones (the lower middle one of an even count)."""
    ok = sorted((r for r in runs if all(r.get(k) == v for k, v in where.items()) and "decode_tps" in r),
                key=lambda r: r["decode_tps"])
    return ok[(len(ok) - 1) // 2] if ok else None


def median_by(runs: list[dict], key: str, **where) -> dict | None:
    """The run with the median ``key`` among the matching ones that have it (the lower middle one of an even count)."""
    ok = sorted((r for r in runs if all(r.get(k) == v for k, v in where.items()) and r.get(key) is not None),
                key=lambda r: r[key])
    return ok[(len(ok) - 1) // 2] if ok else None


def concurrency_lines(results: dict) -> list[str]:
    """The concurrency table: per stream count, each engine's median aggregate decode tok/s and its multiple of one
    stream, with the median run's load average and other processes' CPU share."""
    runs = [r for r in results["runs"] if r.get("scenario") == "concurrency"]
    if not runs:
        return []
    lines = ["", "Concurrency under the cap (1/3 of the container; one engine of "
             f"{max(STREAMS)} slots for every stream count): streams started together, each a different "
             f"{PROMPT_TOKENS}-token prompt and {DECODE_TOKENS} teacher-forced decode steps; aggregate decode "
             "tok/s = tokens after the last stream's first one over the wall time from then to the last token "
             "(colibri), or every sequence's decode steps over the batched decode loop's "
             f"time (llama.cpp's parallel sequences). Medians of {ROUNDS}; load average and other processes' CPU "
             "share of the median run.", "",
             "| bits | streams | colibri aggregate tok/s | x one stream | hit rate | read/token | load avg "
             "| others' CPU | llama.cpp aggregate tok/s | x one stream | colibri / llama.cpp |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for precision in SELECTED_PRECISIONS:
        one_c = median_by(runs, "aggregate_tps", engine="colibri", precision=precision, streams=1)
        one_l = median_by(runs, "aggregate_tps", engine="llama.cpp", precision=precision, streams=1)
        for n in STREAMS:
            c = median_by(runs, "aggregate_tps", engine="colibri", precision=precision, streams=n) or {}
            ll = median_by(runs, "aggregate_tps", engine="llama.cpp", precision=precision, streams=n) or {}
            if not c and not ll:
                continue
            d = c.get("decode", {})
            ct, lt = c.get("aggregate_tps"), ll.get("aggregate_tps")
            read = f"{d['bytes_read'] / max(1, d['steps']) / 1e6:.0f} MB" if d.get("steps") else "–"
            lines.append(
                f"| {precision} | {n} | {fmt(ct)} | {fmt(ct / one_c['aggregate_tps'] if ct and one_c else None)} | "
                f"{100 * float(d.get('hit_rate', 0)):.0f}% | {read} | {fmt(c.get('load_average'), '.1f')} | "
                f"{fmt(100 * c['other_cpu_share'] if 'other_cpu_share' in c else None, '.0f')} % | {fmt(lt)} | "
                f"{fmt(lt / one_l['aggregate_tps'] if lt and one_l else None)} | "
                f"{fmt(ct / lt if ct and lt else None)} |")
    return lines


def best(runs: list[dict], **where) -> dict | None:
    ok = [r for r in runs if all(r.get(k) == v for k, v in where.items()) and "decode_tps" in r]
    return max(ok, key=lambda r: r["decode_tps"]) if ok else None


def decode_of(run: dict) -> dict:
    """The decode phase's counters (the engine's done.decode), falling back to the whole request's."""
    return run.get("decode") or run


def bound_of(run: dict, bw: float) -> float | None:
    """tok/s the disk allows at this run's decode hit rate: bandwidth / ((1 - hit rate) x routed bytes/token)."""
    miss_bytes = (1 - float(decode_of(run).get("hit_rate", 0))) * run["routed_bytes_per_token"]
    return bw / miss_bytes if miss_bytes > 0 else None


def report(results: dict) -> None:
    rows, chart = [], []
    bw = results["disk_bandwidth"]
    for precision in SELECTED_PRECISIONS:
        for model in ("olmoe-synth", "olmoe-skew"):
            for scenario in ("in_ram", "capped"):
                for temp in ("cold", "warm"):
                    key = dict(model=model, precision=precision, scenario=scenario, temp=temp)
                    c = median_run(results["runs"], engine="colibri", variant="auto", **key)
                    if not c:
                        continue
                    lru = median_run(results["runs"], engine="colibri", variant="lru", **key)
                    ll = best(results["runs"], engine="llama.cpp", **key)
                    bound = bound_of(c, bw)
                    policies = {p: median_run(results["runs"], engine="colibri", variant=p, **key) for p in POLICIES}
                    rows.append({**key, "colibri": c, "lru": lru, "llama": ll, "policies": policies,
                                 "ratio": c["decode_tps"] / ll["decode_tps"] if ll else None,
                                 "prefill_ratio": c["prefill_tps"] / ll["prefill_tps"] if ll else None,
                                 "bound_tps": bound, "share_of_bound": c["decode_tps"] / bound if bound else None})
                    chart.append((f"{model}\n{precision} {scenario}\n{temp}", c["decode_tps"],
                                  ll["decode_tps"] if ll else 0))
    results["summary"] = rows
    (RESULTS / "stream_bench.json").write_text(json.dumps(results, indent=1, default=str))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(max(8, 1.3 * len(chart)), 4.5))
        xs = np.arange(len(chart))
        ax.bar(xs - 0.2, [c[1] for c in chart], 0.4, label="colibri (container)")
        ax.bar(xs + 0.2, [c[2] for c in chart], 0.4, label="llama.cpp (GGUF, best readahead)")
        ax.set_xticks(xs, [c[0] for c in chart], fontsize=7)
        ax.set_ylabel("decode tok/s (teacher-forced)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(RESULTS / "stream_bench.png", dpi=120)
        fig.savefig(ROOT / "docs" / "stream-bench.png", dpi=120)   # the chart docs/benchmarks.md shows
    except ImportError:
        log("matplotlib missing: no chart")
    write_markdown(results, rows)


def fmt(v, spec=".2f") -> str:
    return "–" if v is None else format(v, spec)


def per_token_mb(run: dict | None) -> str:
    if not run:
        return "–"
    d = decode_of(run)
    return f"{d.get('bytes_read', 0) / max(1, d.get('steps', DECODE_TOKENS)) / 1e6:.0f} MB"


def write_markdown(results: dict, rows: list[dict]) -> None:
    m = results["machine"]
    sizes = ", ".join(f"{k} {v['bytes'] / 1e9:.2f} GB (cap {v['cap_bytes'] / 2**30:.2f} GiB)"
                      for k, v in results["models"].items())
    lines = ["# Benchmarks", "",
             "Generated by `nox -s bench` (`engines/bench/stream_bench.py`); raw figures in "
             "`bench-results/stream_bench.json`. Synthetic random-weight checkpoints at the real OLMoE-1B-7B "
             "geometry (16 layers, hidden 2048, 64 experts top-8, expert width 1024, vocab 50304); `olmoe-skew` "
             "has Zipf-like expert popularity and its decode workload revisits recent tokens. Same bit width on "
             "both sides: colibri's int8 container (experts and dense int8 per row, f16 scales) against llama.cpp's "
             "Q8_0 GGUF made by the sdist's own `convert_hf_to_gguf.py`" +
             (", and int4-g64 against Q4_0" if "int4" in SELECTED_PRECISIONS else "") +
             f". Sizes: {sizes}. Workload: a {PROMPT_TOKENS}-token prompt, then {DECODE_TOKENS} teacher-forced "
             "decode steps (greedy decoding of a random model loops and flatters any cache).", "",
             f"Machine: {m['cpu']}, {m['cores']} cores ({m['isa']}), {m['ram_bytes'] / 2**30:.0f} GiB RAM, kernel "
             f"{m['kernel']}, load average {', '.join(f'{x:.1f}' for x in m['load_average'])} at the start. Disk "
             f"`{results['disk']}`: {results['disk_bandwidth'] / 1e9:.2f} GB/s sequential O_DIRECT (best of queue "
             "depth 1, "
             f"{results.get('disk_bandwidth_qd1', results['disk_bandwidth']) / 1e9:.2f} GB/s, and 4 concurrent "
             f"readers, {results.get('disk_bandwidth_4_readers', results['disk_bandwidth']) / 1e9:.2f} GB/s, read "
             f"from `{results.get('disk_measured_on', 'the model')}`'s shards; the virtual disk may be cached by its "
             "host). Capped: a cgroup "
             "v1 memory limit of 1/3 of the container's size (page cache included); colibri plans for all of it "
             "(its reserve is what the engine measurably allocates beyond tensors, KV and cache). "
             "Cold: page cache dropped before the run; warm: run again (in RAM, after reading the files once and one "
             "unrelated request). Engines alternate inside each scenario.", "",
             "Decode columns are the decode phase alone (the engine's `done.decode`); the disk bound is bandwidth / "
             "((1 - decode hit rate) x routed bytes per token). Under the cap each colibri figure is the run with "
             f"the median decode speed of {ROUNDS} (policies interleaved round by round); llama.cpp's is its best "
             "readahead.", "",
             "| model | bits | scenario | colibri prefill tok/s | colibri decode tok/s | llama.cpp prefill | "
             "llama.cpp decode | decode ratio | prefill ratio | hit rate | read/token | peak RSS | disk bound tok/s "
             "| share of bound |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        c, ll = r["colibri"], r["llama"] or {}
        lines.append(f"| {r['model']} | {r['precision']} | {r['scenario']} {r['temp']} | "
                     f"{fmt(c.get('prefill_tps'), '.1f')} | {fmt(c.get('decode_tps'))} | "
                     f"{fmt(ll.get('prefill_tps'), '.1f')} | {fmt(ll.get('decode_tps'))} | {fmt(r['ratio'])} | "
                     f"{fmt(r['prefill_ratio'])} | {100 * float(decode_of(c).get('hit_rate', 0)):.0f}% | "
                     f"{per_token_mb(c)} | {c.get('peak_rss_bytes', 0) / 2**30:.2f} GiB | "
                     f"{fmt(r['bound_tps'])} | {fmt(r['share_of_bound'])} |")
    order = ["lru", "hotset", "prefetch", "auto", "lookahead"]
    lines += ["", "Caching policy under the cap, each cell decode hit rate / decode tok/s: plain LRU, the learned hot "
              "set alone (`--no-prefetch`), prefetching alone (`--no-pin`), both (what `coli run` does when the "
              "model does not fit) and both plus router lookahead (`--lookahead`):", "",
              "| model | bits | run | " + " | ".join(POLICY_LABELS[p] for p in order) +
              " | lookahead recall | staged reads used/issued with lookahead |",
              "|---|---|---|" + "---|" * (len(order) + 2)]
    for r in rows:
        if r["scenario"] != "capped" or not r["lru"]:
            continue
        cells = []
        for p in order:
            run = r["policies"].get(p)
            cells.append(f"{100 * float(decode_of(run).get('hit_rate', 0)):.0f}% / {fmt(run.get('decode_tps'))}"
                         if run else "–")
        la = decode_of(r["policies"].get("lookahead") or {})
        lines.append(f"| {r['model']} | {r['precision']} | {r['temp']} | " + " | ".join(cells) +
                     f" | {fmt(la.get('lookahead_recall'))} | "
                     f"{la.get('prefetch_used', '–')}/{la.get('prefetch_issued', '–')} |")
    lines += ["", "Where colibri's decode time went (milliseconds per decode token, from `done.decode`):", "",
              "| model | bits | scenario | I/O wait | expert matmul | attention | other |",
              "|---|---|---|---|---|---|---|"]
    for r in rows:
        d = decode_of(r["colibri"])
        steps = max(1, d.get("steps", DECODE_TOKENS))

        def ms(key: str, d=d, steps=steps) -> str:
            return fmt(1000 * d[key] / steps, ".1f") if d.get(key) is not None else "–"
        lines.append(f"| {r['model']} | {r['precision']} | {r['scenario']} {r['temp']} | {ms('io_wait_s')} | "
                     f"{ms('expert_s')} | {ms('attention_s')} | {ms('other_s')} |")
    lines += concurrency_lines(results)
    lines += ["", "Targets: capped decode >= 2x llama.cpp and prefill >= 1x; in-RAM decode >= 0.8x; capped decode >= "
              "70% of the disk bound; on olmoe-skew, the default (duel + prefetch) beats plain LRU; aggregate decode "
              "at 4 streams >= 2x one stream under the cap.", "",
              "![decode tok/s, colibri vs llama.cpp](stream-bench.png)", ""]
    write_section(ROOT / "docs" / "benchmarks.md", "stream-bench", "\n".join(lines[2:]))


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
    """``--report``: re-measure the disk and rewrite the report from the saved runs (no engine is run)."""
    results = json.loads((RESULTS / "stream_bench.json").read_text())
    results.update(measure_disk(CACHE / f"olmoe-synth-{SELECTED_PRECISIONS[0]}"))
    report(results)
    return 0


if __name__ == "__main__":
    sys.exit(report_again() if sys.argv[1:] == ["--report"] else main())
