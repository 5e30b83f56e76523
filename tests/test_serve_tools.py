"""Tool calls and reasoning through ``coli serve``'s app, for each tool-calling family: the engine is made to
write the family's real syntax by teacher forcing (the protocol's ``forced`` ids; the protocol fake engine emits
them), and the official ``openai`` and ``anthropic`` clients must receive structured tool calls and reasoning,
streamed and not. A two-step tool loop's second prompt must be the tokens of transformers' own rendering."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import anthropic
import openai
import pytest

from colibri.records import ResolvedModel
from colibri.server.codec import TokenizerCodec

sys.path.insert(0, str(Path(__file__).parent))   # family_syntax beside this file (importlib mode)
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "colibri-core" / "tests"))  # core's serve harness
from family_syntax import FAMILIES, TOOLS
from forcing_server import ANTHROPIC_TOOLS, USER, ForcingEngine, force, template_server

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def served(request, tmp_path_factory):
    forced = template_server(request.param, tmp_path_factory)
    yield forced.family, forced.server, forced.directory
    forced.server.stop()


def thinking_options(family, sample) -> dict:
    return {"chat_template_kwargs": {family.thinking_switch: True}} if sample.in_reasoning and \
        family.thinking_switch else {}


def tool_samples(family):
    return [s for s in family.samples if s.calls]


def expected_calls(sample):
    return [(name, args) for name, args, _ in sample.calls]


def test_openai_tool_calls_and_reasoning(served):
    family, server, _ = served
    client = openai.OpenAI(base_url=server.base + "/v1", api_key="x", max_retries=0)
    for sample in tool_samples(family):
        force(server, sample.text)
        reply = client.chat.completions.create(model="m", messages=USER, tools=TOOLS, temperature=0,
                                               extra_body=thinking_options(family, sample))
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls"
        message = choice.message
        assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == \
            expected_calls(sample)
        assert (message.content or "") == sample.content
        assert (getattr(message, "reasoning_content", None) or "") == sample.reasoning
        if family.name == "kimi":
            assert [c.id for c in message.tool_calls] == [i for _, _, i in sample.calls]

        stream = client.chat.completions.create(model="m", messages=USER, tools=TOOLS, temperature=0,
                                                stream=True, extra_body=thinking_options(family, sample))
        content, reasoning, calls, finish = "", "", {}, None
        for chunk in stream:
            delta = chunk.choices[0].delta
            content += delta.content or ""
            reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
            for call in delta.tool_calls or []:
                entry = calls.setdefault(call.index, {"name": "", "arguments": "", "id": call.id})
                entry["name"] += call.function.name or ""
                entry["arguments"] += call.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
        assert finish == "tool_calls"
        assert (content, reasoning) == (sample.content, sample.reasoning)
        assert [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())] == expected_calls(sample)
        assert all(c["id"] for c in calls.values())


def test_reasoning_never_reaches_content(served):
    family, server, _ = served
    client = openai.OpenAI(base_url=server.base + "/v1", api_key="x", max_retries=0)
    force(server, "<think>secret plan</think>The answer.")
    reply = client.chat.completions.create(model="m", messages=USER, temperature=0)
    assert reply.choices[0].message.content == "The answer."
    assert reply.choices[0].message.reasoning_content == "secret plan"
    assert reply.choices[0].finish_reason == "stop"
    pieces = [c.choices[0].delta for c in client.chat.completions.create(
        model="m", messages=USER, temperature=0, stream=True)]
    assert "".join(p.content or "" for p in pieces) == "The answer."
    assert "".join((p.model_extra or {}).get("reasoning_content") or "" for p in pieces) == "secret plan"


def test_anthropic_tool_use_and_thinking(served):
    family, server, _ = served
    client = anthropic.Anthropic(base_url=server.base, api_key="x", max_retries=0)
    for sample in tool_samples(family):
        force(server, sample.text)
        extra = {"thinking": {"type": "enabled", "budget_tokens": 1024}} if sample.in_reasoning and \
            family.thinking_switch else {}
        reply = client.messages.create(model="m", max_tokens=2048, messages=USER, tools=ANTHROPIC_TOOLS, **extra)
        with client.messages.stream(model="m", max_tokens=2048, messages=USER, tools=ANTHROPIC_TOOLS,
                                    **extra) as stream:
            streamed = stream.get_final_message()
        for message in (reply, streamed):
            assert message.stop_reason == "tool_use"
            uses = [(b.name, b.input) for b in message.content if b.type == "tool_use"]
            assert uses == expected_calls(sample)
            assert "".join(b.text for b in message.content if b.type == "text") == sample.content
            assert "".join(b.thinking for b in message.content if b.type == "thinking") == sample.reasoning


def test_two_step_tool_loop_renders_as_transformers(served):
    family, server, directory = served
    hf = transformers.AutoTokenizer.from_pretrained(str(directory))
    client = openai.OpenAI(base_url=server.base + "/v1", api_key="x", max_retries=0)
    sample = tool_samples(family)[0]
    force(server, sample.text)
    first = client.chat.completions.create(model="m", messages=USER, tools=TOOLS, temperature=0,
                                           extra_body=thinking_options(family, sample)).choices[0].message
    assistant = first.model_dump(exclude_none=True)
    results = [{"role": "tool", "tool_call_id": c.id, "content": json.dumps({"ok": i})}
               for i, c in enumerate(first.tool_calls)]
    force(server, ("Done.</think>" if sample.in_reasoning else "") + "It is sunny.")   # the prompt opened <think>
    ForcingEngine.prompts.clear()
    second = client.chat.completions.create(model="m", messages=USER + [assistant] + results, tools=TOOLS,
                                            temperature=0, extra_body=thinking_options(family, sample))
    assert second.choices[0].message.content == "It is sunny."
    # what transformers renders for the same conversation (arguments as objects, as vLLM passes them)
    rendered_assistant = {**assistant, "content": assistant.get("content") or "", "tool_calls": [
        {**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
        for c in assistant["tool_calls"]]}
    rendered_assistant.pop("refusal", None)
    kwargs = thinking_options(family, sample).get("chat_template_kwargs", {})
    want = hf.apply_chat_template(USER + [rendered_assistant] + results, tools=TOOLS, tokenize=False,
                                  add_generation_prompt=True, **kwargs)
    assert ForcingEngine.prompts == [server.codec.encode(want, add_special_tokens=False)]


def test_forcing_a_call_without_tools_is_refused_naming_the_field(served):
    """Forcing itself is test_serve_forced_calls.py's (it needs a real engine to apply the mask)."""
    family, server, _ = served
    client = openai.OpenAI(base_url=server.base + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="m", messages=USER, tool_choice="required")
    assert err.value.body["param"] == "tool_choice"
    with pytest.raises(anthropic.BadRequestError, match="tool_choice"):
        anthropic.Anthropic(base_url=server.base, api_key="x", max_retries=0).messages.create(
            model="m", max_tokens=16, messages=USER, tools=ANTHROPIC_TOOLS, tool_choice={"type": "tool"})


