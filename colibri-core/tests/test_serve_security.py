"""coli serve's defences: API key, body limit, malformed and hostile input, CORS. Never a 500."""

from __future__ import annotations

import sys
from pathlib import Path

import json
import socket

import anthropic
import httpx
import openai
import pytest
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).parent))  # the harness beside this file (importlib mode)
from serve_harness import build_tokenizer_dir, start_server

KEY = "s3cret-key-for-tests"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tokenizer_dir(tmp_path_factory.mktemp("serve-sec") / "tiny-chat")


@pytest.fixture(scope="module")
def server(model_dir):
    running = start_server(model_dir, ctx=128, slots=1, api_key=KEY, max_body=64 * 1024)
    yield running
    running.stop()


HTTP = httpx.Client(timeout=30)   # one client: building one per request (SSL context and all) is slow


def post(server, path, body=None, key=KEY, content=None, headers=None):
    h = {"authorization": f"Bearer {key}"} if key else {}
    h.update(headers or {})
    return HTTP.post(server.base + path, json=body, content=content, headers=h)


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0}


def test_every_route_but_health_needs_the_key(server):
    assert httpx.get(server.base + "/health", timeout=10).status_code == 200
    for method, path in (("GET", "/v1/models"), ("GET", "/metrics"), ("POST", "/v1/chat/completions"),
                         ("POST", "/v1/completions"), ("POST", "/v1/messages"), ("GET", "/v1/models/m")):
        r = httpx.request(method, server.base + path, json=CHAT, timeout=10)
        assert r.status_code == 401, path
        wrong = httpx.request(method, server.base + path, json=CHAT, timeout=10,
                              headers={"authorization": "Bearer not-the-key", "x-api-key": "nope"})
        assert wrong.status_code == 401, path
    assert httpx.post(server.base + "/v1/chat/completions", json=CHAT, timeout=10).json()["error"]["type"] == \
        "authentication_error"
    anth = httpx.post(server.base + "/v1/messages", json=CHAT, timeout=10).json()
    assert anth["type"] == "error" and anth["error"]["type"] == "authentication_error"
    assert httpx.get(server.base + "/metrics", headers={"authorization": f"Bearer {KEY}"},
                     timeout=10).status_code == 200


def test_official_clients_authenticate(server):
    good = openai.OpenAI(base_url=server.base + "/v1", api_key=KEY, max_retries=0)
    assert good.chat.completions.create(**CHAT).choices[0].message.content is not None
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.base + "/v1", api_key="wrong", max_retries=0).models.list()
    claude = anthropic.Anthropic(base_url=server.base, api_key=KEY, max_retries=0)   # sends x-api-key
    assert claude.messages.create(model="m", max_tokens=3, messages=CHAT["messages"]).content[0].type == "text"
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server.base, api_key="wrong", max_retries=0).messages.create(
            model="m", max_tokens=3, messages=CHAT["messages"])


