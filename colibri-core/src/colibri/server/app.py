"""The ASGI application: routes, the key gate, body limits, CORS, and one error envelope per dialect.

Layering, outermost first: CORS (only with ``--cors-origin``; answers preflights) → the gate (Host, Origin and
content type as :mod:`.crosssite` rules them, API key, declared body size) → the router. Every route's failure is
an :class:`APIError` rendered in the envelope its clients parse (OpenAI's, or Anthropic's on ``/v1/messages``); an
unexpected exception is logged and answered with a 500 in the same envelope, never a bare traceback.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any, cast

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from . import anthropic_routes, dashboard, openai_routes, responses_routes, systemone
from .access_log import AccessLog, note
from .auth import check_key
from .config import ServerConfig
from .connections import install_fd_exhaustion_log
from .crosssite import CrossSitePolicy
from .engine_host import EngineHost, EngineLike, FamilyHost
from .errors import APIError, dialect_of
from .generation import Codec, Services
from .metrics import Metrics
from ..records import RouteSpec
from .observe import DiskBound, EngineStats, Profile
from .scheduler import SlotScheduler
from .validation import parse_json_body

log = logging.getLogger("colibri.server")


def error_response(error: APIError, path: str) -> Response:
    return Response(error.body_for(dialect_of(path)), status_code=error.status, media_type="application/json",
                    headers=error.headers)


async def read_limited_body(request: Request, limit: int, timeout: float) -> bytes:
    """The body, refusing (413) past ``limit`` bytes without buffering more than that, and (408) when it has not
    all arrived within ``timeout`` seconds."""
    too_large = APIError(413, f"request body exceeds the {limit}-byte limit (--max-body)", code="request_too_large")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    async for message in _body_messages(request.receive, timeout):
        if message["type"] == "http.disconnect":
            raise APIError(400, "client disconnected while sending the body", code="client_disconnected")
        size += len(message.get("body", b""))
        if size > limit:
            raise too_large
        chunks.append(message.get("body", b""))
    return b"".join(chunks)


async def _body_messages(receive, timeout: float):
    """The body's ``receive`` messages until the last one (or a disconnect), all within ``timeout`` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        pending = asyncio.ensure_future(receive())
        done, _ = await asyncio.wait({pending}, timeout=max(0.0, deadline - loop.time()))
        if not done:
            pending.cancel()
            raise APIError(408, f"the request body did not arrive within {timeout:g} s (--body-timeout)",
                           code="request_timeout", headers={"Connection": "close"})
        message = pending.result()
        yield message
        if message["type"] != "http.request" or not message.get("more_body"):
            return


def _endpoint(route: str, handler: Callable[[Request], Awaitable[Any]]):
    """Wrap a route: APIError → its envelope; anything unexpected → logged 500; count every response."""

    async def endpoint(request: Request):
        metrics: Metrics = request.app.state.metrics
        note(route=route)
        try:
            response = await handler(request)
        except APIError as error:
            if error.status in (413, 429, 503):
                metrics.rejected(error.code or str(error.status))
            response = error_response(error, request.url.path)
        except Exception:
            log.exception("unexpected error serving %s", request.url.path)
            response = error_response(APIError(500, "internal server error; see the server log",
                                               code="internal_error"), request.url.path)
        metrics.count_response(route, getattr(response, "status_code", 200))
        return response

    return endpoint


class Gate:
    """ASGI middleware: the cross-site rules, the API key on every route but /health, and an early 413 on a
    declared oversize body."""

    def __init__(self, app, config: ServerConfig):
        self.app = app
        self.config = config
        self.policy = CrossSitePolicy(config.host, config.allowed_hosts, config.cors_origins)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] == "OPTIONS":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        path = scope["path"]
        try:
            self.policy.check(scope["method"], path, headers)
            check_key(self.config.api_key, headers, path)
            declared = headers.get("content-length", "")
            if declared.isdigit() and int(declared) > self.config.max_body:
                raise APIError(413, f"request body exceeds the {self.config.max_body}-byte limit (--max-body)",
                               code="request_too_large")
        except APIError as error:
            await _drain(receive, self.config.max_body, self.config.body_timeout)
            await error_response(error, path)(scope, receive, send)
            return
        await self.app(scope, receive, send)


class LossyLabel:
    """ASGI middleware: with opt-in lossy routing (--experts-k / --experts-top-p), every response says so in an
    ``X-Colibri-Lossy`` header, so no client can mistake its text for the model's own."""

    def __init__(self, app, label: str):
        self.app = app
        self.header = (b"x-colibri-lossy", label.encode("latin-1"))

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def labelled(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)

        await self.app(scope, receive, labelled)


async def _drain(receive, limit: int, timeout: float) -> None:
    """Read (and drop) a bounded part of the body first: closing on unread data makes the kernel send a reset,
    which can destroy the error response before the client reads it."""
    budget = max(16 * 1024 * 1024, 2 * limit)
    try:
        async for message in _body_messages(receive, timeout):
            budget -= len(message.get("body", b""))
            if budget <= 0:
                return
    except APIError:   # too slow: answer anyway
        return


