"""Constrained decoding: a grammar (a JSON schema, any JSON object) turned into the allowed-token mask of every
sampling step, with llguidance (docs/server.md says why llguidance).

The mask is computed here, in Python, from the checkpoint's own ``tokenizer.json`` (no transformers needed), and
sent to the engine before each sampling step (the protocol's ``mask`` request, docs/protocol.md); the engine
applies it before every other processor and samples in C. The end-of-turn ids are the grammar's EOS: they are
allowed once the JSON is complete, and they are all that is allowed once nothing else can follow.

llguidance is an optional dependency (``colibri-core[structured]``): without it a constrained request is refused
with a 400 naming the field and the fix.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from typing import Any

from .errors import ColibriError

INSTALL_HINT = "pip install 'colibri-core[structured]' (it installs llguidance)"


class ConstraintError(ColibriError):
    """A grammar that cannot be compiled, or a missing grammar library."""


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError:
        raise ConstraintError("constrained decoding needs the llguidance package, which is not installed",
                              INSTALL_HINT) from None
    return llguidance


def schema_grammar(schema: dict[str, Any] | None) -> str:
    """The llguidance grammar of a JSON schema (None: any JSON object), compact JSON with no free whitespace, so
    a sampled reply cannot wander off into blank space."""
    ll = _llguidance()
    target = {"type": "object"} if schema is None else schema
    try:
        return ll.LLMatcher.grammar_from_json_schema(json.dumps(target), defaults={"whitespace_flexible": False})
    except (ValueError, TypeError) as exc:
        raise ConstraintError(f"the JSON schema cannot be compiled: {exc}",
                              "check it against JSON Schema draft 2020-12") from None


def lark_grammar(lark: str) -> str:
    """The llguidance grammar of a Lark grammar (forced tool calls, :mod:`colibri.call_grammar`)."""
    try:
        return _llguidance().LLMatcher.grammar_from_lark(lark)
    except (ValueError, TypeError) as exc:
        raise ConstraintError(f"the tool-call grammar cannot be compiled: {exc}",
                              "check the tools' parameter schemas") from None


class Constraint:
    """One reply's matcher: the mask of the next step, advanced by each token the engine feeds."""

    def __init__(self, matcher: Any, words: int):
        self._matcher = matcher
        self._words = words

    def mask(self) -> bytes:
        """The allowed tokens as the protocol's ``allow`` bytes (32-bit little-endian words, bit i of word w is
        token 32 w + i)."""
        bits = bytes(self._matcher.compute_bitmask())
        return bits[: self._words * 4].ljust(self._words * 4, b"\0")

    def advance(self, token: int) -> bool:
        """Feed the token the engine sampled; False once the matcher refuses it (then no mask can follow)."""
        return bool(self._matcher.consume_token(int(token))) and not self._matcher.is_error()

    @property
    def error(self) -> str:
        return str(self._matcher.get_error())


class ConstraintCompiler:
    """Per served model: the llguidance tokenizer (built once, ~1 s) and the grammars it compiles."""

    def __init__(self, tokenizer_json: str, vocab: int, stop_ids: Sequence[int]):
        self._json = tokenizer_json
        self._vocab = vocab
        self._stop = [int(t) for t in stop_ids]
        self._tokenizer: Any = None
        self._lock = threading.Lock()

    def _lltokenizer(self) -> Any:
        ll = _llguidance()
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = ll.LLTokenizer(self._json, n_vocab=self._vocab, eos_token=self._stop or None)
            return self._tokenizer

    def check(self, grammar: str) -> None:
        """Refuse a grammar llguidance rejects, before anything is queued."""
        failed, messages = _llguidance().LLMatcher.validate_grammar_with_warnings(grammar, self._lltokenizer())
        if failed:
            raise ConstraintError(f"the grammar is not valid: {'; '.join(messages)}", "simplify the JSON schema")

    def start(self, grammar: str) -> Constraint:
        matcher = _llguidance().LLMatcher(self._lltokenizer(), grammar)
        if matcher.is_error():
            raise ConstraintError(f"the grammar is not valid: {matcher.get_error()}", "simplify the JSON schema")
        return Constraint(matcher, (self._vocab + 31) // 32)
