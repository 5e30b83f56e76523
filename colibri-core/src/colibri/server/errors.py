"""HTTP errors as the two API dialects spell them.

A route raises :class:`APIError`; the app renders it in OpenAI's envelope on ``/v1/*`` and in Anthropic's on
``/v1/messages``, so a client library of either kind parses our errors exactly as it parses the real service's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

# OpenAI-style `type` for each status we use; Anthropic has its own vocabulary (below).
_OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "request_too_large",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}


@dataclass
class APIError(Exception):
    """A request that cannot be served, with everything both envelopes need."""

    status: int
    message: str
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__init__(self.message)

    def openai_body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": _OPENAI_TYPES.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}

    def anthropic_body(self) -> dict[str, Any]:
        return {"type": "error", "error": {"type": anthropic_error_type(self.status), "message": self.message}}

    def body_for(self, dialect: str) -> bytes:
        body = self.anthropic_body() if dialect == "anthropic" else self.openai_body()
        return json.dumps(body).encode()


def anthropic_error_type(status: int) -> str:
    return _ANTHROPIC_TYPES.get(status, "api_error")


def dialect_of(path: str) -> str:
    """Which envelope a path's clients expect: Anthropic's for the Messages API, OpenAI's everywhere else."""
    return "anthropic" if path.rstrip("/").startswith("/v1/messages") else "openai"


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)