def create_app(config: ServerConfig, engine_factory: Callable[[], EngineLike] | None, codec: Codec | None,
               on_fatal: Callable[[str], None] | None = None, tools_supported: bool = False,
               default_sampling: Mapping[str, float] | None = None,
               family_routes: Sequence[RouteSpec] = ()) -> Starlette:
    """Build the app; the engine starts loading when the app starts (``/health`` is 503 until it is ready).

    ``family_routes`` (a non-text model's ``server_routes``) replace the text routes; their family starts its own
    engine per request, so ``engine_factory`` and ``codec`` are ``None`` then.
    """
    metrics = Metrics()
    host = EngineHost(engine_factory, on_fatal=on_fatal) if engine_factory is not None else FamilyHost()
    scheduler = SlotScheduler(config.kv_slots, config.max_queue, config.queue_timeout)
    profile = Profile(DiskBound(config.disk_bandwidth, config.disk_bandwidth_source, config.routed_bytes_per_token))
    services = Services(host=cast(EngineHost, host), scheduler=scheduler, codec=cast(Codec, codec),
                        metrics=metrics, ctx=config.ctx,
                        queue_timeout=config.queue_timeout, default_sampling=dict(default_sampling or {}),
                        profile=profile)

    async def health(request: Request) -> JSONResponse:
        body: dict[str, Any] = {"status": "ok" if host.ready else host.state, "model": config.model_id}
        if host.ready:
            body.update(slots=config.kv_slots, slots_busy=scheduler.busy, queued=scheduler.queued,
                        restarts=host.restarts)
        else:
            body["detail"] = host.detail or ("loading the model" if host.state == "loading" else host.state)
        return JSONResponse(body, status_code=200 if host.ready else 503)

    async def metrics_route(request: Request) -> PlainTextResponse:
        gauges = {
            "queue_depth": ("requests waiting for a KV slot", scheduler.queued),
            "slots_busy": ("KV slots holding a running sequence", scheduler.busy),
            "slots_total": ("KV slots (--kv-slots)", config.kv_slots),
            "engine_up": ("1 when the engine is loaded and serving", 1 if host.ready else 0),
            "engine_restarts": ("times the engine was restarted after dying", host.restarts),
            "decode_disk_bound_share": ("decode speed of the latest sequence as a share of the disk bound at its "
                                        "hit rate (NaN: bound unknown, run coli tune)", profile.latest_share()),
        }
        return PlainTextResponse(metrics.render(gauges), media_type="text/plain; version=0.0.4")

    async def read_json(request: Request) -> dict:
        return parse_json_body(await read_limited_body(request, config.max_body, config.body_timeout))

    routes = [
        Route("/health", _endpoint("health", health), methods=["GET"]),
        Route("/metrics", _endpoint("metrics", metrics_route), methods=["GET"]),
        Route("/v1/models", _endpoint("models", openai_routes.list_models), methods=["GET"]),
        Route("/v1/models/{model_id:path}", _endpoint("models", openai_routes.get_model), methods=["GET"]),
    ]
    if family_routes:
        routes += [Route(r.path, _endpoint(r.name or r.path, r.handler), methods=list(r.methods))
                   for r in family_routes]
    else:
        routes += [
            Route("/v1/chat/completions", _endpoint("chat", openai_routes.chat_completions), methods=["POST"]),
            Route("/v1/completions", _endpoint("completions", openai_routes.completions), methods=["POST"]),
            Route("/v1/messages", _endpoint("messages", anthropic_routes.messages), methods=["POST"]),
            Route("/v1/messages/count_tokens", _endpoint("count_tokens", anthropic_routes.count_tokens),
                  methods=["POST"]),
            Route("/v1/responses", _endpoint("responses", responses_routes.responses), methods=["POST"]),
            Route("/v1/systemone", _endpoint("systemone", systemone.systemone), methods=["POST"]),
            Route("/experts", _endpoint("experts", dashboard.experts), methods=["GET"]),
            Route("/profile", _endpoint("profile", dashboard.profile), methods=["GET"]),
            *(Route(path, _endpoint("dashboard", dashboard.asset), methods=["GET"]) for path in dashboard.ASSETS),
        ]
    served = ", ".join([r.path for r in family_routes] or [
        "/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages", "/v1/systemone", "/experts",
        "/profile", "/ (the dashboard)"])

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)   # registered for HTTPException only
        if exc.status_code == 405:
            error = APIError(405, f"method {request.method} is not allowed on {request.url.path}",
                             code="method_not_allowed")
        elif exc.status_code == 404:
            error = APIError(404, f"no route {request.url.path}; see /v1/models, {served}, /health, /metrics",
                             code="not_found")
        else:
            error = APIError(exc.status_code, str(exc.detail), code="http_error")
        return error_response(error, request.url.path)

    @asynccontextmanager
    async def lifespan(app: Starlette):
        install_fd_exhaustion_log(asyncio.get_running_loop())
        host.start()
        try:
            yield
        finally:
            await host.close()

    middleware = [Middleware(AccessLog, metrics=metrics)]
    if config.cors_origins:
        middleware.append(Middleware(CORSMiddleware, allow_origins=list(config.cors_origins),
                                     allow_methods=["GET", "POST", "OPTIONS"],
                                     allow_headers=["authorization", "content-type", "x-api-key",
                                                    "anthropic-version", "openai-organization"]))
    middleware.append(Middleware(Gate, config=config))
    if config.lossy:
        middleware.append(Middleware(LossyLabel, label=config.lossy))
    app = Starlette(routes=routes, middleware=middleware, lifespan=lifespan,
                    exception_handlers={HTTPException: http_error})
    app.state.config = config
    app.state.services = services
    app.state.metrics = metrics
    app.state.host = host
    app.state.profile = profile
    app.state.engine_stats = EngineStats(cast(EngineHost, host), profile)
    app.state.read_json = read_json
    # counting tokens takes no KV slot, so it has its own bound: as many prompts in the tokenizer as there are slots
    app.state.tokenizer_gate = asyncio.Semaphore(config.kv_slots)
    # a codec built with the resolved model knows whether its family parses tool calls
    app.state.tools_supported = tools_supported or bool(getattr(codec, "tools_supported", False))
    app.state.started = time.time()
    return app
