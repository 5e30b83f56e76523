"""The hooks of a family whose models are not text generators: model_task, run_options, run_handler and
server_routes. A fake 'painter' family claims a directory with a painter.json; core runs and serves it without
knowing what it is."""

from __future__ import annotations

import inspect
from typing import Any, Optional

import pytest
from starlette.responses import JSONResponse
from starlette.testclient import TestClient
from typer.testing import CliRunner

from colibri import hookimpl, hooks, plugins
from colibri.cli import app
from colibri.cli.run import _with_family_options
from colibri.model import resolve_model
from colibri.records import TEXT_GENERATION, Claim, FamilyDescriptor, RouteSpec, RunOption
from colibri.server import ServerConfig, create_app
from colibri.server.errors import APIError


class Painter:
    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []

    @hookimpl
    def describe_family(self):
        return FamilyDescriptor("painter", ("painting",), "a non-text family")

    @hookimpl
    def detect_config(self, model_dir, config):
        return Claim("painter", "painting") if (model_dir / "painter.json").is_file() else None

    @hookimpl
    def model_task(self, model):
        return "text-to-image"

    @hookimpl
    def run_options(self):
        return [RunOption("--canvas", "the canvas", str, "WxH"), RunOption("--strokes", "how many", int)]

    @hookimpl
    def run_handler(self, model, prompt, options):
        self.calls.append((prompt, dict(options)))
        return 3 if prompt == "fail" else 0

    @hookimpl
    def server_routes(self, model, options):
        async def paint(request):
            body = await request.app.state.read_json(request)
            if not body.get("prompt"):
                raise APIError(400, "prompt is required", param="prompt")
            lease = await request.app.state.services.scheduler.acquire(None)
            try:
                return JSONResponse({"painted": body["prompt"], "threads": options.get("threads")})
            finally:
                lease.release()

        return [RouteSpec("/v1/paint", paint, ("POST",), "paint")]


@pytest.fixture
def painter(no_installed_plugins, tmp_path):
    family = Painter()
    plugins.register(family, "painter", package="colibri-core-tests", version="0")
    (tmp_path / "painter.json").write_text("{}")
    return family, resolve_model(tmp_path)


def test_hook_model_task(painter, olmoe_family, tiny_olmoe):
    _, model = painter
    assert hooks.model_task(model) == "text-to-image"
    assert hooks.model_task(resolve_model(tiny_olmoe.path)) == TEXT_GENERATION   # core's default


def test_hook_run_options(painter):
    names = [o.name for o in hooks.run_options()]
    assert names == ["canvas", "strokes"]

    def command(prompt: Optional[str] = None, **family: Any) -> None:
        return None

    params = inspect.signature(_with_family_options(command)).parameters
    assert list(params) == ["prompt", "canvas", "strokes"]
    assert params["strokes"].annotation == Optional[int]


def test_hook_run_handler(painter, monkeypatch):
    family, model = painter
    result = CliRunner().invoke(app, ["run", "--model", str(model.path), "a bird", "--seed", "4"])
    assert result.exit_code == 0, result.output
    prompt, options = family.calls[-1]
    assert prompt == "a bird" and options["seed"] == 4 and options["json"] is False
    result = CliRunner().invoke(app, ["run", "--model", str(model.path), "fail"])
    assert result.exit_code == 3


def test_a_family_flag_on_a_text_model_is_refused(olmoe_family, tiny_olmoe):
    from colibri.cli.run import run_command

    if "out" not in inspect.signature(run_command).parameters:
        pytest.skip("no installed family offers --out")
    result = CliRunner().invoke(app, ["run", "--model", str(tiny_olmoe.path), "hi", "--out", "x.png"])
    assert result.exit_code == 1 and "--out: not an option for" in result.output


def test_hook_server_routes(painter):
    _, model = painter
    routes = hooks.server_routes(model, {"threads": 2})
    config = ServerConfig(model_id="p", ctx=0, api_key="k", family="painter")
    with TestClient(create_app(config, None, None, family_routes=routes), base_url="http://127.0.0.1") as client:
        auth = {"Authorization": "Bearer k"}
        assert client.post("/v1/paint", json={"prompt": "sky"}).status_code == 401
        ok = client.post("/v1/paint", json={"prompt": "sky"}, headers=auth)
        assert ok.json() == {"painted": "sky", "threads": 2}
        bad = client.post("/v1/paint", json={}, headers=auth)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt"
        missing = client.post("/v1/chat/completions", json={}, headers=auth)
        assert missing.status_code == 404 and "/v1/paint" in missing.json()["error"]["message"]
        assert client.get("/health").json()["status"] == "ok"