def test_tool_choice_none_returns_the_call_as_text(served):
    family, server, _ = served
    sample = tool_samples(family)[0]
    force(server, sample.text)
    client = openai.OpenAI(base_url=server.base + "/v1", api_key="x", max_retries=0)
    reply = client.chat.completions.create(model="m", messages=USER, tools=TOOLS, tool_choice="none",
                                           temperature=0, extra_body=thinking_options(family, sample))
    assert reply.choices[0].message.tool_calls is None and reply.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("served", ["glm"], indirect=True)   # one family is enough for the README's snippet
def test_readme_tool_example_runs(served):
    family, server, _ = served
    import contextlib
    import io
    import re

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    snippet = next(block for block in re.findall(r"```python\n(.*?)```", readme, re.S) if "tool_calls" in block)
    force(server, "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>")
    ForcingEngine.prompts.clear()
    client = openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0)
    with contextlib.redirect_stdout(io.StringIO()):
        exec(compile(snippet, "README.md", "exec"), {"client": client})
    assert len(ForcingEngine.prompts) == 2
    second = server.codec.decode(ForcingEngine.prompts[1])
    assert "<arg_value>Paris</arg_value>" in second and '{"temp_c": 21}' in second


def test_marker_tokens_that_are_special_still_reach_the_parser(tmp_path):
    """Some releases make a tool-call marker a special token: decoding keeps those, and only those."""
    pytest.importorskip("colibri_qwen")
    from tokenizers import Tokenizer

    from colibri.testing.tiny import train_tokenizer

    train_tokenizer(tmp_path, FAMILIES["qwen"].tiny_kind)
    (tmp_path / "chat_template.jinja").write_text(FAMILIES["qwen"].template, encoding="utf-8")
    backend = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    backend.add_special_tokens(["<tool_call>", "</tool_call>"])
    backend.save(str(tmp_path / "tokenizer.json"))
    plain = TokenizerCodec.from_model_dir(tmp_path)
    codec = TokenizerCodec(plain.tokenizer, ResolvedModel(tmp_path, "qwen", "qwen3_next", {}))
    ids = codec.encode("<tool_call>{}</tool_call><|im_end|>", add_special_tokens=False)
    assert plain.decode(ids) == "{}"
    assert codec.decode(ids) == "<tool_call>{}</tool_call>"


