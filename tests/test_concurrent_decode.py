"""Concurrent decoding: the sequences that decode in the same engine round run as one batched forward pass
(``cb_family.forward_batch``), so an expert several of them chose is read once per layer. Held to the same prompts
run one at a time and to transformers' greedy tokens, at one expert slot per layer (every routed expert evicted)
and with every expert cached, for a softmax-routed family (olmoe), MLA with grouped routing (deepseek_v3) and a
hybrid whose DeltaNet state lives in each slot (qwen3_next).

The schedule is deterministic where it is asserted: requests sent in one write (``Engine.together``) start in the
same round, and a prompt of k prefill chunks starts decoding k rounds in, while the others already decode.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from colibri import launch  # noqa: E402
from colibri.engine import Engine  # noqa: E402
from colibri.model import read_config, resolve_model  # noqa: E402
from colibri.testing.parity import MIN_MARGIN, reference_run, seeded_prompt  # noqa: E402
from colibri.testing.tiny import tiny_model  # noqa: E402

# kind -> (weight seed, overrides)
FAMILIES = {"olmoe": (3, {"num_layers": 2}), "deepseek_v3": (0, {}), "qwen3_next": (4, {"num_layers": 8})}
CHUNK = 8               # prefill tokens per pass: the prompts below take 1 to 4 passes
CTX = 96
SLOTS = 4
# (prompt length, max_tokens, stop at the token generated at this index or None): some end early, by length or
# by a stop token, while others go on
STREAMS = [(5, 24, None), (29, 10, None), (12, 16, 5), (19, 12, None)]


def start(path: Path, cap: int) -> Engine:
    spec = launch.prepare(resolve_model(str(path)), ctx=CTX, slots=SLOTS, cap=cap, threads=2)
    return Engine((*spec.argv, "--prefill-chunk", str(CHUNK)), env=spec.env)


def reference_streams(model, vocab: int) -> list[tuple[list[int], int, list[int], list[int]]]:
    """Per stream: a prompt whose greedy continuation has no near-tie, max_tokens, stop ids, expected tokens."""
    out = []
    for i, (length, n, stop_at) in enumerate(STREAMS):
        for seed in range(100 * i, 100 * i + 12):
            prompt = seeded_prompt(seed, vocab, length)
            _, tokens, margin = reference_run(model, prompt, n)
            if margin >= MIN_MARGIN:
                break
        else:
            pytest.fail(f"no prompt of length {length} has a top-1/top-2 margin >= {MIN_MARGIN}")
        stop = [] if stop_at is None else [tokens[stop_at]]
        if stop:
            tokens = tokens[:tokens.index(stop[0]) + 1]
        out.append((prompt, n, stop, tokens))
    return out


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    seed, overrides = FAMILIES[request.param]
    built = tiny_model(request.param, tmp_path_factory.mktemp("concurrent"), seed=seed, **overrides)
    reference = transformers.AutoModelForCausalLM.from_pretrained(built.path, dtype=torch.float32).eval()
    return built.path, reference_streams(reference, read_config(built.path)["vocab_size"])


def submit(engine: Engine, slot: int, stream) -> object:
    prompt, n, stop, _ = stream
    engine.reset(slot)
    return engine.submit(prompt, slot=slot, max_tokens=n, stop=stop)


@pytest.mark.parametrize("cap", [1, 0])
def test_concurrent_streams_give_the_sequential_and_transformers_tokens(family, cap):
    path, streams = family
    expected = [s[3] for s in streams]
    with start(path, cap) as engine:
        assert "batched_decode" in engine.ready["abilities"]
        every = [submit(engine, 0, stream).wait() for stream in streams]
        alone = [r.tokens for r in every]
        assert alone == expected, f"cap {cap}: sequential tokens differ from transformers"

        # Two: stream 1's four prefill passes run while stream 0 decodes alone, then every one of stream 1's
        # decode steps is batched with stream 0 (which outlasts it).
        for slot in range(SLOTS):
            engine.reset(slot)
        with engine.together():
            pair = [engine.submit(s[0], slot=i, max_tokens=s[1], stop=s[2]) for i, s in enumerate(streams[:2])]
        results = [r.wait() for r in pair]
        every += results
        assert [r.tokens for r in results] == expected[:2], f"cap {cap}: two concurrent streams changed tokens"
        steps = results[1].stats["decode"]["steps"]
        assert steps == len(expected[1]) - 1
        assert results[1].stats["batched_steps"] == steps == results[0].stats["batched_steps"]

        # Four: three start together, the fourth is submitted once the first has tokens out (joining mid-way);
        # stream 2 ends early on its stop token, stream 1 on its length.
        for slot in range(SLOTS):
            engine.reset(slot)
        with engine.together():
            reqs = [engine.submit(s[0], slot=i, max_tokens=s[1], stop=s[2]) for i, s in enumerate(streams[:3])]
        for ev in reqs[0].events(timeout=60):
            if ev.get("ev") == "token" and len(reqs[0].tokens) >= 2:
                break
        reqs.append(submit(engine, 3, streams[3]))
        results = [r.wait(timeout=120) for r in reqs]
        every += results
        assert [r.tokens for r in results] == expected, f"cap {cap}: four concurrent streams changed tokens"
        assert results[2].stats["reason"] == "stop" and results[1].stats["reason"] == "length"
        # streams 1 and 2 decode only while stream 0 does: every one of their steps is batched
        assert all(r.stats["batched_steps"] == r.stats["decode"]["steps"] for r in results[1:3])
        assert results[0].stats["batched_steps"] >= results[1].stats["decode"]["steps"] > 0
        stats = engine.stats()
        preloaded = engine.ready["preloaded_bytes"]   # read at start (a full cache), by no request
    # the requests' shares of the batched steps' expert traffic add up to the engine's
    for mine, total, before in (("expert_hits", "hits", 0), ("expert_misses", "misses", 0),
                                ("bytes_read", "bytes_read", preloaded)):
        assert sum(r.stats[mine] for r in every) + before == sum(stats[total])


def chosen_experts(model, ids: list[int], top_k: int) -> list[list[set[int]]]:
    """transformers' routing: per layer, per position, the set of experts the router picks."""
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_router_logits=True)
    return [[set(row.topk(top_k).indices.tolist()) for row in layer.reshape(len(ids), -1)]
            for layer in out.router_logits]


