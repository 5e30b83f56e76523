#!/usr/bin/env python3
"""Routing study of colibri-nano on held-out text: what an expert cache can expect from a trained router.

Measured on the held-out split of the training corpus (files ``train_nano.py`` never trained on):

* per-layer expert popularity (share of routed slots each expert takes; its spread against the uniform 1/E),
* token-to-token reuse (the share of token t's top-k experts that token t-1 also chose, per layer),
* expert-cache hit rate against cache size, simulated on the routing trace in decode order (every token looks up
  its k experts in its layer's cache): plain LRU, the engine's hot set (``--pin on``: evict the coldest expert by
  routing count decayed per access, pin the hottest in half the slots every 8 tokens; seeded with the counts of
  the first half of the trace), and set dueling between the two (``--pin duel``, the default: shadow caches of
  both, evict by whichever hit more recently); all scored on the second half,
* the engine's own counters at the same cache sizes (``--pin off``, ``on`` and ``duel``, no prefetch), generating
  greedily from a held-out prompt: prefill runs in chunks, so the engine's numbers include batched lookups.

Writes ``docs/routing-study.png`` and replaces its own section of ``docs/benchmarks.md`` (between the
``routing-study`` markers; the rest of that file belongs to others). Run with ``nox -s routing_study``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
from functools import partial
from pathlib import Path
from typing import Callable

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
BEGIN, END = "<!-- routing-study:begin -->", "<!-- routing-study:end -->"


def load_training_module():
    spec = importlib.util.spec_from_file_location("train_nano", HERE / "train_nano.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_nano"] = module              # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


def routing_trace(model_dir: Path, windows) -> np.ndarray:
    """[layers, tokens, k] expert ids chosen by transformers' router on the held-out windows, in text order."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    k = model.config.num_experts_per_tok
    per_window = []
    with torch.no_grad():
        for row in windows:
            out = model(row[None, :], output_router_logits=True)
            per_window.append(np.stack([logits.topk(k, dim=-1).indices.numpy() for logits in out.router_logits]))
    return np.concatenate(per_window, axis=1)


def popularity(trace: np.ndarray, experts: int) -> np.ndarray:
    """[layers, experts] share of routed slots."""
    counts = np.stack([np.bincount(layer.ravel(), minlength=experts) for layer in trace]).astype(float)
    return counts / counts.sum(axis=1, keepdims=True)


def reuse(trace: np.ndarray) -> np.ndarray:
    """Per layer: mean share of token t's experts that token t-1 also chose."""
    k = trace.shape[2]
    out = []
    for layer in trace:
        shared = [len(set(a) & set(b)) / k for a, b in zip(layer[1:], layer[:-1])]
        out.append(float(np.mean(shared)))
    return np.array(out)


HEAT_DECAY, PIN_MARGIN, REPIN_EVERY = 0.98, 1.25, 8      # expert_hotset.c's constants and --repin-every default
DUEL_DECAY, DUEL_MARGIN = 0.5 ** (1 / 64), 2.0           # expert_duel.c's
POLICIES = ("lru", "hot set", "duel")


class LayerRouting:
    """What the engine's hot set keeps per layer whatever the cache holds (expert_hotset.c): heat = routing count
    decayed by HEAT_DECAY per access, seeded from the ``learned`` shares, the experts pinned into half the slots
    every REPIN_EVERY tokens (with hysteresis), and each expert's last access."""

    def __init__(self, cap: int, learned: np.ndarray):
        self.heat = learned / (1 - HEAT_DECAY)
        self.last_use = np.zeros(len(learned))
        self.pinned: set[int] = set()
        self.budget = cap // 2
        self.tick = 0
        self.repin()

    def access(self, e: int) -> None:
        self.heat *= HEAT_DECAY
        self.heat[e] += 1
        self.tick += 1

    def repin(self) -> None:
        heat, pinned = self.heat, self.pinned
        while True:
            outside = [e for e in np.argsort(-heat) if e not in pinned and heat[e] > 0]
            if not outside:
                return
            best = int(outside[0])
            if len(pinned) < self.budget:
                pinned.add(best)
                continue
            weak = min(pinned, key=lambda e: heat[e]) if pinned else None
            if weak is None or heat[best] <= PIN_MARGIN * heat[weak]:
                return
            pinned.discard(weak)
            pinned.add(best)

    def victim(self, resident: set[int], by_heat: bool, spare: set[int] = frozenset()) -> int | None:
        """expert_store.c's cbx_victim: by_heat the coldest unpinned resident (least recent among equals), else the
        least recent; ``spare`` ones are not candidates."""
        candidates = [x for x in resident if x not in spare and not (by_heat and x in self.pinned)]
        if not candidates:
            return None
        if by_heat:
            return min(candidates, key=lambda x: (self.heat[x], self.last_use[x]))
        return min(candidates, key=lambda x: self.last_use[x])

    def evict(self, resident: set[int], by_heat: bool, spare: set[int] = frozenset()) -> int:
        """The victim, sparing ``spare`` when any other is a candidate."""
        v = self.victim(resident, by_heat, spare)
        return v if v is not None else self.victim(resident, by_heat)


