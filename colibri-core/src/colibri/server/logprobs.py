"""Log-probabilities as OpenAI returns them, from the engine's token events (``logprob`` and ``top``, the model's
own log-softmax) and, for ``echo``, from the prompt's logits rows.

A token's text is its own decoding, special tokens spelled out (as vLLM reports them); ``bytes`` are its UTF-8
bytes, so a client can rejoin tokens that split a character.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..engine import logits_row


def _token_text(codec: Any, tok: int) -> str:
    tokenizer = getattr(codec, "tokenizer", None)
    if tokenizer is not None:
        return tokenizer.decode([tok], skip_special_tokens=False)
    return codec.decode([tok])


def _entry(codec: Any, tok: int, logprob: float) -> dict[str, Any]:
    text = _token_text(codec, tok)
    return {"token": text, "logprob": float(logprob), "bytes": list(text.encode("utf-8"))}


def token_logprob(event: dict[str, Any], codec: Any) -> dict[str, Any]:
    """The chat ``logprobs.content`` entry of one token event."""
    entry = _entry(codec, int(event["tok"]), event["logprob"])
    entry["top_logprobs"] = [_entry(codec, int(t), lp) for t, lp in event.get("top", [])]
    return entry


def prompt_logprobs(event: dict[str, Any], prompt: list[int], top: int | None, codec: Any
                    ) -> list[dict[str, Any]]:
    """The entries a prompt logits row gives: row ``pos`` scores prompt token ``pos + 1`` (the first prompt token
    has no score: its logprob is None, as OpenAI's ``echo`` reports it). The last row scores the first generated
    token, which its token event already carries."""
    pos = int(event["pos"])
    out: list[dict[str, Any]] = []
    if pos == 0:
        out.append({**_entry(codec, prompt[0], 0.0), "logprob": None, "top_logprobs": None})
    if pos + 1 >= len(prompt):
        return out
    row = logits_row(event).astype(np.float64)
    logp = row - (row.max() + np.log(np.exp(row - row.max()).sum()))
    entry = _entry(codec, prompt[pos + 1], logp[prompt[pos + 1]])
    best = np.argsort(-logp, kind="stable")[: top or 0]
    entry["top_logprobs"] = [_entry(codec, int(t), logp[t]) for t in best]
    out.append(entry)
    return out


def completion_logprobs(entries: list[dict[str, Any]], offset0: int = 0) -> dict[str, Any]:
    """The legacy completions shape: parallel ``tokens``, ``token_logprobs``, ``top_logprobs`` (token -> logprob
    maps) and ``text_offset`` lists."""
    tokens, values, tops, offsets = [], [], [], []
    at = offset0
    for entry in entries:
        tokens.append(entry["token"])
        values.append(entry["logprob"])
        top = entry["top_logprobs"]
        tops.append(None if top is None else {t["token"]: t["logprob"] for t in top})
        offsets.append(at)
        at += len(entry["token"])
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}
