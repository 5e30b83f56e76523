"""Streaming for real: a >= 300 MB OLMoE-architecture checkpoint under a RAM budget that holds a quarter of its
experts, driven through the installed ``coli run`` exactly as a user would.

The checkpoint is written by ``coli demo --synthetic``'s torch-free writer (``colibri_olmoe.synthetic``;
N(0, 1/fan_in) weights, a real BPE tokenizer), once per session. The budget comes from the planner
(``demo.budget_for_cache_fraction``), not from a hard-coded number, and the engine's counters must tell a story
consistent with that cache: every expert access is a hit or a miss whatever the cache size, every miss is exactly
one contiguous read of one expert's bytes, the all-experts run reads each expert at most once, and the tokens do
not change.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

pytest.importorskip("colibri_olmoe")

from colibri import demo, plugins
from colibri.inventory import load_facts
from colibri.model import resolve_model
from colibri_olmoe import synthetic

GIB = 1024 ** 3
# ~345 MB of f32: 6 MoE layers x 32 experts x 1.5 MiB, plus attention, embeddings and head.
SPEC = synthetic.DemoSpec(hidden=512, layers=6, heads=8, experts=32, top_k=4, expert_width=256, vocab=4096,
                          layers_per_shard=2, tokenizer_corpus_bytes=400_000)
PROMPT = ("The expert cache keeps the most recently used experts of every layer in memory and reads the rest "
          "from disk when the router asks for them, so a model larger than RAM still runs.")
TOKENS = 24
CTX = 512


@pytest.fixture(scope="session")
def big_model(tmp_path_factory):
    out = tmp_path_factory.mktemp("streaming") / "olmoe-345mb"
    synthetic.write_checkpoint(SPEC, out)
    return out


@pytest.fixture(scope="module")   # the plugin filter it sets must not outlive this module's tests
def olmoe_facts(big_model):
    saved = {k: os.environ.get(k) for k in ("COLIBRI_LOAD_PLUGINS", "COLIBRI_DISABLE_PLUGINS")}
    os.environ["COLIBRI_LOAD_PLUGINS"] = "olmoe"
    os.environ.pop("COLIBRI_DISABLE_PLUGINS", None)
    plugins.reset()
    try:
        yield load_facts(resolve_model(big_model))
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        plugins.reset()


def coli_run(model_dir, *flags: str) -> dict:
    script = shutil.which("coli", path=os.path.dirname(sys.executable)) or shutil.which("coli")
    argv = [script] if script else [sys.executable, "-c", "from colibri.cli import main; main()"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "COLIBRI_LOAD_PLUGINS": "olmoe", "COLIBRI_PREFETCH": "0"}
    proc = subprocess.run([*argv, "run", PROMPT, "--model", str(model_dir), "--raw", "--json", "--temp", "0",
                           "--max-tokens", str(TOKENS), "--ctx", str(CTX), "--threads", "2", *flags],
                          capture_output=True, text=True, timeout=600, env=env, check=False)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_quarter_cache_streams_and_keeps_the_tokens(big_model, olmoe_facts):
    disk = sum(p.stat().st_size for p in big_model.glob("*.safetensors"))
    assert disk >= 300_000_000
    layers, experts = SPEC.layers, SPEC.experts
    budget = demo.budget_for_cache_fraction(olmoe_facts, ctx=CTX, fraction=0.25)
    assert budget < disk, "the budget must be smaller than the model, or nothing streams"

    # + 1 MiB so the GiB float round-trip cannot cost a slot; a ninth slot would need 6 x 1.5 MiB more.
    small = coli_run(big_model, "--ram", repr((budget + (1 << 20)) / GIB))
    full = coli_run(big_model, "--cap", "0")

    assert small["cap"] == experts // 4 and small["ram_bytes"] < disk
    assert full["cap"] == experts
    assert small["prompt_ids"] == full["prompt_ids"]
    assert len(small["generated_ids"]) >= 8
    assert small["generated_ids"] == full["generated_ids"], "placement changed the tokens"

    s, f = small["stats"], full["stats"]
    accesses = s["expert_hits"] + s["expert_misses"]
    # Decode feeds one token per pass in both runs, so its expert accesses are the router's choices alone. (The
    # prompt's are not: a run whose experts stream prefills in bigger passes, `launch.prefill_chunk`, and a pass
    # touches each chosen expert once for all of its rows.)
    ds, df = s["decode"], f["decode"]
    assert ds["expert_hits"] + ds["expert_misses"] == df["expert_hits"] + df["expert_misses"], \
        "the router's choices must not depend on the cache"
    # at least top-k experts per layer for every decoded token, plus the prefill
    assert accesses >= layers * SPEC.top_k * len(small["generated_ids"])
    for stats in (s, f):
        n = stats["expert_hits"] + stats["expert_misses"]
        assert stats["hit_rate"] == pytest.approx(stats["expert_hits"] / n, abs=1e-3)
        # gate/up/down of an expert are adjacent on disk: one pread of exactly one expert per miss
        assert stats["reads"] == stats["expert_misses"]
        assert stats["bytes_read"] == stats["expert_misses"] * SPEC.expert_bytes
    # With every expert cached, each is read at most once (compulsory misses only)...
    assert f["expert_misses"] <= layers * experts
    # ...and a quarter-size cache must re-read what it evicted: more misses, a lower hit rate, yet never more than
    # one miss per access.
    assert f["expert_misses"] < s["expert_misses"] <= accesses
    assert s["hit_rate"] < f["hit_rate"]
    # What it streamed is more than its whole cache could hold: the budget really forced eviction.
    assert s["bytes_read"] > layers * small["cap"] * SPEC.expert_bytes
    # The process stays inside the budget (weights are read with pread, not mapped) and far below the model.
    assert 0 < s["rss_bytes"] <= small["ram_bytes"]


def test_io_threads_change_the_readers_never_the_tokens(big_model, olmoe_facts):
    # coli tune's --io-threads (1 to 8 reads in flight) through the real engine's I/O pool and preload
    budget = demo.budget_for_cache_fraction(olmoe_facts, ctx=CTX, fraction=0.25)
    ram = repr((budget + (1 << 20)) / GIB)
    one, eight = (coli_run(big_model, "--ram", ram, "--io-threads", n, "--no-tune-profile") for n in ("1", "8"))
    assert one["cap"] == eight["cap"] == SPEC.experts // 4
    assert one["generated_ids"] == eight["generated_ids"], "the reader count changed the tokens"
    for stats in (one["stats"], eight["stats"]):
        assert stats["bytes_read"] == stats["reads"] * SPEC.expert_bytes
    preloaded = coli_run(big_model, "--cap", "0", "--io-threads", "8", "--no-tune-profile")
    assert preloaded["generated_ids"] == one["generated_ids"]
    assert preloaded["stats"]["expert_misses"] <= SPEC.layers * SPEC.experts
