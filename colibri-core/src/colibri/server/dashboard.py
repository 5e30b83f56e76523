"""The dashboard's static files (``colibri/server/static``, shipped in the wheel) and the routes that observe the
engine: ``GET /experts`` and ``GET /profile``.

The page, its script and its style are open (a browser navigating to ``/`` cannot send a bearer token); they hold
no data. Everything they show comes from the API, which the script calls with the key the page asks for. A strict
Content-Security-Policy keeps the page to its own origin: no external script, style, font, image or connection.
"""

from __future__ import annotations

from importlib import resources
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from .errors import APIError
from .observe import PROFILE_KEEP, experts_view

# path -> (file under static/, media type)
ASSETS = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/ui/dashboard.js": ("dashboard.js", "text/javascript; charset=utf-8"),
    "/ui/dashboard.css": ("dashboard.css", "text/css; charset=utf-8"),
}
OPEN_PATHS = tuple(ASSETS)
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
       "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
DEFAULT_PROFILE_N = 20


def asset_bytes(name: str) -> bytes:
    return resources.files("colibri.server").joinpath("static").joinpath(name).read_bytes()


async def asset(request: Request) -> Response:
    name, media_type = ASSETS[request.url.path]
    return Response(asset_bytes(name), media_type=media_type,
                    headers={"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff",
                             "Cache-Control": "no-cache", "Referrer-Policy": "no-referrer"})


async def experts(request: Request) -> JSONResponse:
    stats = await request.app.state.engine_stats.get()
    return JSONResponse(experts_view(stats))


async def profile(request: Request) -> JSONResponse:
    raw = request.query_params.get("n", str(DEFAULT_PROFILE_N))
    if not raw.isdigit() or not 1 <= int(raw) <= PROFILE_KEEP:
        raise APIError(400, f"'n' must be an integer from 1 to {PROFILE_KEEP}", param="n", code="invalid_value")
    app = request.app.state
    config, host, scheduler, metrics = app.config, app.host, app.services.scheduler, app.metrics
    body: dict[str, Any] = {
        "model": config.model_id, "family": config.family, "ctx": config.ctx,
        "engine": host.state, "slots": config.kv_slots, "slots_busy": scheduler.busy,
        "busy_slots": scheduler.busy_slots, "queued": scheduler.queued,
        "max_queue": config.max_queue, "disk": app.profile.disk.as_json(), "totals": metrics.summary(),
        "sequences": app.profile.count, "requests": app.profile.last(int(raw)),
    }
    return JSONResponse(body)
