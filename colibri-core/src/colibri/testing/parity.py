"""Engine vs transformers, at every cache size: the parity check every family engine's tests run.

A family test builds a tiny checkpoint, loads transformers' model of it as the reference, picks a prompt whose
greedy continuation has no near-tie (``pick_prompt``), and hands ``check_every_cache_size`` a function that starts
its engine with a given ``--cap``: greedy tokens must be identical and prompt logits within ``LOGIT_TOL`` at each
cache size (one slot per layer evicts every routed expert), and the expert accesses must not depend on it.

Imports torch lazily (inside the functions), like the rest of ``colibri.testing``.
"""

from __future__ import annotations

import random
from typing import Any, Callable, Mapping, Sequence

from ..engine import Engine

GREEDY_TOKENS = 32
PROMPT_TOKENS = 40      # more than one prefill chunk (32), so chunked prefill is on the path
LOGIT_TOL = 1e-4        # f32 on both sides: only summation order differs
MIN_MARGIN = 1e-3       # a top-1/top-2 gap ten times the tolerance cannot flip under it
PAD = 1                 # the tiny tokenizers' pad id: transformers masks it out of an un-masked prompt
CACHE_SIZES = (1, 2, 0)  # slots per MoE layer: thrashing, partial, every expert


def reference_run(model: Any, prompt: list[int], n: int = GREEDY_TOKENS, pad: int = PAD, use_cache: bool = True):
    """transformers' prompt logits, greedy continuation of ``n`` tokens, and the smallest top-1/top-2 margin
    along it. ``use_cache=False`` for models whose cache transformers cannot build (e.g. qwen3_next with every
    layer linear)."""
    import torch

    ids = torch.tensor([prompt])
    mask = torch.ones_like(ids)
    with torch.no_grad():
        logits = model(ids, attention_mask=mask, use_cache=use_cache).logits[0]
        out = model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             return_dict_in_generate=True, output_logits=True, pad_token_id=pad, use_cache=use_cache)
    top2 = torch.cat(out.logits, 0).topk(2, dim=-1).values
    return logits, out.sequences[0, len(prompt):].tolist(), (top2[:, 0] - top2[:, 1]).min().item()


def seeded_prompt(seed: int, vocab: int = 512, length: int = PROMPT_TOKENS) -> list[int]:
    """A reproducible random prompt (ids 0 and 1 left out: the tiny tokenizers' specials)."""
    rng = random.Random(seed)
    return [rng.randrange(2, vocab) for _ in range(length)]


def pick_prompt(model: Any, vocab: int = 512, length: int = PROMPT_TOKENS, n: int = GREEDY_TOKENS,
                tries: int = 12, use_cache: bool = True):
    """The first seeded prompt whose reference continuation has no near-tie (chosen from transformers alone), with
    its reference logits and tokens."""
    import pytest

    for seed in range(tries):
        prompt = seeded_prompt(seed, vocab, length)
        logits, tokens, margin = reference_run(model, prompt, n, use_cache=use_cache)
        if margin >= MIN_MARGIN:
            return prompt, logits, tokens
    pytest.fail(f"no prompt of {tries} tried has a top-1/top-2 margin >= {MIN_MARGIN} over {n} greedy tokens")


def check_every_cache_size(start: Callable[[int], Engine], prompt: list[int], ref_logits: Any | Sequence[Any],
                           ref_tokens: list[int], *, moe_layers: int, experts: int = 0,
                           caps: Sequence[int] = CACHE_SIZES, n: int = GREEDY_TOKENS,
                           expect_ready: Mapping[str, Any] | None = None) -> dict[int, tuple[Any, dict]]:
    """Run the engine at each cache size and hold it to the reference.

    :param start: starts the family's engine on the checkpoint with ``--cap`` set to its argument.
    :param ref_logits: the reference prompt logits, or several (e.g. transformers' f32 and an exact float64 run):
        the engine's must be within ``LOGIT_TOL`` of each.
    :param moe_layers: how many layers have an expert store.
    :param experts: routed experts per layer; with one slot per layer every layer must then miss more often than
        that (the cache thrashes). 0 only asks for a miss in every layer.
    :param expect_ready: values each started engine's ``ready`` event must report (e.g. its ``state_bytes``).
    :returns: ``{cap: (result, stats)}`` for any further per-family checks.
    """
    import torch

    refs: list[Any] = list(ref_logits) if isinstance(ref_logits, (list, tuple)) else [ref_logits]
    accesses = None
    runs: dict[int, tuple[Any, dict]] = {}
    for cap in caps:
        with start(cap) as engine:
            for key, value in (expect_ready or {}).items():
                assert engine.ready[key] == value, f"cap {cap}: ready {key} {engine.ready[key]} != {value}"
            result = engine.generate(prompt, max_tokens=n, logits=True)
            stats = engine.stats()
        assert result.tokens == ref_tokens, f"cap {cap}: greedy tokens differ from transformers"
        got = torch.tensor(result.logits, dtype=torch.float64)
        for ref in refs:
            diff = (got - ref.double()).abs().max().item()
            assert diff < LOGIT_TOL, f"cap {cap}: prompt logits differ by {diff:.3g}"
        assert len(stats["hits"]) == moe_layers, "only MoE layers have an expert store"
        total = [h + m for h, m in zip(stats["hits"], stats["misses"], strict=True)]
        accesses = accesses or total
        assert total == accesses, "expert accesses must not depend on the cache size"
        if cap == 1:
            assert all(m > experts for m in stats["misses"]), "one slot per layer must thrash"
        runs[cap] = (result, stats)
    return runs
