"""The request fields the engine's sampler honours beyond temperature/top-p/top-k: ``min_p``, the penalties,
``logit_bias``, log-probabilities and ``response_format``, checked into a :class:`GenerationSpec`.

Ranges follow OpenAI (penalties in [-2, 2], biases in [-100, 100], ``top_logprobs`` up to 20) and vLLM for the
fields OpenAI lacks (``min_p`` in [0, 1], ``repetition_penalty`` > 0).
"""

from __future__ import annotations

from typing import Any

from .errors import bad_request

MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 1024


def sampler_fields(fields: Any, spec: Any) -> None:
    """``min_p``, ``repetition_penalty``, ``presence_penalty``, ``frequency_penalty``, ``logit_bias``."""
    spec.min_p = fields.number("min_p", None, 0.0, 1.0)
    spec.repetition_penalty = fields.number("repetition_penalty", None, 1e-3, 1e3)
    if spec.repetition_penalty is not None and spec.repetition_penalty <= 0:
        raise bad_request("'repetition_penalty' must be greater than 0 (1 = off)", param="repetition_penalty",
                          code="invalid_value")
    spec.presence_penalty = fields.number("presence_penalty", 0.0, -2.0, 2.0)
    spec.frequency_penalty = fields.number("frequency_penalty", 0.0, -2.0, 2.0)
    spec.logit_bias = logit_bias(fields.data.get("logit_bias"))


def logit_bias(value: Any) -> dict[int, float]:
    """OpenAI's ``{"token id": bias}`` map; ids are checked against the vocabulary when the prompt is prepared."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise bad_request("'logit_bias' must be an object mapping token ids to biases", param="logit_bias",
                          code="invalid_type")
    if len(value) > MAX_LOGIT_BIAS:
        raise bad_request(f"'logit_bias' has {len(value)} entries; at most {MAX_LOGIT_BIAS} are allowed",
                          param="logit_bias", code="invalid_value")
    out: dict[int, float] = {}
    for key, bias in value.items():
        where = f"logit_bias.{key}"
        if not (isinstance(key, str) and key.isascii() and key.isdigit()):
            raise bad_request(f"'{where}': the keys of 'logit_bias' are token ids (decimal strings)", param=where,
                              code="invalid_value")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
            raise bad_request(f"'{where}' must be a number between -100 and 100", param=where, code="invalid_value")
        out[int(key)] = float(bias)
    return out


def chat_logprobs(fields: Any, spec: Any) -> None:
    """Chat: ``logprobs`` (boolean) and ``top_logprobs`` (0-20, only with ``logprobs``)."""
    want = fields.boolean("logprobs", False)
    top = fields.integer("top_logprobs", low=0, high=MAX_TOP_LOGPROBS)
    if top is not None and not want:
        raise bad_request("'top_logprobs' needs 'logprobs': true", param="top_logprobs", code="invalid_value")
    spec.logprobs = (top or 0) if want else None


def completion_logprobs(fields: Any, spec: Any) -> None:
    """Completions: ``logprobs`` is the number of top log-probabilities per token (0-20)."""
    spec.logprobs = fields.integer("logprobs", low=0, high=MAX_TOP_LOGPROBS)
    spec.echo = fields.boolean("echo", False)


def response_format(value: Any) -> dict[str, Any] | None:
    """``response_format``: None for text, else ``{"type": "json_object"}`` or ``{"type": "json_schema",
    "schema": {...}}`` for the constraint compiler (:mod:`colibri.server.constraints`)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise bad_request("'response_format' must be an object", param="response_format", code="invalid_type")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind != "json_schema":
        raise bad_request(f"'response_format.type' is {kind!r}; it must be 'text', 'json_object' or 'json_schema'",
                          param="response_format.type", code="invalid_value")
    inner = value.get("json_schema")
    if not isinstance(inner, dict):
        raise bad_request("'response_format.json_schema' must be an object with 'name' and 'schema'",
                          param="response_format.json_schema", code="invalid_type")
    schema = inner.get("schema", {})
    if not isinstance(schema, dict):
        raise bad_request("'response_format.json_schema.schema' must be a JSON schema object",
                          param="response_format.json_schema.schema", code="invalid_type")
    return {"type": "json_schema", "schema": schema, "name": inner.get("name")}