@pytest.mark.parametrize("cap", [0, 1])
def test_a_batched_step_reads_each_chosen_expert_once(tmp_path_factory, cap):
    """Two OLMoE streams decoding together: each layer's expert accesses are, per prefill pass, the union over its
    rows and, per batched decode step, the union of both rows' choices; every miss is one read of one expert."""
    seed, overrides = FAMILIES["olmoe"]
    built = tiny_model("olmoe", tmp_path_factory.mktemp("union"), seed=seed, **overrides)
    cfg = read_config(built.path)
    top_k = cfg["num_experts_per_tok"]
    model = transformers.AutoModelForCausalLM.from_pretrained(built.path, dtype=torch.float32).eval()
    n = 10
    prompts = [seeded_prompt(7, cfg["vocab_size"], 6), seeded_prompt(8, cfg["vocab_size"], 6)]
    with start(built.path, cap) as engine:
        with engine.together():
            reqs = [engine.submit(p, slot=i, max_tokens=n) for i, p in enumerate(prompts)]
        tokens = [r.wait().tokens for r in reqs]
        stats = engine.stats()
    assert [r.stats["batched_steps"] for r in reqs] == [n - 1, n - 1]
    # The rows the engine computed: each prompt (one pass each), then generated tokens 0 .. n-2 fed one per step.
    routes = [chosen_experts(model, p + t[:-1], top_k) for p, t in zip(prompts, tokens)]
    for layer, (hits, misses, reads) in enumerate(zip(stats["hits"], stats["misses"], stats["reads"])):
        a, b = routes[0][layer], routes[1][layer]
        prefill = len(set().union(*a[:6])) + len(set().union(*b[:6]))
        together = sum(len(a[p] | b[p]) for p in range(6, 6 + n - 1))
        apart = sum(len(a[p]) + len(b[p]) for p in range(6, 6 + n - 1))
        assert together < apart, "the two streams never chose a common expert: the test shows nothing"
        assert hits + misses == prefill + together, f"layer {layer}: an expert was fetched more than once per step"
        if cap:   # (a full cache is preloaded at start: its reads are no misses)
            assert reads == misses, f"layer {layer}: a miss took more than one read"
    assert sum(r.stats["expert_hits"] + r.stats["expert_misses"] for r in reqs) == sum(stats["hits"]) + sum(
        stats["misses"])