def touch(cache: set[int], e: int, cap: int, victim: Callable[[], int]) -> bool:
    """One lookup of e in a cache of ``cap`` experts; a miss evicts ``victim()`` when full. True on a hit."""
    if e in cache:
        return True
    if len(cache) >= cap:
        cache.discard(victim())
    cache.add(e)
    return False


def policy_hits(tokens: np.ndarray, cap: int, learned: np.ndarray, policy: str) -> tuple[int, int]:
    """(hits, lookups) of one layer's cache under ``policy`` (a POLICIES name), token by token in decode order. The
    duel (expert_duel.c) runs LRU and the hot set as shadow caches, keeps a decayed lead of their would-be hits,
    and evicts by the leader's rule, a resident the leader's shadow does not hold first."""
    layer = LayerRouting(cap, learned)
    real: set[int] = set()
    shadows: dict[bool, set[int]] = {False: set(), True: set()}      # by_heat -> shadow (False: LRU)
    lead, leader_by_heat = 0.0, True
    hits = lookups = 0
    for t, chosen in enumerate(tokens):
        for e in chosen:
            e = int(e)
            layer.access(e)
            lookups += 1
            if policy == "duel":
                lru, hot = (touch(shadows[h], e, cap, partial(layer.evict, shadows[h], h)) for h in (False, True))
                lead = lead * DUEL_DECAY + (int(lru) - int(hot))
                lead = 0.0 if abs(lead) < 1e-9 else lead
                leader_by_heat = False if lead > DUEL_MARGIN else True if lead < -DUEL_MARGIN else leader_by_heat
                by_heat, spare = leader_by_heat, shadows[leader_by_heat]
            else:
                by_heat, spare = policy == "hot set", set()
            hits += touch(real, e, cap, partial(layer.evict, real, by_heat, spare))
            layer.last_use[e] = layer.tick
        if (t + 1) % REPIN_EVERY == 0:
            layer.repin()
    return hits, lookups


def simulate(trace: np.ndarray, experts: int, caps: list[int]) -> dict[str, dict[int, float]]:
    half = trace.shape[1] // 2
    learned = popularity(trace[:, :half], experts)
    out: dict[str, dict[int, float]] = {policy: {} for policy in POLICIES}
    for policy in POLICIES:
        # LRU keeps no counts: its replay is the same whatever it was seeded with
        for cap in caps:
            h = n = 0
            for li, layer in enumerate(trace[:, half:]):
                a, b = policy_hits(layer, cap, learned[li], policy)
                h, n = h + a, n + b
            out[policy][cap] = h / n
    return out


def engine_hit_rates(model_dir: Path, prompt: list[int], caps: list[int], tokens: int) -> dict[str, dict[int, float]]:
    from colibri.builder import build_family
    from colibri.engine import Engine
    from colibri.model import read_config
    from colibri.records import ResolvedModel
    from colibri_olmoe.plugin import engine_hparams

    resolved = ResolvedModel(model_dir, "olmoe", "olmoe", read_config(model_dir))
    binary = build_family("olmoe")
    names = {"off": "engine lru", "on": "engine hot set", "duel": "engine duel"}
    out: dict[str, dict[int, float]] = {name: {} for name in names.values()}
    with tempfile.TemporaryDirectory() as tmp:
        for pin in names:
            for cap in caps:
                argv = [str(binary), "--model", str(model_dir), "--ctx", str(len(prompt) + tokens + 8),
                        "--slots", "1", "--cap", str(cap), "--threads", "2", "--prefetch", "off", "--pin", pin,
                        "--hotset", str(Path(tmp) / f"hot-{pin}-{cap}"), *engine_hparams(resolved)]
                with Engine(argv, env={"COLIBRI_PREFETCH": "0"}) as engine:
                    engine.generate(prompt, max_tokens=tokens)
                    stats = engine.stats()
                hits, misses = sum(stats["hits"]), sum(stats["misses"])
                out[names[pin]][cap] = hits / (hits + misses)
    return out