@pytest.mark.parametrize("body,param", [
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools[0].function.name"),
    ({"messages": USER + [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "search", "arguments": "{not json"}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
    ({"messages": USER + [{"role": "tool", "content": "x"}]}, "messages[1].tool_call_id"),
    ({"messages": USER + [{"role": "user", "content": "x", "tool_calls": [{}]}]}, "messages[1].tool_calls"),
    ({"chat_template_kwargs": {"messages": []}}, "messages"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
    ({"tool_choice": "always"}, "tool_choice"),
    ({"functions": [{"name": "search"}]}, "functions"),
    ({"reasoning_effort": "high"}, "reasoning_effort"),
])
def test_bad_tool_fields_are_400s_naming_the_field(served, body, param):
    import httpx

    _, server, _ = served
    r = httpx.post(server.base + "/v1/chat/completions", json={"model": "m", "messages": USER, **body}, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param if param != "messages" else "'messages'" in error["message"]


def test_anthropic_thinking_needs_a_thinking_switch(served):
    family, server, _ = served
    client = anthropic.Anthropic(base_url=server.base, api_key="x", max_retries=0)
    thinking = {"type": "enabled", "budget_tokens": 1024}
    if family.thinking_switch:
        force(server, "</think>ok" if family.name in ("qwen", "deepseek-v4") else "ok")
        assert client.messages.create(model="m", max_tokens=2048, messages=USER, thinking=thinking).content
    else:
        with pytest.raises(anthropic.BadRequestError, match="thinking switch"):
            client.messages.create(model="m", max_tokens=2048, messages=USER, thinking=thinking)


@pytest.mark.parametrize("served", [name for name in sorted(FAMILIES) if FAMILIES[name].thinking_switch],
                         indirect=True)
def test_thinking_per_request_renders_as_the_template_does(served):
    family, server, directory = served
    hf = transformers.AutoTokenizer.from_pretrained(str(directory))
    client = openai.OpenAI(base_url=server.base + "/v1", api_key="x", max_retries=0)
    force(server, "</think>ok")
    prompts = []
    for on in (True, False):
        ForcingEngine.prompts.clear()
        client.chat.completions.create(model="m", messages=USER, temperature=0,
                                       extra_body={"chat_template_kwargs": {family.thinking_switch: on}})
        want = hf.apply_chat_template(USER, tokenize=False, add_generation_prompt=True,
                                      **{family.thinking_switch: on})
        assert ForcingEngine.prompts == [server.codec.encode(want, add_special_tokens=False)]
        prompts.append(want)
    assert prompts[0] != prompts[1]
