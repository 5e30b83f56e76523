"""Incremental detokenization: streamed pieces concatenate to the full decode and never hold broken UTF-8."""

from __future__ import annotations

import pytest

from colibri.demo_tokenizer import stdlib_texts, train_bpe
from colibri.detok import REPLACEMENT, IncrementalDetokenizer

TEXTS = [
    "plain ascii text, nothing special",
    "naïve café — “quotes” ünïcödé",
    "日本語のテキストと中文混合",
    "emoji 😀🎉👩‍👩‍👧 and flags 🇩🇪🇯🇵",
    "def f(x):\n    return x ** 2  # ✓\n",
]


@pytest.fixture(scope="module")
def tok():
    # A small vocabulary learned on ASCII-heavy source code: CJK and emoji split into byte tokens mid-character.
    return train_bpe(stdlib_texts(200_000), 600)


@pytest.mark.parametrize("text", TEXTS)
def test_stream_equals_full_decode_without_replacement_chars(tok, text):
    ids = tok.encode(text).ids
    detok = IncrementalDetokenizer(lambda xs: tok.decode(xs))
    pieces = [detok.push(i) for i in ids]
    pieces.append(detok.flush())
    assert "".join(pieces) == tok.decode(ids) == text
    assert all(REPLACEMENT not in p for p in pieces)
    assert detok.text == text


def test_multibyte_characters_are_held_back_until_complete(tok):
    ids = tok.encode("😀").ids
    assert len(ids) > 1, "the emoji must span several byte tokens for this test to mean anything"
    detok = IncrementalDetokenizer(lambda xs: tok.decode(xs))
    out = [detok.push(i) for i in ids]
    assert out[:-1] == [""] * (len(ids) - 1) and out[-1] == "😀"


def test_invalid_bytes_come_out_on_flush(tok):
    # A lone leading byte of a 3-byte sequence never completes: held back, then flushed as U+FFFD.
    partial = tok.encode("日").ids[:1]
    detok = IncrementalDetokenizer(lambda xs: tok.decode(xs))
    assert detok.push(partial[0]) == ""
    assert detok.flush() == REPLACEMENT


def test_skip_ids_are_not_shown(tok):
    eos = tok.token_to_id("<|endoftext|>")
    detok = IncrementalDetokenizer(lambda xs: tok.decode(xs), skip_ids=[eos])
    text = "".join(detok.push(i) for i in [*tok.encode("ab").ids, eos]) + detok.flush()
    assert text == "ab"