@pytest.mark.parametrize("body, param", [
    ({**CHAT, "n": 2}, "n"),
    ({**CHAT, "logit_bias": {"x": 10}}, "logit_bias.x"),
    ({**CHAT, "logit_bias": {"5": 101}}, "logit_bias.5"),
    ({**CHAT, "logit_bias": {"99999": 1}}, "logit_bias"),
    ({**CHAT, "min_p": 2}, "min_p"),
    ({**CHAT, "repetition_penalty": 0}, "repetition_penalty"),
    ({**CHAT, "top_logprobs": 3}, "top_logprobs"),
    ({**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({**CHAT, "messages": "hello"}, "messages"),
    ({**CHAT, "messages": []}, "messages"),
    ({**CHAT, "messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({**CHAT, "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content[0].type"),
    ({**CHAT, "messages": [{"role": "user", "content": "a\u0000b"}]}, "messages[0].content"),
    ({**CHAT, "stop": ["ok", "bad\u0000"]}, "stop[1]"),
    ({**CHAT, "temperature": "hot"}, "temperature"),
    ({**CHAT, "temperature": 7}, "temperature"),
    ({**CHAT, "max_tokens": -1}, "max_tokens"),
    ({**CHAT, "max_tokens": True}, "max_tokens"),
    ({**CHAT, "max_completion_tokens": "10"}, "max_completion_tokens"),
    ({**CHAT, "top_p": 0}, "top_p"),
    ({**CHAT, "seed": 1.5}, "seed"),
    ({**CHAT, "stop": 5}, "stop"),
    ({**CHAT, "stream": "yes"}, "stream"),
    ({**CHAT, "stream_options": {"include_usage": True}}, "stream_options"),
    ({**CHAT, "presence_penalty": 3.0}, "presence_penalty"),
    ({**CHAT, "frequency_penalty": -2.5}, "frequency_penalty"),
    ({**CHAT, "response_format": {"type": "xml"}}, "response_format.type"),
    ({**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}},
     "response_format"),
    ({**CHAT, "user": ["x"]}, "user"),
    ({k: v for k, v in CHAT.items() if k != "messages"}, "messages"),
])
def test_bad_chat_fields_are_400_naming_the_field(server, body, param):
    r = post(server, "/v1/chat/completions", body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert error["message"]


@pytest.mark.parametrize("body, param", [
    ({"model": "m", "messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x\u0000"}]}, "messages[0].content"),
    ({"model": "m", "max_tokens": 5, "system": 3, "messages": [{"role": "user", "content": "x"}]}, "system"),
    ({"model": "m", "max_tokens": 5, "stop_sequences": "STOP", "messages": [{"role": "user", "content": "x"}]},
     "stop_sequences"),
])
def test_bad_messages_fields_are_400_in_anthropic_shape(server, body, param):
    r = post(server, "/v1/messages", body)
    assert r.status_code == 400
    payload = r.json()
    assert payload["type"] == "error" and payload["error"]["type"] == "invalid_request_error"
    assert param in payload["error"]["message"]


@pytest.mark.parametrize("content", [b"{not json", b"", b"[1, 2]", b"null", b'{"a": NaN}', b"\xff\xfe{}",
                                     b'{"messages": [' * 2000 + b"1" + b"]}" * 2000],
                         ids=["broken", "empty", "array", "null", "nan", "not-utf8", "deeply-nested"])
def test_malformed_bodies_are_400(server, content):
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/messages"):
        r = post(server, path, content=content, headers={"content-type": "application/json"})
        assert r.status_code == 400, (path, content[:20], r.status_code)


def test_bodies_over_the_limit_are_413(server):
    big = json.dumps({**CHAT, "messages": [{"role": "user", "content": "x" * (10 * 1024 * 1024)}]}).encode()
    r = post(server, "/v1/chat/completions", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    r = post(server, "/v1/messages", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"

    def chunked():
        yield b'{"messages": [{"role": "user", "content": "'
        for _ in range(200):
            yield b"y" * 1024
        yield b'"}]}'
    r = httpx.post(server.base + "/v1/chat/completions", content=chunked(), timeout=30,
                   headers={"authorization": f"Bearer {KEY}", "content-type": "application/json"})
    assert r.status_code == 413
    assert post(server, "/v1/chat/completions", CHAT).status_code == 200   # and the server is still fine


def test_unknown_routes_and_methods_answer_in_json(server):
    r = httpx.get(server.base + "/v1/nothing", headers={"authorization": f"Bearer {KEY}"}, timeout=10)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = httpx.get(server.base + "/v1/chat/completions", headers={"authorization": f"Bearer {KEY}"}, timeout=10)
    assert r.status_code == 405 and "error" in r.json()


def test_fuzzed_field_types_never_cause_a_500(server):
    values = [True, -1, 2**70, 1e308, "x", [1], {"a": 1}, [{"type": "text"}]]
    fields = ["model", "messages", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream", "n",
              "user", "cache_slot", "stream_options", "logprobs", "tools", "max_completion_tokens", "min_p",
              "logit_bias", "repetition_penalty", "response_format", "top_logprobs"]
    for field in fields:
        for value in values:
            r = post(server, "/v1/chat/completions", {**CHAT, "max_tokens": 1, field: value})
            assert r.status_code in (200, 400), (field, value, r.status_code, r.text)
            m = post(server, "/v1/messages", {"model": "m", "max_tokens": 1, "messages": CHAT["messages"],
                                              field: value})
            assert m.status_code in (200, 400), (field, value, m.status_code, m.text)
    for field in ("prompt", "echo", "suffix", "best_of", "stop", "max_tokens", "logprobs"):
        for value in values:
            c = post(server, "/v1/completions", {"model": "m", "prompt": "x", "max_tokens": 1, field: value})
            assert c.status_code in (200, 400), (field, value, c.status_code, c.text)


def test_cors_is_off_by_default_and_on_when_asked(server, model_dir):
    r = httpx.options(server.base + "/v1/chat/completions", timeout=10,
                      headers={"origin": "http://evil.example", "access-control-request-method": "POST"})
    assert "access-control-allow-origin" not in r.headers
    cors = start_server(model_dir, ctx=64, slots=1, cors=("http://app.example",))
    try:
        r = httpx.options(cors.base + "/v1/chat/completions", timeout=10,
                          headers={"origin": "http://app.example", "access-control-request-method": "POST",
                                   "access-control-request-headers": "authorization,content-type"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://app.example"
        r = httpx.options(cors.base + "/v1/chat/completions", timeout=10,
                          headers={"origin": "http://evil.example", "access-control-request-method": "POST"})
        assert r.headers.get("access-control-allow-origin") != "http://evil.example"
    finally:
        cors.stop()


def test_cli_refuses_a_public_bind_without_a_key(monkeypatch):
    from colibri.cli import app

    monkeypatch.delenv("COLI_API_KEY", raising=False)
    result = CliRunner().invoke(app, ["serve", "--host", "0.0.0.0", "--model", "/nonexistent"])
    assert result.exit_code == 1
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "--host 0.0.0.0" in lines[0] and "--api-key" in lines[0]


def test_cli_refuses_a_taken_port():
    from colibri.cli.serve import bind_socket
    from colibri.errors import UsageError

    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen(1)
    try:
        with pytest.raises(UsageError, match="cannot bind"):
            bind_socket("127.0.0.1", holder.getsockname()[1])
    finally:
        holder.close()