def plot(pop: np.ndarray, curves: dict[str, dict[int, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    image = a.imshow(pop * pop.shape[1], aspect="auto", cmap="viridis")
    a.set_xlabel("expert")
    a.set_ylabel("layer")
    a.set_title("expert popularity (x uniform share)")
    fig.colorbar(image, ax=a)
    styles = {"lru": "o-", "hot set": "s-", "duel": "^-", "engine lru": "x--", "engine hot set": "+--",
              "engine duel": "v--"}
    for name, curve in curves.items():
        caps = sorted(curve)
        b.plot(caps, [100 * curve[c] for c in caps], styles.get(name, "o-"), label=name)
    caps = sorted(next(iter(curves.values())))
    b.plot(caps, [100 * c / pop.shape[1] for c in caps], ":", color="grey", label="uniform routing")
    b.set_xscale("log", base=2)
    b.set_xlabel("cache slots per layer")
    b.set_ylabel("hit rate (%)")
    b.set_title("expert cache hit rate, held-out text")
    b.grid(alpha=0.3)
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(meta: dict, pop: np.ndarray, reuse_by_layer: np.ndarray, curves: dict[str, dict[int, float]]) -> str:
    experts = pop.shape[1]
    lines = [BEGIN, "## Routing study: colibri-nano on held-out text", "",
             f"`nox -s routing_study` ({meta['tokens']} held-out tokens of the Python standard library that "
             f"colibri-nano never trained on; {meta['layers']} MoE layers x {experts} experts, top-{meta['k']}). "
             "Simulated rates replay transformers' routing token by token (hot set: the engine's `--pin on` policy, "
             "seeded with the first half's counts; duel: `--pin duel`, the default, evicting by whichever of the "
             "two shadow caches hit more over the recent lookups; all scored on the second half); engine "
             f"rates are `hits / (hits + misses)` of the C engine generating {meta['engine_tokens']} greedy tokens "
             f"from a {meta['prompt_tokens']}-token held-out prompt, no prefetch.", "",
             "| layer | top expert share | top-4 share | uniform share | normalised entropy | reuse t-1 -> t |",
             "|---|---|---|---|---|---|"]
    for i, (p, r) in enumerate(zip(pop, reuse_by_layer)):
        q = np.sort(p)[::-1]
        entropy = float(-(p[p > 0] * np.log(p[p > 0])).sum() / np.log(experts))
        lines.append(f"| {i} | {100 * q[0]:.1f}% | {100 * q[:4].sum():.1f}% | {100 / experts:.1f}% | "
                     f"{entropy:.3f} | {100 * r:.1f}% |")
    caps = sorted(next(iter(curves.values())))
    lines += ["", "| cache slots per layer | " + " | ".join(str(c) for c in caps) + " |",
              "|---|" + "---|" * len(caps)]
    lines.append("| uniform routing | " + " | ".join(f"{100 * c / experts:.0f}%" for c in caps) + " |")
    for name, curve in curves.items():
        lines.append(f"| {name} | " + " | ".join(f"{100 * curve[c]:.1f}%" for c in caps) + " |")
    lines += ["", "![routing study](routing-study.png)", "", END]
    return "\n".join(lines) + "\n"


def write_section(doc: Path, section: str) -> None:
    text = doc.read_text(encoding="utf-8") if doc.exists() else "# Benchmarks\n"
    if BEGIN in text and END in text:
        text = text[: text.index(BEGIN)] + section.rstrip("\n") + text[text.index(END) + len(END):]
    else:
        text = text.rstrip("\n") + "\n\n" + section
    tmp = doc.with_suffix(".md.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, doc)


def main(argv: list[str] | None = None) -> int:
    from colibri_olmoe.plugin import NANO_DIR

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=NANO_DIR)
    parser.add_argument("--windows", type=int, default=24, help="held-out windows of the training length")
    parser.add_argument("--engine-tokens", type=int, default=64)
    parser.add_argument("--docs", type=Path, default=ROOT / "docs")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    train_nano = load_training_module()
    from tokenizers import Tokenizer

    cfg = train_nano.RunConfig(**json.loads((args.model / "metrics.json").read_text())["run_config"])
    tok = Tokenizer.from_file(str(args.model / "tokenizer.json"))
    _, held = train_nano.split_corpus(cfg)
    windows = train_nano.eval_windows(tok, held, cfg.seq, args.windows)
    trace = routing_trace(args.model, windows)
    caps = [c for c in (1, 2, 4, 8, 16) if c < cfg.experts]
    pop = popularity(trace, cfg.experts)
    curves = simulate(trace, cfg.experts, caps)
    prompt = windows[-1, :96].tolist()
    curves.update(engine_hit_rates(args.model, prompt, caps, args.engine_tokens))
    meta = {"tokens": int(trace.shape[1]), "layers": cfg.layers, "k": cfg.top_k,
            "engine_tokens": args.engine_tokens, "prompt_tokens": len(prompt)}
    plot(pop, curves, args.docs / "routing-study.png")
    section = markdown(meta, pop, reuse(trace), curves)
    write_section(args.docs / "benchmarks.md", section)
    sys.stdout.write(section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
