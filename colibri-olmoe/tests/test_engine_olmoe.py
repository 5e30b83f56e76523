"""The OLMoE engine against transformers: token-exact greedy generation, prompt logits, expert cache behaviour.

Every model here is a tiny random OLMoE built by ``colibri.testing.tiny`` (weights re-drawn at O(1) scale so the
router makes real choices). The engine binary is built once by core's builder and driven through
``colibri.engine.Engine``, exactly as ``coli`` drives it.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from colibri.builder import build_family  # noqa: E402
from colibri.engine import Engine, EngineRequestError  # noqa: E402
from colibri.model import read_config  # noqa: E402
from colibri.records import ResolvedModel  # noqa: E402
from colibri.testing.tiny import tiny_model  # noqa: E402
from colibri_olmoe.plugin import engine_hparams  # noqa: E402
from colibri.testing.parity import GREEDY_TOKENS, LOGIT_TOL, pick_prompt  # noqa: E402


# name -> tiny_model overrides. Together: MHA and GQA, norm_topk_prob on and off, tied and untied, clip_qkv,
# >= 16 experts top-4.
GEOMETRIES = {
    "mha_untied": {"num_kv_heads": 4, "norm_topk_prob": False, "tie_word_embeddings": False, "num_layers": 2},
    "gqa_tied_norm": {"num_kv_heads": 2, "norm_topk_prob": True, "tie_word_embeddings": True, "num_layers": 3},
    "gqa1_clip_32experts": {"num_kv_heads": 1, "norm_topk_prob": False, "num_experts": 32, "top_k": 4,
                            "clip_qkv": 2.0, "num_layers": 2},
}


@pytest.fixture(scope="session")
def engine_binary() -> Path:
    return build_family("olmoe")


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("olmoe-models")


def resolved(path: Path) -> ResolvedModel:
    return ResolvedModel(path, "olmoe", "olmoe", read_config(path))


def start(binary: Path, model_dir: Path, *, ctx: int = 256, slots: int = 1, cap: int = 0,
          prefetch: bool = False, pin: str = "off") -> Engine:
    # each run its own hot-set sidecar: one saved by an earlier run would seed this one's pins (and its counters)
    hotset = model_dir.with_name(f"{model_dir.name}.hotset-{cap}-{pin}-{int(prefetch)}")
    argv = [str(binary), "--model", str(model_dir), "--ctx", str(ctx), "--slots", str(slots), "--cap", str(cap),
            "--threads", "2", "--pin", pin, "--hotset", str(hotset), *engine_hparams(resolved(model_dir))]
    return Engine(argv, env={"COLIBRI_PREFETCH": "1" if prefetch else "0"})


def load_reference(path: Path):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    return model


def expert_bytes(model_dir: Path, layer: int = 0) -> int:
    from safetensors import safe_open

    with safe_open(model_dir / "model.safetensors", "pt") as f:
        return sum(f.get_slice(f"model.layers.{layer}.mlp.experts.0.{m}_proj.weight").get_shape()[0]
                   * f.get_slice(f"model.layers.{layer}.mlp.experts.0.{m}_proj.weight").get_shape()[1]
                   for m in ("gate", "up", "down")) * (4 if "float32" in json.loads(
                       (model_dir / "config.json").read_text()).get("dtype", "float32") else 2)


@pytest.mark.parametrize("geometry", sorted(GEOMETRIES))
def test_matches_transformers_at_every_cache_size(engine_binary, tiny_root, geometry):
    built = tiny_model("olmoe", tiny_root, seed=3, **GEOMETRIES[geometry])
    cfg = read_config(built.path)
    n_layers, n_experts, top_k = cfg["num_hidden_layers"], cfg["num_experts"], cfg["num_experts_per_tok"]
    reference = load_reference(built.path)
    # 40 tokens: more than one prefill chunk (32), so chunking and keepalive are on the path too.
    prompt, ref_logits, ref_tokens = pick_prompt(reference, cfg["vocab_size"], 40)
    one_expert = expert_bytes(built.path)
    accesses = None
    misses_by_cap = {}
    # Partial caches run set dueling (what launch gives them by default), and LRU once; prefetching (opt-in) adds
    # the I/O pool's staging buffers and must change no token and no counter.
    for cap, prefetch, pin in ((1, False, "duel"), (2, False, "duel"), (4, False, "duel"), (2, False, "off"),
                               (0, False, "off"), (2, True, "duel")):
        with start(engine_binary, built.path, cap=cap, prefetch=prefetch, pin=pin) as engine:
            cached = n_experts if cap == 0 else cap
            staging = engine.ready["staging_bytes"] if prefetch else 0
            assert (staging >= one_expert) == prefetch
            assert engine.ready["expert_cache_bytes"] == n_layers * cached * one_expert + staging
            result = engine.generate(prompt, max_tokens=GREEDY_TOKENS, logits=True)
            stats = engine.stats()
        assert result.tokens == ref_tokens, f"cap {cap} pin {pin}: greedy tokens differ from transformers"
        assert len(result.logits) == len(prompt)
        got = torch.tensor(result.logits)
        diff = (got - ref_logits).abs().max().item()
        assert diff < LOGIT_TOL, f"cap {cap} pin {pin}: prompt logits differ by {diff}"
        assert result.stats["reason"] == "length"
        assert result.stats["generated_tokens"] == GREEDY_TOKENS
        assert result.stats["prefilled_tokens"] == len(prompt)
        # Counters: every forward pass touches each chosen expert once per layer, whatever the cache size.
        hits, misses = stats["hits"], stats["misses"]
        assert len(hits) == len(misses) == n_layers
        total = [h + m for h, m in zip(hits, misses)]
        if accesses is None:
            accesses = total
        assert total == accesses, "expert accesses must not depend on the cache size"
        # 2 prefill chunks + 31 decode steps, each needing >= top_k distinct experts per layer (>= 1 access each)
        assert all(t >= 2 * top_k + (GREEDY_TOKENS - 1) * top_k for t in total)
        assert all(m > 0 for m in misses)
        # gate/up/down of one expert are adjacent in a transformers save: one read per miss.
        assert stats["reads"] == misses
        assert stats["bytes_read"] == [m * one_expert for m in misses]
        assert result.stats["expert_misses"] == sum(misses) and result.stats["expert_hits"] == sum(hits)
        # Per expert (a dashboard's heatmap): the uses add up to the layer's accesses; a partial cache holds exactly
        # its slots' worth of experts (all filled by now; pinned ones only with the hot set), a full one every
        # expert used.
        assert stats["experts"] == [n_experts] * n_layers and stats["cache_slots"] == [cached] * n_layers
        assert [sum(u) for u in stats["uses"]] == total
        assert stats["policy"] == ("duel" if pin == "duel" else "lru")
        for uses, resident in zip(stats["uses"], stats["resident"]):
            assert set(resident) <= ({0, 1, 2} if pin == "duel" else {0, 1})
            if cap == 0:
                assert resident == [int(u > 0) for u in uses]
            else:
                assert sum(r > 0 for r in resident) == cached and all(u > 0 for u, r in zip(uses, resident) if r)
        if pin == "duel":   # each shadow saw every lookup the real cache did
            for shadow in (stats["shadow_lru_hits"], stats["shadow_hot_hits"]):
                assert len(shadow) == n_layers and all(h <= t for h, t in zip(shadow, total))
        if cap == 0:
            assert all(m <= n_experts for m in misses), "with every expert cached, each is read at most once"
        if prefetch:
            assert sum(misses) == misses_by_cap[cap, pin]
        misses_by_cap[cap, pin] = sum(misses)
    assert misses_by_cap[1, "duel"] >= misses_by_cap[2, "off"] >= misses_by_cap[0, "off"]
    assert misses_by_cap[1, "duel"] >= misses_by_cap[2, "duel"] >= misses_by_cap[0, "off"]
    assert misses_by_cap[1, "duel"] > misses_by_cap[0, "off"]


def test_batched_prefill_is_bit_identical_to_one_token_at_a_time(engine_binary, tiny_root):
    built = tiny_model("olmoe", tiny_root, seed=3, **GEOMETRIES["gqa_tied_norm"])
    rng = random.Random(7)
    prompt = [rng.randrange(2, 512) for _ in range(37)]
    with start(engine_binary, built.path, cap=2) as engine:
        batched = engine.generate(prompt, max_tokens=1, logits=True).logits
        engine.reset(0)
        # Growing the prompt one token at a time on the same slot reuses the prefix, so every call computes
        # exactly one new position (n = 1) and reports its logits.
        single = []
        for i in range(1, len(prompt) + 1):
            r = engine.generate(prompt[:i], max_tokens=1, logits=True)
            assert r.accept["reused_tokens"] == i - 1
            assert len(r.logits) == 1
            single.append(r.logits[0])
    assert single == batched  # floats printed with %.9g round-trip exactly: this is bit equality


def test_bf16_checkpoint_matches_transformers_on_the_same_weights(engine_binary, tiny_root):
    built = tiny_model("olmoe", tiny_root, seed=5, dtype="bfloat16", num_kv_heads=2, norm_topk_prob=True)
    # transformers runs in float32 on the bf16-rounded weights (the upcast is exact), and the engine computes in
    # f32 on the same bf16 values: both sides do the same arithmetic up to summation order, so the f32
    # tolerance applies unchanged; any bf16 handling error (wrong rounding, byte order) is orders larger.
    reference = load_reference(built.path)
    prompt, ref_logits, ref_tokens = pick_prompt(reference, 512, 12)
    with start(engine_binary, built.path, cap=2) as engine:
        result = engine.generate(prompt, max_tokens=GREEDY_TOKENS, logits=True)
    assert (torch.tensor(result.logits) - ref_logits).abs().max().item() < LOGIT_TOL
    assert result.tokens == ref_tokens


def test_slots_interleave_and_reuse_prefixes(engine_binary, tiny_root):
    built = tiny_model("olmoe", tiny_root, seed=3, **GEOMETRIES["mha_untied"])
    a, b = [5, 17, 99, 300, 41], [7, 250, 3, 88, 120, 64, 9]
    with start(engine_binary, built.path, slots=1) as engine:
        alone_a = engine.generate(a, max_tokens=12).tokens
        engine.reset(0)
        alone_b = engine.generate(b, max_tokens=12).tokens
    with start(engine_binary, built.path, slots=2, cap=1) as engine:
        ra = engine.submit(a, slot=0, max_tokens=12)
        rb = engine.submit(b, slot=1, max_tokens=12)
        assert rb.wait().tokens == alone_b
        assert ra.wait().tokens == alone_a
        # A follow-up turn on slot 0 prefills only what is new.
        follow = a + alone_a[:5] + [77, 78]
        r = engine.generate(follow, slot=0, max_tokens=4)
        assert r.accept["reused_tokens"] == len(a) + 5
        assert r.stats["prefilled_tokens"] == len(follow) - (len(a) + 5)
    with start(engine_binary, built.path) as engine:
        assert engine.generate(follow, max_tokens=4).tokens == r.tokens


def test_sampling_is_seeded_and_top_k_1_is_greedy(engine_binary, tiny_root):
    built = tiny_model("olmoe", tiny_root, seed=3, **GEOMETRIES["mha_untied"])
    prompt = [11, 22, 33, 44]
    with start(engine_binary, built.path) as engine:
        greedy = engine.generate(prompt, max_tokens=16).tokens
        engine.reset(0)
        runs = []
        for seed in (1, 1, 2, 3, 4):
            engine.reset(0)
            runs.append(engine.generate(prompt, max_tokens=16, temperature=1.5, top_p=0.95, seed=seed).tokens)
        engine.reset(0)
        top1 = engine.generate(prompt, max_tokens=16, temperature=1.0, top_k=1, seed=9).tokens
    assert runs[0] == runs[1], "the same seed must give the same tokens"
    assert len({tuple(r) for r in runs}) > 2, "different seeds should sample different continuations"
    assert top1 == greedy


def test_context_limits(engine_binary, tiny_root):
    built = tiny_model("olmoe", tiny_root, seed=3, **GEOMETRIES["mha_untied"])
    with start(engine_binary, built.path, ctx=16) as engine:
        with pytest.raises(EngineRequestError) as info:
            engine.generate(list(range(2, 19)), max_tokens=4)
        assert info.value.code == "context_exceeded"
        # Still serving; generation stops at the context with reason "length": 10 prompt + 6 fed = 16 positions,
        # and the 7th token comes from the last position's logits.
        r = engine.generate(list(range(2, 12)), max_tokens=100)
        assert r.stats["reason"] == "length" and len(r.tokens) == 7


def test_stop_tokens_and_cancel(engine_binary, tiny_root):
    built = tiny_model("olmoe", tiny_root, seed=3, **GEOMETRIES["mha_untied"])
    prompt = [9, 8, 7, 6]
    with start(engine_binary, built.path, ctx=2048) as engine:
        free = engine.generate(prompt, max_tokens=8).tokens
        engine.reset(0)
        stopped = engine.generate(prompt, max_tokens=8, stop=[free[2]])
        assert stopped.stats["reason"] == "stop"
        assert stopped.tokens == free[:free.index(free[2]) + 1]
        req = engine.submit(prompt, max_tokens=2000)
        reasons = []
        for ev in req:
            if ev["ev"] == "token" and len(req.tokens) == 3:
                req.cancel()
            if ev["ev"] == "done":
                reasons.append(ev["reason"])
        assert reasons == ["cancelled"] and 3 <= len(req.tokens) < 2000
        assert engine.generate(prompt, max_tokens=2).tokens == free[:2]


def raw_session(binary: Path, model_dir: Path, lines: list[str], *, ctx: int = 64) -> tuple[int, list[dict]]:
    argv = [str(binary), "--model", str(model_dir), "--ctx", str(ctx), "--threads", "1",
            *engine_hparams(resolved(model_dir))]
    proc = subprocess.run(argv, input="".join(line + "\n" for line in lines).encode(), capture_output=True,
                          timeout=120, check=False)
    return proc.returncode, [json.loads(line) for line in proc.stdout.decode().splitlines()]


def test_malformed_requests_get_bad_request(engine_binary, tiny_root):
    built = tiny_model("olmoe", tiny_root, seed=3, **GEOMETRIES["mha_untied"])
    lines = ['{"op": "submit", "id": 1, "prompt": [1, 2', 'not json', '[]', '{"op": 3}', '{"op": "fly"}',
             '{"op": "submit", "id": 2, "prompt": []}', '{"op": "submit", "id": 3, "prompt": [99999]}',
             '{"op": "submit", "id": 4, "prompt": [5], "temperature": "hot"}', '{"op": "cancel", "id": 77}',
             '{"op": "submit", "id": 5, "prompt": [5, 6], "max_tokens": 2}']
    rc, events = raw_session(engine_binary, built.path, lines)
    assert rc == 0
    errors = [e for e in events if e["ev"] == "error"]
    assert [e["code"] for e in errors] == ["bad_request"] * 9
    assert all(e["message"] for e in errors)
    assert [e["id"] for e in errors][5:] == [2, 3, 4, 77]
    done = [e for e in events if e["ev"] == "done"]
    assert len(done) == 1 and done[0]["id"] == 5 and done[0]["generated_tokens"] == 2


def test_corrupted_shard_is_fatal_with_the_file_named(engine_binary, tiny_root, tmp_path):
    built = tiny_model("olmoe", tiny_root, seed=3, **GEOMETRIES["mha_untied"])
    broken = tmp_path / "broken"
    shutil.copytree(built.path, broken)
    shard = broken / "model.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])     # truncated: tensors point past the end of the file
    rc, events = raw_session(engine_binary, broken, [])
    assert rc == 2 and len(events) == 1 and events[0]["ev"] == "fatal"
    assert str(shard) in events[0]["message"] and "truncated" in events[0]["message"]
    shard.write_bytes(data[:8] + b"{garbage" + data[16:])
    rc, events = raw_session(engine_binary, broken, [])
    assert rc == 2 and events[0]["ev"] == "fatal" and "corrupted safetensors header" in events[0]["message"]


def test_unknown_hyperparameter_is_refused(engine_binary, tiny_root):
    built = tiny_model("olmoe", tiny_root, seed=3, **GEOMETRIES["mha_untied"])
    argv = [str(engine_binary), "--model", str(built.path), *engine_hparams(resolved(built.path)),
            "--set", "num_expertz=4"]
    proc = subprocess.run(argv, input=b"", capture_output=True, timeout=60, check=False)
    event = json.loads(proc.stdout.decode().splitlines()[0])
    assert proc.returncode == 2 and event["ev"] == "fatal" and "num_expertz" in event["message"]


@pytest.mark.parametrize("rope", [
    {"rope_type": "linear", "rope_theta": 500.0, "factor": 4.0},
    {"rope_type": "llama3", "rope_theta": 500.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 16},
], ids=lambda r: r["rope_type"])
def test_rope_scaling_matches_transformers(engine_binary, tiny_root, rope):
    built = tiny_model("olmoe", tiny_root, seed=4, num_kv_heads=2, rope_parameters=rope)
    assert read_config(built.path)["rope_parameters"]["rope_type"] == rope["rope_type"]
    reference = load_reference(built.path)
    prompt, ref_logits, ref_tokens = pick_prompt(reference, 512, 24, n=16)
    with start(engine_binary, built.path) as engine:
        result = engine.generate(prompt, max_tokens=16, logits=True)
    assert (torch.tensor(result.logits) - ref_logits).abs().max().item() < LOGIT_TOL
    assert result.tokens == ref_tokens
