"""The System One requests the decision parity tests send (test_decide_families, test_decide_jev), and their checks:
answers within 1e-4 of transformers', and a second request on the pinned state prefilling only the questions."""

from __future__ import annotations

from typing import Any

import httpx

from colibri.decision import check_state, parse_questions
from colibri.decision.prompts import build_prompts, shared_state_tokens
from colibri.testing.checks import assert_answers_close as assert_close

QUESTIONS = {
    "spam": {"type": "noul", "instructions": "Is this spam?", "criteria": {"true": "ads", "false": None}},
    "tone": {"type": "choice", "instructions": "What is the tone?",
             "criteria": {"calm": None, "pushy": "Pressures the reader", "angry": {"signs": ["caps"]}}},
    "urgency": {"type": "score", "instructions": "How urgent is it?", "criteria": ["can wait", "this week", "today"]},
}
STATES = {
    "text": "WIN a FREE phone today, click here before midnight!",
    "json": {"message": "My card was charged twice, I want a refund.", "channel": "support"},
    "parts": [{"type": "text", "text": "Hello team,"}, {"type": "text", "text": " the build is red again."}],
}


def shared_tokens(tok: Any, settings: Any, state: Any, option_ids: Any = None) -> tuple[int, int]:
    """(prompts, leading tokens they share) of a request about ``state``: what a pinned slot reuses."""
    parsed = parse_questions(QUESTIONS, settings.labels, settings.noul_options)
    prompts = build_prompts(tok, settings, check_state(state), parsed, option_ids)
    return len(prompts), shared_state_tokens(tok, settings, state, prompts)


def check_states(url: str, references: dict[str, Any], tok: Any, settings: Any, option_ids: Any = None) -> None:
    """Each state's answers equal the reference's, in the request's order; the same request again gives the same
    answers while the engine prefills only the questions (its prompt-token counts)."""
    for name, state in STATES.items():
        body = {"state": state, "questions": QUESTIONS}
        first = httpx.post(url + "/v1/systemone", json=body, timeout=120)
        assert first.status_code == 200, first.text
        assert_close(first.json()["answers"], references[name], name)
        assert list(first.json()["answers"]) == list(QUESTIONS)
        again = httpx.post(url + "/v1/systemone", json=body, timeout=120).json()
        assert again["answers"] == first.json()["answers"]
        n, shared = shared_tokens(tok, settings, state, option_ids)
        usage, usage_again = first.json()["usage"], again["usage"]
        assert shared > 0 and usage["cached_tokens"] >= (n - 1) * shared
        assert usage_again["cached_tokens"] >= n * shared
        assert usage_again["prefilled_tokens"] == usage_again["input_tokens"] - usage_again["cached_tokens"]
        assert usage_again["prefilled_tokens"] <= usage["input_tokens"] - n * shared
