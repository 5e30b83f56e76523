"""``POST /v1/systemone``: System One decisions (closed questions about a state, answered with probabilities from
the served model's label-token logits, no generation).

The request is validated whole before it queues (a 422 names the question and field); it then holds one KV slot
for all its questions, like any request (same key gate, body limit, queue and timeouts). Requests about the same
state go to the slot that last served it, where the state's KV is already computed: only the questions are
prefilled. ``cache_slot`` pins the slot explicitly. A model that cannot decide (its engine does not announce
``decide``, it has no chat template, its labels are not single tokens) is a 400.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse

from .. import hooks
from ..decision import DecisionInputError, check_state
from ..decision.prompts import content_text
from ..engine import EngineRequestError
from ..errors import ColibriError, EngineError
from .access_log import note
from .errors import APIError
from .validation import _Fields, check_text

FIELDS = ("model", "state", "questions", "normalize", "cache_slot", "assets")


@dataclass
class SystemOneSpec:
    model: str
    state: Any
    questions: Any                 # checked by parse_questions (its 422s name the question and field)
    cache_slot: int | None = None


def invalid(field: str, message: str) -> APIError:
    return APIError(422, f"{field}: {message}", param=field, code="invalid_value")


def _check_strings(value: Any, where: str) -> None:
    """No NUL bytes nor lone surrogates anywhere in the request's text (they tokenize to nothing meant)."""
    if isinstance(value, str):
        check_text(value, where)
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_strings(item, f"{where}.{key}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_strings(item, f"{where}[{i}]")


def parse_systemone(data: dict[str, Any], default_model: str, kv_slots: int) -> SystemOneSpec:
    unknown = sorted(set(data) - set(FIELDS))
    if unknown:
        raise invalid(unknown[0], f"unknown field (a System One request has {', '.join(FIELDS)})")
    if data.get("assets"):
        raise invalid("assets", "images need a model that reads them; this one reads text")
    fields = _Fields(data)
    try:
        model = fields.string("model") or default_model
        normalize = fields.boolean("normalize", False)
        cache_slot = fields.integer("cache_slot", low=0, high=kv_slots - 1)
        if "state" not in data:
            raise invalid("state", "is required (a string, an object or an array of text parts)")
        _check_strings(data["state"], "state")
        _check_strings(data.get("questions"), "questions")
    except APIError as error:   # the field accessors' 400s: a System One client expects 422 for a bad field
        raise APIError(422, error.message, param=error.param, code=error.code) from None
    try:
        state = check_state(data["state"], normalize)
    except DecisionInputError as error:
        raise invalid(error.field, error.message.split(": ", 1)[-1]) from None
    return SystemOneSpec(model, state, data.get("questions"), cache_slot)


def state_key(state: Any) -> str:
    """The slot affinity of a state: requests about the same state find its KV where they left it."""
    return "state:" + hashlib.sha256(json.dumps(state, sort_keys=True).encode()).hexdigest()[:24]


def _decider(app: Any) -> Any:
    """The served model's ``Decider`` (asked of its family once), or a 400 when it has none."""
    cached = getattr(app.state, "decider", None)
    if cached is not None:
        return cached
    codec = app.state.services.codec
    model = getattr(codec, "model", None)
    if model is None:
        raise APIError(400, "this model cannot decide: the server has no model description for decision prompts",
                       code="model_cannot_decide")
    try:
        app.state.decider = hooks.decider(model, getattr(codec, "tokenizer", None))
    except ColibriError as exc:
        raise APIError(400, f"this model cannot decide: {exc.one_line()}", code="model_cannot_decide") from None
    return app.state.decider


async def systemone(request: Request) -> JSONResponse:
    app = request.app
    services, config = app.state.services, app.state.config
    spec = parse_systemone(await app.state.read_json(request), config.model_id, config.kv_slots)
    decider = _decider(app)
    try:
        decider.check(spec.questions)
    except DecisionInputError as error:
        raise invalid(error.field, error.message.split(": ", 1)[-1]) from None
    # the state alone cannot fit: refused by its size before anything is tokenized (unless the model cuts every
    # state to fit, as a Laya model does: its decider says so with cuts_state)
    at_least = services.codec.bound.min_tokens(len(content_text(spec.state).encode("utf-8")))
    if at_least >= services.ctx and not getattr(decider, "cuts_state", False):
        raise invalid("state", f"needs at least {at_least} tokens; the context holds {services.ctx}")
    engine = await services.host.engine(services.queue_timeout)
    if "decide" not in (getattr(engine, "ready", {}) or {}).get("abilities", ()):
        raise APIError(400, "this model cannot decide: its engine has no decide operation",
                       code="model_cannot_decide")
    lease = await services.scheduler.acquire(state_key(spec.state), spec.cache_slot)
    loop = asyncio.get_running_loop()

    def run() -> Any:
        try:
            return decider.decide(engine, spec.state, spec.questions, slot=lease.slot, ctx=services.ctx)
        finally:   # released when the engine is done with the slot, even if the client left meanwhile
            loop.call_soon_threadsafe(lease.release)

    try:
        decision = await asyncio.to_thread(run)
    except DecisionInputError as error:
        raise invalid(error.field, error.message.split(": ", 1)[-1]) from None
    except EngineRequestError as exc:
        if exc.code == "context_exceeded":
            raise invalid("state", f"does not fit the context: {exc}") from None
        raise APIError(400, str(exc), code="invalid_request") from None
    except EngineError as exc:
        services.host.report_death(engine, exc)
        raise APIError(503, f"engine unavailable: {exc.one_line()}", code="engine_unavailable",
                       headers={"Retry-After": "2"}) from None
    except ColibriError as exc:   # labels that are not single tokens, a template that refuses the state, ...
        raise APIError(400, f"this model cannot decide: {exc.one_line()}", code="model_cannot_decide") from None
    note(prompt_tokens=decision.input_tokens, completion_tokens=0)
    return JSONResponse({
        "id": "so-" + uuid.uuid4().hex[:24], "object": "systemone", "created": int(time.time()), "model": spec.model,
        "answers": decision.answers,
        "usage": {"input_tokens": decision.input_tokens, "output_tokens": 0,
                  "cached_tokens": decision.cached_tokens, "prefilled_tokens": decision.prefilled_tokens},
    })
