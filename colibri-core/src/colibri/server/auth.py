"""API-key checking, in constant time, on every route except ``/health`` and the dashboard's static files.

OpenAI clients send ``Authorization: Bearer KEY``; Anthropic clients send ``x-api-key: KEY`` (Bearer is accepted
there too). CORS preflights (``OPTIONS``) carry no credentials by design and are answered by the CORS layer.
"""

from __future__ import annotations

import hmac

from .dashboard import OPEN_PATHS as PAGE_PATHS
from .errors import APIError, dialect_of

OPEN_PATHS = ("/health", *PAGE_PATHS)   # the dashboard's page and assets hold no data; its API calls send the key


def presented_key(headers: dict[str, str], path: str) -> str | None:
    auth = headers.get("authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip()
    if dialect_of(path) == "anthropic":
        return headers.get("x-api-key")
    return None


def check_key(expected: str | None, headers: dict[str, str], path: str) -> None:
    """Raise 401 unless ``expected`` is unset or the request presents it."""
    if not expected or path in OPEN_PATHS:
        return
    given = presented_key(headers, path)
    if given is None:
        how = "an x-api-key header" if dialect_of(path) == "anthropic" else "an 'Authorization: Bearer' header"
        raise APIError(401, f"missing API key: send it in {how}", code="missing_api_key")
    # compare_digest on bytes: constant time for equal lengths, and no early exit on the first differing byte
    if not hmac.compare_digest(given.encode("utf-8", "surrogateescape"), expected.encode("utf-8")):
        raise APIError(401, "invalid API key", code="invalid_api_key")
