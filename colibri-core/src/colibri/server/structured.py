"""Constrained decoding for one generation run: which grammar a request asks for, and the mask of each step.

``response_format`` ``json_object``/``json_schema`` compile to a JSON grammar (:mod:`colibri.constraints`); a
forcing ``tool_choice`` to one call in the family's syntax (:mod:`colibri.call_grammar`). The first mask is sent
right after the submit; each later one as soon as the engine reports the token it sampled, while the engine runs
that token's forward pass, so computing it costs no wall time unless it is slower than the model. No mask is sent
after a stop token: the sequence is over.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..call_grammar import forced_call_grammar
from ..constraints import Constraint, ConstraintCompiler, ConstraintError, lark_grammar, schema_grammar
from ..errors import EngineError
from ..output_parser import prompt_opens_reasoning


def grammar_for(spec: Any, codec: Any, prompt_text: str) -> str | None:
    """The request's grammar, or None when it is unconstrained. Raises ConstraintError for a bad schema."""
    fmt = spec.response_format
    forcing = bool(spec.tools) and spec.tool_choice not in ("auto", "none")
    if fmt is None and not forcing:
        return None
    make = getattr(codec, "output_parser", None)
    parser = make() if make is not None and spec.messages is not None else None
    syntax = parser.syntax if parser is not None else None
    opened = syntax is not None and prompt_opens_reasoning(syntax, prompt_text)
    if fmt is not None:
        return schema_grammar(fmt.get("schema") if fmt["type"] == "json_schema" else None,
                              syntax.reasoning_close if syntax is not None and opened else None)
    if syntax is None or syntax.call_grammar is None:
        raise ConstraintError("this model's family cannot force a tool call (its output syntax has no call "
                              "grammar)", "use tool_choice 'auto'")
    only = spec.tool_choice.removeprefix("function:") if spec.tool_choice.startswith("function:") else None
    close = syntax.reasoning_close if opened else None
    return lark_grammar(forced_call_grammar(syntax.call_grammar, spec.tools, only, close))


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
    try:
        constraint.follow(engine, request, token, stop_ids)
    except EngineError:
        pass   # the engine died; the pump reports it from the request
