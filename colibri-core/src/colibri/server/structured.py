"""Constrained decoding for one generation run: which grammar a request asks for, and the mask of each step.

``response_format`` ``json_object``/``json_schema`` compile to a JSON grammar (:mod:`colibri.constraints`). The
first mask is sent right after the submit; each later one as soon as the engine reports the token it sampled,
while the engine runs that token's forward pass, so computing it costs no wall time unless it is slower than the
model. No mask is sent after a stop token: the sequence is over.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..constraints import Constraint, ConstraintCompiler, schema_grammar
from ..errors import EngineError


def grammar_for(spec: Any, codec: Any) -> str | None:
    """The request's grammar, or None when it is unconstrained. Raises ConstraintError for a bad schema."""
    fmt = spec.response_format
    if fmt is None:
        return None
    return schema_grammar(fmt.get("schema") if fmt["type"] == "json_schema" else None)


def compiler(codec: Any, vocab: int) -> ConstraintCompiler:
    """The served model's compiler, built once per engine vocabulary and kept on the codec."""
    cache = codec.__dict__.setdefault("_constraint_compilers", {})
    if vocab not in cache:
        cache[vocab] = ConstraintCompiler(codec.tokenizer.backend.to_str(), vocab, codec.stop_ids)
    return cache[vocab]


def start(grammar: str, codec: Any, engine: Any) -> Constraint:
    vocab = int(engine.ready.get("vocab") or codec.vocab_size)
    return compiler(codec, vocab).start(grammar)


def next_mask(constraint: Constraint, engine: Any, request: Any, token: int, stop_ids: Sequence[int]) -> None:
    """After the engine sampled ``token``: advance the matcher and send the next step's mask (the engine ends a
    sequence the matcher refuses: a cancel, so the reply stops where the grammar would have been broken)."""
    if token in stop_ids:
        return
    try:
        if constraint.advance(token):
            engine.mask(request, constraint.mask())
        else:
            request.cancel()
    except EngineError:
        pass   # the engine died; the pump reports it from the request
