"""Control tokens in a request's text are text: a state that spells ``<|im_end|>`` or ``<|mark|>`` must not
close the user turn or place a mark. As transformers' ``apply_chat_template(..., sanitize_control_tokens=True)``:
user strings get each control token wrapped in private-use markers before rendering; the rendered prompt is then
encoded piece by piece, the marked tokens as plain text (no added-token matching), the rest normally.

Control tokens: the tokenizer's special added tokens, its other added tokens that the template itself spells
(whitespace ones excepted), and the decision sentinels ``<|mark|>`` / ``<|split|>``.
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Any, Callable

from .. import chat_template as ct
from ..tokenizer import TextTokenizer

START, END = "\U000f0000", "\U000f0001"
SENTINELS = ("<|mark|>", "<|split|>")


@lru_cache(maxsize=16)
def _literal_text(source: str) -> str:
    import jinja2.nodes

    ast = ct._build_environment().parse(source)
    literals = {node.data for node in ast.find_all(jinja2.nodes.TemplateData)}
    literals |= {node.value for node in ast.find_all(jinja2.nodes.Const) if isinstance(node.value, str)}
    return "\0".join(literals)


def control_tokens(tok: TextTokenizer, template_source: str) -> tuple[str, ...]:
    literal = _literal_text(template_source)
    added = tok.backend.get_added_tokens_decoder().values()
    found = {t.content for t in added if t.special or (t.content in literal and not t.content.isspace())}
    return tuple(sorted(found | set(SENTINELS), key=len, reverse=True))   # longest first: a token beats its parts


def _patterns(tokens: tuple[str, ...]) -> tuple[re.Pattern, re.Pattern]:
    tokens_re = re.compile("|".join(map(re.escape, tokens)) or "(?!)")
    return tokens_re, re.compile(f"{START}({tokens_re.pattern}){END}|[{START}{END}]")


def mark(value: Any, tokens: tuple[str, ...]) -> Any:
    """``value`` (strings, and the values of objects and arrays) with each control token wrapped in markers;
    markers already in the text are dropped first, so they cannot forge a marked token."""
    tokens_re = _patterns(tokens)[0]
    if isinstance(value, str):
        clean = value.replace(START, "").replace(END, "")
        return tokens_re.sub(lambda m: START + m.group(0) + END, clean)
    if isinstance(value, dict):
        return {key: mark(item, tokens) for key, item in value.items()}
    if isinstance(value, list):
        return [mark(item, tokens) for item in value]
    return value


def encode_plain(tok: TextTokenizer, text: str) -> list[int]:
    """``text`` through the tokenizer's normalizer, pre-tokenizer and model only: no added token is matched."""
    backend = tok.backend
    if backend.normalizer is not None:
        text = backend.normalizer.normalize_str(text)
    splits = [text] if backend.pre_tokenizer is None else [s for s, _ in backend.pre_tokenizer.pre_tokenize_str(text)]
    return [t.id for split in splits for t in backend.model.tokenize(split)]


def encode_marked(tok: TextTokenizer, text: str, tokens: tuple[str, ...],
                  encode: Callable[[str], list[int]]) -> list[int]:
    """The rendered prompt's ids: marked control tokens as plain text, the rest with ``encode`` (which still sees
    the template's own control tokens). A piece after the first is encoded after a newline that is then removed,
    so a tokenizer that adds a prefix space at the start of a text does not add one mid-prompt."""
    pieces = _patterns(tokens)[1].split(text)
    ids = encode(pieces[0])
    newline = encode("\n")
    for i, piece in enumerate(pieces[1:], start=1):
        if not piece:
            continue
        run = encode_plain if i % 2 == 1 else (lambda _tok, s: encode(s))
        piece_ids = run(tok, "\n" + piece)
        ids += piece_ids[len(newline):] if piece_ids[:len(newline)] == newline else run(tok, piece)
    return ids
