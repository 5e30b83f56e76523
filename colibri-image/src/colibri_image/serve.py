"""``POST /v1/images/generations`` (OpenAI's shape) for ``coli serve`` on a pipeline (``server_routes``).

Each request waits for a place in the server's queue (``--kv-slots`` at once, ``--max-queue`` waiting), then runs
the pipeline's stages as fresh engine processes: an engine killed mid-generation fails that request with one clear
error and the next request starts new ones. With ``"stream": true`` the reply is SSE: one
``image_generation.progress`` event per denoising step, then ``image_generation.completed`` with the image. A
streaming client that disconnects cancels its generation: the running stage process is killed and the queue slot
released as soon as the generating thread returns.
"""

from __future__ import annotations

import asyncio
import base64
import secrets
import time
from typing import Any, Mapping

from colibri.errors import ColibriError
from colibri.records import ResolvedModel, RouteSpec

from .cli import open_pipeline
from .pipeline import Cancel, Request
from .png import encode_png

PATH = "/v1/images/generations"
MAX_PROMPT_CHARS = 16384


def _api_error(status: int, message: str, param: str | None = None, code: str | None = None) -> Exception:
    from colibri.server.errors import APIError

    return APIError(status, message, param=param, code=code)


def _field(body: Mapping[str, Any], name: str, kind: type | tuple[type, ...], default: Any = None) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, kind):
        raise _api_error(400, f"'{name}' must be {getattr(kind, '__name__', 'a number')}", param=name)
    return value


def parse_request(body: Mapping[str, Any], pipe: Any) -> tuple[Request, bool]:
    """The pipeline request of an OpenAI images body (``seed``, ``steps``, ``negative_prompt``, ``guidance``
    extensions), and whether to stream. Every refusal names its field."""
    prompt = _field(body, "prompt", str)
    if not prompt or len(prompt) > MAX_PROMPT_CHARS:
        raise _api_error(400, f"'prompt' must be a non-empty string of at most {MAX_PROMPT_CHARS} characters",
                         param="prompt")
    if _field(body, "n", int, 1) != 1:
        raise _api_error(400, "'n' must be 1 (one image per request)", param="n")
    if _field(body, "response_format", str, "b64_json") != "b64_json":
        raise _api_error(400, "'response_format' must be 'b64_json' (the server keeps no files to link to)",
                         param="response_format")
    size = _field(body, "size", str, "1024x1024")
    parts = size.lower().split("x") if size != "auto" else ["1024", "1024"]
    if len(parts) != 2 or not all(p.isdigit() and len(p) <= 5 for p in parts):
        raise _api_error(400, f"'size' {size!r} is not WIDTHxHEIGHT", param="size")
    seed = _field(body, "seed", int)
    guidance = _field(body, "guidance", (int, float))
    req = pipe.resolve(Request(prompt, width=int(parts[0]), height=int(parts[1]), steps=_field(body, "steps", int),
                               seed=seed if seed is not None else secrets.randbits(32),
                               negative_prompt=_field(body, "negative_prompt", str),
                               guidance=None if guidance is None else float(guidance)))
    if not 0 <= req.seed < 2 ** 63:
        raise _api_error(400, "'seed' must be between 0 and 2**63 - 1", param="seed")
    try:
        pipe.check(req)
    except ColibriError as exc:
        field = "steps" if "--steps" in exc.message else "size"
        raise _api_error(400, exc.message.replace("--size ", "size ").replace("--steps ", "steps "),
                         param=field) from None
    return req, bool(body.get("stream"))


def routes(model: ResolvedModel, options: Mapping[str, Any]) -> list[RouteSpec]:
    pipe = open_pipeline(model, options.get("threads"))   # builds the engine before the server listens

    async def generate(request: Any) -> Any:
        from starlette.responses import JSONResponse, StreamingResponse

        body = await request.app.state.read_json(request)
        req, stream = parse_request(body, pipe)
        lease = await request.app.state.services.scheduler.acquire(None)
        if not stream:
            try:
                image = await asyncio.to_thread(pipe.generate, req)
            except ColibriError as exc:
                raise _api_error(500, f"generation failed: {exc.message}", code="engine_error") from None
            finally:
                lease.release()
            return JSONResponse(_reply(req, image))
        return StreamingResponse(_events(pipe, req, lease), media_type="text/event-stream",
                                 headers={"cache-control": "no-cache", "x-accel-buffering": "no"})

    return [RouteSpec(PATH, generate, ("POST",), "images")]


def _reply(req: Request, image: Any) -> dict[str, Any]:
    return {"created": int(time.time()), "data": [{"b64_json": base64.b64encode(encode_png(image)).decode()}],
            "size": f"{req.width}x{req.height}", "output_format": "png", "seed": req.seed}


async def _events(pipe: Any, req: Request, lease: Any):
    from colibri.server.sse import event_frame

    loop = asyncio.get_running_loop()
    steps: asyncio.Queue = asyncio.Queue()

    def progress(done: int, total: int) -> None:
        loop.call_soon_threadsafe(steps.put_nowait, (done, total))

    cancel = Cancel()
    job = asyncio.ensure_future(asyncio.to_thread(pipe.generate, req, None, progress, cancel))
    try:
        while not job.done() or not steps.empty():
            getter = asyncio.ensure_future(steps.get())
            await asyncio.wait({getter, job}, return_when=asyncio.FIRST_COMPLETED)
            if getter.done():
                done, total = getter.result()
                yield event_frame("image_generation.progress", {"type": "image_generation.progress",
                                                                "step": done, "steps": total})
            else:
                getter.cancel()
        try:
            image = job.result()
        except ColibriError as exc:
            yield event_frame("error", {"type": "error", "error": {"message": f"generation failed: {exc.message}",
                                                                   "type": "server_error", "code": "engine_error"}})
            return
        yield event_frame("image_generation.completed", {"type": "image_generation.completed", **_reply(req, image)})
    finally:
        if job.done():
            lease.release()
        else:
            # The client went away mid-generation (the response task is being cancelled): kill the running stage so
            # its memory goes now, and give the slot back once the generating thread has seen that and returned.
            cancel.cancel()

            def release(finished: Any) -> None:
                if not finished.cancelled():
                    finished.exception()   # the EngineError of the cancelled run: expected, nobody to tell
                lease.release()

            job.add_done_callback(release)
