"""How many bytes of prompt text one token can cover at most, read from the tokenizer's own description.

Tokenizing a megabyte costs hundreds of megabytes inside ``tokenizers`` (offsets, words, masks per token), so a
prompt that cannot fit the context must be refused before it is tokenized. For a byte-level BPE every token is a
fixed run of at most L bytes (L: the longest token in the vocabulary, or an added token's text), and the text is
covered without gaps, so a text of B bytes needs at least B / L tokens: when B > (ctx - 1) × L it cannot leave room
to generate, and it is refused by its length alone.

That holds when no step can make text vanish. A normalizer can shrink it by a bounded factor (Unicode
normalization or lower-casing: at most 4 bytes become 1; a literal ``Replace``: its pattern over its replacement)
or without bound (``Strip``, accent stripping, a regex); a pre-tokenizer can drop whitespace (``Whitespace``,
``Bert``); a model can fuse a run of unknown characters into one token; an added token with ``lstrip``/``rstrip``
swallows the whitespace around it. Where only bounded factors apply the bound is exact (factor × L); otherwise it
is conservative — :data:`CONSERVATIVE_FACTOR` × L — and may refuse a text that such a step would have shrunk into
the context (megabytes of whitespace, say), never one of ordinary text.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

CONSERVATIVE_FACTOR = 4
UNICODE_SHRINK = 4          # NFKC/NFKD: U+1D400 (4 bytes) -> "A"; lower-casing: U+212A KELVIN SIGN (3) -> "k"
_KEEPING_PRE_TOKENIZERS = ("ByteLevel", "Metaspace", "Digits", "Punctuation", "UnicodeScripts", "Split")


@dataclass(frozen=True)
class PromptBound:
    bytes_per_token: int        # no token covers more bytes of the (raw) prompt text than this
    exact: bool                 # False: a step may shrink text without bound, the conservative factor is used

    def min_tokens(self, text_bytes: int) -> int:
        return math.ceil(text_bytes / self.bytes_per_token)


def prompt_bound(backend: Any) -> PromptBound:
    """The bound for a ``tokenizers.Tokenizer``."""
    description = json.loads(backend.to_str())
    pre = description.get("pre_tokenizer")
    byte_level = _has(pre, "ByteLevel")
    added = description.get("added_tokens") or []
    longest = 4   # an unknown character becomes one token: up to 4 bytes of UTF-8
    for token in backend.get_vocab(with_added_tokens=False):
        # byte-level vocabularies spell each byte as one character; others spell text (over-counting is safe)
        longest = max(longest, len(token) if byte_level else len(token.encode("utf-8", "surrogatepass")))
    for token in added:
        longest = max(longest, len(str(token.get("content", "")).encode("utf-8", "surrogatepass")))
    shrink = _normalizer_shrink(description.get("normalizer"))
    exact = (shrink is not None and _keeps_every_byte(pre) and _model_keeps_every_byte(description.get("model"),
                                                                                       byte_level)
             and not any(t.get("lstrip") or t.get("rstrip") for t in added))
    factor = shrink if exact and shrink is not None else CONSERVATIVE_FACTOR * (shrink or 1)
    return PromptBound(longest * factor, exact)


def _has(part: Any, kind: str) -> bool:
    if not isinstance(part, dict):
        return False
    if part.get("type") == "Sequence":
        members = part.get("pretokenizers") or part.get("normalizers") or []
        return any(_has(m, kind) for m in members)
    return part.get("type") == kind


def _normalizer_shrink(normalizer: Any) -> int | None:
    """How many bytes of input at most become one byte of output; None when unbounded."""
    if normalizer is None:
        return 1
    if not isinstance(normalizer, dict):
        return None
    kind = normalizer.get("type")
    if kind == "Sequence":
        factor = 1
        for member in normalizer.get("normalizers") or []:
            shrink = _normalizer_shrink(member)
            if shrink is None:
                return None
            factor *= shrink
        return factor
    if kind in ("Prepend", "ByteLevel"):
        return 1
    if kind in ("NFC", "NFD", "NFKC", "NFKD", "Lowercase"):
        return UNICODE_SHRINK
    if kind == "Replace":
        pattern, content = normalizer.get("pattern") or {}, str(normalizer.get("content", ""))
        if "String" not in pattern or not content:
            return None
        return max(1, math.ceil(len(str(pattern["String"]).encode()) / len(content.encode())))
    return None


def _keeps_every_byte(pre: Any) -> bool:
    if pre is None:
        return True
    if not isinstance(pre, dict):
        return False
    if pre.get("type") == "Sequence":
        return all(_keeps_every_byte(m) for m in pre.get("pretokenizers") or [])
    if pre.get("type") == "Split":
        return str(pre.get("behavior", "")).lower() != "removed"
    return pre.get("type") in _KEEPING_PRE_TOKENIZERS


def _model_keeps_every_byte(model: Any, byte_level: bool) -> bool:
    if not isinstance(model, dict):
        return False
    if model.get("type") == "BPE":
        return byte_level or bool(model.get("byte_fallback")) or (model.get("unk_token") is not None
                                                                   and not model.get("fuse_unk"))
    if model.get("type") == "Unigram":
        return bool(model.get("byte_fallback"))
    return False
