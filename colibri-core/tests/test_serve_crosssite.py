"""coli serve refuses what a foreign web page could make a browser send (simple cross-site POSTs, foreign Origins,
DNS-rebound Host names), keeps serving allowed origins, and answers a lone surrogate with a 400 naming the field."""

from __future__ import annotations

import sys
from pathlib import Path

import json

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parent))  # the harness beside this file (importlib mode)
from serve_harness import start_server, tokenizer_dir_fixture

from colibri.server.crosssite import CrossSitePolicy, split_host

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}
EVIL = "http://evil.example"


model_dir = tokenizer_dir_fixture("serve-xsite")


@pytest.fixture(scope="module")
def server(model_dir):
    running = start_server(model_dir, ctx=128, slots=1, cors=("http://app.example",),
                           allowed_hosts=("colibri.lan", ".corp.example"))
    yield running
    running.stop()


HTTP = httpx.Client(timeout=30)


def started(server) -> int:
    return server.app.state.metrics.started


@pytest.mark.parametrize("kind, content, headers", [
    ("text/plain", json.dumps(CHAT), {"content-type": "text/plain"}),
    ("form", "messages=hi&max_tokens=2", {"content-type": "application/x-www-form-urlencoded"}),
    ("multipart", '--b\r\ncontent-disposition: form-data; name="x"\r\n\r\n' + json.dumps(CHAT) + "\r\n--b--\r\n",
     {"content-type": "multipart/form-data; boundary=b"}),
])
def test_cross_site_simple_requests_are_refused_and_run_nothing(server, kind, content, headers):
    before = started(server)
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/messages"):
        r = HTTP.post(server.base + path, content=content, headers={**headers, "origin": EVIL})
        assert r.status_code == 403, (kind, path, r.status_code, r.text)
        message = r.json()["error"]["message"]
        assert "evil.example" in message and "--cors-origin" in message
        assert "access-control-allow-origin" not in r.headers
        # without an Origin (curl, scripts), the content type alone refuses it, naming the header
        r = HTTP.post(server.base + path, content=content, headers=headers)
        assert r.status_code == 415, (kind, path, r.status_code)
        if path != "/v1/messages":
            assert r.json()["error"]["param"] == "content-type"
        assert "content-type" in r.json()["error"]["message"]
    assert started(server) == before


def test_json_needs_its_content_type_and_a_charset_is_fine(server):
    r = HTTP.post(server.base + "/v1/chat/completions", content=json.dumps(CHAT))   # no content-type at all
    assert r.status_code == 415 and "missing content-type" in r.json()["error"]["message"]
    r = HTTP.post(server.base + "/v1/chat/completions", content=json.dumps(CHAT),
                  headers={"content-type": "Application/JSON; charset=utf-8"})
    assert r.status_code == 200


def test_foreign_origins_are_refused_even_with_json_and_allowed_ones_keep_cors(server):
    r = HTTP.post(server.base + "/v1/chat/completions", json=CHAT, headers={"origin": EVIL})
    assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed"
    r = HTTP.get(server.base + "/v1/models", headers={"origin": "null"})
    assert r.status_code == 403
    r = HTTP.post(server.base + "/v1/chat/completions", json=CHAT, headers={"origin": "http://app.example"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://app.example"
    preflight = HTTP.options(server.base + "/v1/chat/completions", headers={
        "origin": "http://app.example", "access-control-request-method": "POST",
        "access-control-request-headers": "content-type"})
    assert preflight.status_code == 200
    # a page this server itself served (same scheme://host:port) is not foreign
    r = HTTP.post(server.base + "/v1/chat/completions", json=CHAT, headers={"origin": server.base})
    assert r.status_code == 200


@pytest.mark.parametrize("host, allowed", [
    ("evil.example", False), ("rebind.attacker.test:8000", False), ("evilcorp.example", False),
    ("localhost", True), ("LOCALHOST.", True), ("app.localhost", True), ("127.0.0.1", True), ("[::1]", True),
    ("10.1.2.3", True), ("colibri.lan", True), ("a.corp.example", True), ("corp.example", True),
])
def test_host_header_is_checked_against_the_bound_names(server, host, allowed):
    port = server.base.rsplit(":", 1)[1]
    name = host if ":" in host.strip("[]") and not host.startswith("[") else f"{host}:{port}"
    for method, path in (("GET", "/v1/models"), ("POST", "/v1/chat/completions"), ("POST", "/v1/messages"),
                         ("GET", "/health")):
        r = HTTP.request(method, server.base + path, json=CHAT, headers={"host": name})
        if allowed:
            assert r.status_code == 200, (host, path, r.text)
        else:
            assert r.status_code == 403, (host, path, r.status_code)
            assert "--allowed-host" in r.text


def test_policy_units():
    assert split_host("Example.COM:8000") == "example.com" and split_host("[::1]:80") == "::1"
    assert split_host("::1") == "::1" and split_host("host.") == "host"
    everything = CrossSitePolicy("127.0.0.1", ["*"], ["*"])
    everything.check("POST", "/v1/models", {"host": "anything.example", "origin": EVIL})
    named = CrossSitePolicy("box.internal", [], [])
    assert named.host_allowed("box.internal") and not named.host_allowed("other.internal")


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "a\ud800b"}]}, "messages[0].content"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]},
     "messages[0].content[0].text"),
    ("/v1/chat/completions", {**CHAT, "stop": ["x\ud800"]}, "stop[0]"),
    ("/v1/chat/completions", {**CHAT, "user": "\ud800"}, "user"),
    ("/v1/completions", {"model": "m", "prompt": "lone \ud800 here", "max_tokens": 2}, "prompt"),
    ("/v1/messages", {"model": "m", "max_tokens": 2, "system": "s\udc00",
                      "messages": [{"role": "user", "content": "x"}]}, "system"),
    ("/v1/messages", {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "\ud800"}]},
     "messages[0].content"),
])
def test_a_lone_surrogate_is_a_400_naming_the_field(server, path, body, param):
    raw = json.dumps(body)   # ensure_ascii: the surrogate travels as the escape \ud800, as a client would send it
    assert "\\ud" in raw or "\\udc" in raw
    r = HTTP.post(server.base + path, content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert "surrogate" in error["message"] and param in error["message"]
    if path != "/v1/messages":
        assert error["param"] == param
    paired = json.dumps({**CHAT, "messages": [{"role": "user", "content": "\U0001F600"}]})   # a valid pair is fine
    assert HTTP.post(server.base + "/v1/chat/completions", content=paired,
                     headers={"content-type": "application/json"}).status_code == 200
