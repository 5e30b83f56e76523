"""The state of a System One request: a string, an object, or an array of text parts (strings or
``{"type": "text", "text": ...}``), checked, and joined into one text when ``normalize`` is asked."""

from __future__ import annotations

from typing import Any

from .questions import DecisionInputError


def check_state(state: Any, normalize: bool = False) -> Any:
    """The state as the prompts get it: unchanged, or with ``normalize`` an array of text parts joined into one
    string (the parts' texts in order, as a template that prints text parts prints them)."""
    if isinstance(state, (str, dict)):
        return state
    if not isinstance(state, list):
        raise DecisionInputError("state", "must be a string, an object or an array of text parts")
    texts = []
    for i, part in enumerate(state):
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif isinstance(part, dict) and part.get("type") in ("image", "image_url"):
            raise DecisionInputError(f"state[{i}]", "images need a model that reads them; this one reads text",
                                     "send the state as text")
        else:
            raise DecisionInputError(f"state[{i}]", "a part must be a string or {\"type\": \"text\", \"text\": ...}")
    return "".join(texts) if normalize else state
