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


def schema_grammar(schema: dict[str, Any] | None, lead: str | None = None) -> str:
    """The llguidance grammar of a JSON schema (None: any JSON object), compact JSON with no free whitespace, so
    a sampled reply cannot wander off into blank space. ``lead``: literal text before it (the close of a
    reasoning block the prompt opened: the answer, not the reasoning, is the JSON)."""
    from .call_grammar import json_value, text

    if schema is not None and not isinstance(schema, dict):
        raise ConstraintError("the JSON schema must be an object", "check it against JSON Schema draft 2020-12")
    body = json_value({"type": "object"} if schema is None else schema)
    return lark_grammar(f"start: {text(lead) + ' ' if lead else ''}{body}\n", "the JSON schema",
                        "check it against JSON Schema draft 2020-12")


def lark_grammar(lark: str, what: str = "the tool-call grammar", hint: str = "check the tools' parameter schemas"
                 ) -> str:
    """The llguidance grammar of a Lark grammar (with embedded JSON schemas), checked; ``what`` and ``hint``
    word the error."""
    ll = _llguidance()
    try:
        grammar = ll.LLMatcher.grammar_from_lark(lark)
    except (ValueError, TypeError) as exc:
        # llguidance points at the column on further lines; the first says what is wrong
        raise ConstraintError(f"{what} cannot be compiled: {str(exc).splitlines()[0]}", hint) from None
    failed, messages = ll.LLMatcher.validate_grammar_with_warnings(grammar)
    if failed:
        raise ConstraintError(f"{what} cannot be compiled: {' '.join(messages).splitlines()[0]}", hint)
    return grammar


def read_schema_file(path: Any) -> dict[str, Any]:
    """A JSON schema file (``coli run --json-schema``), or a one-line error naming it."""
    from pathlib import Path

    try:
        schema = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConstraintError(f"--json-schema {path}: cannot read it ({exc.strerror})", "pass a readable file") \
            from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConstraintError(f"--json-schema {path}: not JSON ({exc})", "pass a JSON schema file") from None
    if not isinstance(schema, dict):
        raise ConstraintError(f"--json-schema {path}: a JSON schema is an object", "pass a JSON schema file")
    return schema


def schema_file_grammar(model: Any, prompt_text: str, path: Any) -> str:
    """``coli run --json-schema FILE``: the grammar of the file's schema, after the close of a reasoning block the
    rendered prompt opened (the family's output syntax says its markers)."""
    from . import hooks
    from .output_parser import prompt_opens_reasoning

    schema = read_schema_file(path)
    parser = hooks.parse_output(model)
    syntax = parser.syntax if parser is not None else None
    lead = syntax.reasoning_close if syntax is not None and prompt_opens_reasoning(syntax, prompt_text) else None
    return schema_grammar(schema, lead)


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

    def follow(self, engine: Any, request: Any, token: int, stop_ids: Sequence[int]) -> None:
        """After the engine sampled ``token``: advance and send the next step's mask, as soon as the token is
        known, while the engine runs its forward pass. Nothing follows a stop token (the sequence is over); a
        token the matcher refuses cancels the sequence where the grammar would have broken."""
        if token in stop_ids:
            return
        if self.advance(token):
            engine.mask(request, self.mask())
        else:
            request.cancel()

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
