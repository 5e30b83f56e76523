"""``tool_choice: required`` / a named function on an untrained model: with each tool-calling family's real chat
template over a tiny random-weight model on its real engine, the constrained reply is always one well-formed call
to a listed function, which the ``openai`` and ``anthropic`` clients receive as a structured tool call."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import anthropic
import openai
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "colibri-core" / "tests"))  # core's harnesses
from family_syntax import FAMILIES
from serve_harness import start_server

pytest.importorskip("llguidance")

CTX = 1024
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather for a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 12}, "days": {"type": "integer", "minimum": 1, "maximum": 14},
            "units": {"enum": ["metric", "imperial"]}}, "required": ["city", "days"]}}},
    {"type": "function", "function": {
        "name": "search", "description": "Search the web",
        "parameters": {"type": "object", "properties": {"query": {"type": "string", "maxLength": 16}},
                       "required": ["query"]}}},
]
USER = [{"role": "user", "content": "Weather in Köln for 3 days?"}]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def served(request, tiny_root, tmp_path_factory):
    """The family's tiny random model, its chat template replaced by the family's real one (tools and all)."""
    family = FAMILIES[request.param]
    pytest.importorskip(family.package)
    from colibri import hooks, launch
    from colibri.model import resolve_model
    from colibri.server.codec import TokenizerCodec
    from colibri.testing.tiny import tiny_model

    directory = tmp_path_factory.mktemp(request.param) / "model"
    shutil.copytree(tiny_model(family.tiny_kind, tiny_root).path, directory)
    (directory / "chat_template.jinja").write_text(family.template, encoding="utf-8")
    model = resolve_model(str(directory))
    codec = TokenizerCodec(hooks.load_tokenizer(model), model=model)
    assert codec.tools_supported
    server = start_server(directory, ctx=CTX, codec=codec,
                          factory=lambda: launch.open_engine(model, ctx=CTX, slots=1, threads=1))
    yield family, server
    server.stop()


def check_call(name: str, arguments: dict) -> None:
    function = next(t["function"] for t in TOOLS if t["function"]["name"] == name)
    params = function["parameters"]
    assert set(params["required"]) <= set(arguments) <= set(params["properties"]), arguments
    if name == "get_weather":
        assert isinstance(arguments["city"], str) and 1 <= arguments["days"] <= 14
        assert arguments.get("units", "metric") in ("metric", "imperial")


def test_required_makes_an_untrained_model_call_a_listed_function(served):
    family, server = served
    client = openai.OpenAI(base_url=server.base + "/v1", api_key="x", max_retries=0, timeout=120)
    for seed in (1, 2, 3):
        reply = client.chat.completions.create(model="m", messages=USER, tools=TOOLS, tool_choice="required",
                                               temperature=1.0, seed=seed, max_tokens=300)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls", (family.name, choice)
        [call] = choice.message.tool_calls
        check_call(call.function.name, json.loads(call.function.arguments))


def test_a_named_function_is_the_one_called_streamed_too(served):
    family, server = served
    client = openai.OpenAI(base_url=server.base + "/v1", api_key="x", max_retries=0, timeout=120)
    named = {"type": "function", "function": {"name": "search"}}
    stream = client.chat.completions.create(model="m", messages=USER, tools=TOOLS, tool_choice=named,
                                            temperature=1.0, seed=7, max_tokens=300, stream=True)
    calls = [c for chunk in stream if chunk.choices for c in chunk.choices[0].delta.tool_calls or []]
    assert [c.function.name for c in calls] == ["search"], family.name
    check_call("search", json.loads(calls[0].function.arguments))
    claude = anthropic.Anthropic(base_url=server.base, api_key="x", max_retries=0)
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in TOOLS]
    message = claude.messages.create(model="m", max_tokens=300, messages=USER, tools=tools,
                                     tool_choice={"type": "tool", "name": "get_weather"})
    [use] = [b for b in message.content if b.type == "tool_use"]
    assert use.name == "get_weather" and message.stop_reason == "tool_use"
    check_call("get_weather", use.input)


def test_a_function_not_listed_is_refused_by_name(served):
    _, server = served
    client = openai.OpenAI(base_url=server.base + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="m", messages=USER, tools=TOOLS,
                                       tool_choice={"type": "function", "function": {"name": "nope"}})
    assert err.value.body["param"] == "tool_choice.function.name"
