"""What a conversion costs in quality: teacher-forced logits of a container against its source.

The Python half of ``coli bench quality --model DST --reference SRC``. Both models read the same token ids; the
first ``prefill`` ids are the prompt (prefill path, matmul kernels) and the rest are fed back one by one through
the protocol's ``forced`` field (decode path, matvec kernels; needs an engine that emits logits for forced
steps), with ``logits`` on, so every position's next-token distribution is compared: KL(reference || candidate),
top-1 agreement, and each model's perplexity on the text.

Engines are duck-typed (``submit(prompt, logits=, forced=, max_tokens=, temperature=)`` returning a request whose
``events()`` yields protocol events), so the metrics are testable without a built engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from ..engine import logits_row
from ..errors import EngineError, UsageError


@dataclass(frozen=True)
class QualityReport:
    positions: int                # next-token predictions compared
    mean_kl: float                # nats, KL(reference || candidate), mean over positions
    max_kl: float
    top1_agreement: float         # fraction of positions where both argmaxes agree
    reference_ppl: float          # perplexity of the text under each model
    candidate_ppl: float

    @property
    def ppl_ratio(self) -> float:
        return self.candidate_ppl / self.reference_ppl


def forced_logits(engine: Any, ids: Sequence[int], prefill: int, slot: int = 0) -> np.ndarray:
    """Logits predicting ``ids[1:]``: positions ``0 .. len(ids) - 2``, as a float64 [n - 1, vocab] array.

    The engine prefills ``ids[:prefill]`` and is forced through the rest, emitting logits at every position.
    """
    ids = [int(t) for t in ids]
    if len(ids) < 2 or not 1 <= prefill <= len(ids):
        raise UsageError(f"quality: need at least 2 tokens and 1 <= prefill <= {len(ids)} (got {prefill})")
    forced = ids[prefill:]
    # "f32": each row as base64 float32, not vocab numbers printed and parsed as JSON text (docs/protocol.md)
    request = engine.submit(ids[:prefill], slot=slot, logits="f32", forced=forced or None,
                            max_tokens=max(1, len(forced)), temperature=0.0)
    by_pos: dict[int, np.ndarray] = {}
    for event in request.events():
        if event.get("ev") == "logits":
            by_pos[int(event["pos"])] = logits_row(event)
    want = range(len(ids) - 1)
    missing = [p for p in want if p not in by_pos]
    if missing:
        raise EngineError(f"quality: the engine sent no logits for position {missing[0]} "
                          f"({len(missing)} of {len(ids) - 1} missing)",
                          "the engine must emit logits for prompt and forced positions (docs/protocol.md)")
    return np.asarray([by_pos[p] for p in want], dtype=np.float64)


def _log_softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def compare(reference: np.ndarray, candidate: np.ndarray, targets: Sequence[int]) -> QualityReport:
    """Metrics over aligned [positions, vocab] logits; ``targets[i]`` is the token that followed position i."""
    if reference.shape != candidate.shape or reference.ndim != 2 or len(targets) != reference.shape[0]:
        raise UsageError(f"quality: logits shapes {reference.shape} / {candidate.shape} and {len(targets)} targets "
                         "do not line up (the two models must share a tokenizer and vocabulary)")
    lp_ref, lp_cand = _log_softmax(reference), _log_softmax(candidate)
    kl = (np.exp(lp_ref) * (lp_ref - lp_cand)).sum(axis=-1)
    t = np.asarray(targets, dtype=np.int64)
    rows = np.arange(len(t))
    return QualityReport(
        positions=len(t),
        mean_kl=float(kl.mean()),
        max_kl=float(kl.max()),
        top1_agreement=float((reference.argmax(-1) == candidate.argmax(-1)).mean()),
        reference_ppl=float(np.exp(-lp_ref[rows, t].mean())),
        candidate_ppl=float(np.exp(-lp_cand[rows, t].mean())),
    )


def merge(reports: Iterable[QualityReport]) -> QualityReport:
    """Position-weighted combination of per-text reports."""
    reports = list(reports)
    n = sum(r.positions for r in reports)
    if n == 0:
        raise UsageError("quality: no positions to compare")

    def wmean(values):
        return sum(v * r.positions for v, r in zip(values, reports)) / n

    return QualityReport(
        positions=n,
        mean_kl=wmean(r.mean_kl for r in reports),
        max_kl=max(r.max_kl for r in reports),
        top1_agreement=wmean(r.top1_agreement for r in reports),
        reference_ppl=float(np.exp(wmean(np.log(r.reference_ppl) for r in reports))),
        candidate_ppl=float(np.exp(wmean(np.log(r.candidate_ppl) for r in reports))),
    )


def measure(reference_engine: Any, candidate_engine: Any, texts: Sequence[Sequence[int]],
            prefill_fraction: float = 0.5) -> QualityReport:
    """Teacher-force every text through both engines and merge the per-text reports."""
    reports = []
    for ids in texts:
        prefill = max(1, int(len(ids) * prefill_fraction))
        ref = forced_logits(reference_engine, ids, prefill)
        cand = forced_logits(candidate_engine, ids, prefill)
        reports.append(compare(ref, cand, ids[1:]))
    return merge(reports)


QUALITY_TEXT = Path(__file__).with_name("quality_text.txt")


def default_text() -> str:
    """The fixed, offline passage ``coli bench quality`` teacher-forces when no --text-file is given."""
    return QUALITY_TEXT.read_text(encoding="utf-8")


DEFAULT_POSITIONS = 512


def fitting_positions(positions: int | None, max_ctx: int | None) -> int:
    """``--positions``, or its default shrunk to what the context holds: n predictions need n + 1 tokens in one
    prompt. An explicit value the context cannot hold is refused with the largest that fits."""
    if positions is None:
        return DEFAULT_POSITIONS if max_ctx is None else max(1, min(DEFAULT_POSITIONS, max_ctx - 1))
    if max_ctx is not None and positions + 1 > max_ctx:
        raise UsageError(f"--positions {positions}: needs {positions + 1} tokens of context and the models hold at "
                         f"most {max_ctx}", f"pass --positions {max_ctx - 1} or fewer")
    return positions


def token_window(ids: Sequence[int], positions: int, where: str) -> list[int]:
    """The first ``positions + 1`` ids (``positions`` next-token predictions); refuses a text too short."""
    if positions < 1:
        raise UsageError(f"--positions {positions}: must be at least 1", "for example --positions 512")
    if len(ids) < positions + 1:
        raise UsageError(f"quality: {where} tokenizes to {len(ids)} tokens, {positions + 1} are needed for "
                         f"--positions {positions}", f"pass --positions {max(1, len(ids) - 1)} or a longer --text-file")
    return [int(t) for t in ids[:positions + 1]]


def run_quality(candidate: Any, reference: Any, texts: Sequence[str], prefill_fraction: float = 1.0,
                positions: int | str | None = None, **engine_options: Any) -> QualityReport:
    """``coli bench quality``: tokenize ``texts`` with the reference's tokenizer, run each model's engine in turn
    (one at a time, so peak RAM is one model's), and compare. ``positions``: predictions per text (each text cut
    to ``positions + 1`` tokens), ``"fit"`` for the default the models' context holds, None for whole texts.
    ``candidate``/``reference`` are ResolvedModels; ``engine_options`` go to ``colibri.launch.open_engine``
    (ram_gib, ctx, threads, ...).

    Needs an engine that runs colibri-quant containers (the family's ``limits().quant_schemes`` lists them).
    ``prefill_fraction`` < 1 also compares decode steps (teacher-forced through ``forced``), which needs engines
    that emit ``logits`` events for forced positions too; today's protocol promises prompt logits only, so the
    default compares every position through the prefill path.
    """
    from .. import hooks
    from ..inventory import load_facts
    from ..launch import max_ctx, open_engine

    tokenizer = hooks.load_tokenizer(reference)
    ids = [tokenizer.encode(t) for t in texts]
    if positions is not None:
        bounds = [b for b in (max_ctx(load_facts(m)) for m in (reference, candidate)) if b]
        asked = None if positions == "fit" else int(positions)
        positions = fitting_positions(asked, min(bounds) if bounds else None)
        ids = [token_window(x, positions, f"text {i + 1}") for i, x in enumerate(ids)]
    if any(len(x) < 2 for x in ids):
        raise UsageError("quality: every text must tokenize to at least 2 tokens")
    # Every position's logits come from one prompt, so the context must hold the longest text.
    engine_options.setdefault("ctx", max(len(x) for x in ids))
    prefills = [max(1, int(len(x) * prefill_fraction)) for x in ids]
    logits: dict[str, list[np.ndarray]] = {}
    for label, model in (("reference", reference), ("candidate", candidate)):
        with open_engine(model, **engine_options) as engine:
            logits[label] = [forced_logits(engine, x, p).astype(np.float32) for x, p in zip(ids, prefills)]
    return merge(compare(r.astype(np.float64), c.astype(np.float64), x[1:])
                 for r, c, x in zip(logits["reference"], logits["candidate"], ids))
