"""The agent-facing routes through the official clients, for each tool-calling family (teacher-forced replies in
the family's real syntax, as in test_serve_tools.py): the Responses API (text, reasoning, function calls and their
round trip, streamed and not), Anthropic prefill and ``count_tokens``, and the reasoning controls
(``reasoning_effort``), each compared with what transformers' ``apply_chat_template`` renders."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "colibri-core" / "tests"))  # core's harnesses
from family_syntax import FAMILIES, TOOLS
from forcing_server import USER, ForcingEngine, force, template_server

transformers = pytest.importorskip("transformers")
RESPONSES_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def served(request, tmp_path_factory):
    forced = template_server(request.param, tmp_path_factory)
    yield forced.family, forced.server, forced.directory
    forced.server.stop()


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base + "/v1", api_key="x", max_retries=0)


def _thinking(family, sample) -> dict:
    return {"chat_template_kwargs": {family.thinking_switch: True}} if sample.in_reasoning and \
        family.thinking_switch else {}


def _tool_sample(family):
    return next(s for s in family.samples if s.calls)


def _calls(sample):
    return [(name, args) for name, args, _ in sample.calls]


def _summary(response) -> tuple[str, str, list]:
    """(reasoning, text, calls) of a Responses API reply."""
    reasoning = "".join(c.text for item in response.output if item.type == "reasoning" for c in item.content or [])
    text = "".join(c.text for item in response.output if item.type == "message" for c in item.content)
    calls = [(item.name, json.loads(item.arguments)) for item in response.output if item.type == "function_call"]
    return reasoning, text, calls


def test_responses_function_calls_streamed_and_not(served):
    family, server, _ = served
    client = _client(server)
    for sample in (s for s in family.samples if s.calls):
        force(server, sample.text)
        kwargs = dict(model="m", input=USER[0]["content"], tools=RESPONSES_TOOLS, temperature=0,
                      extra_body=_thinking(family, sample))
        reply = client.responses.create(**kwargs)
        assert reply.status == "completed" and reply.object == "response"
        assert _summary(reply) == (sample.reasoning, sample.content, _calls(sample))
        assert all(item.call_id for item in reply.output if item.type == "function_call")
        assert reply.usage.input_tokens == len(ForcingEngine.prompts[-1])
        assert reply.usage.output_tokens == len(ForcingEngine.script)

        events = list(client.responses.create(stream=True, **kwargs))
        kinds = [e.type for e in events]
        assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
        assert [e.sequence_number for e in events] == list(range(len(events)))
        final = events[-1].response
        assert _summary(final) == (sample.reasoning, sample.content, _calls(sample))
        # every item is announced, filled and closed before the next one opens
        added = [e.output_index for e in events if e.type == "response.output_item.added"]
        done = [e.output_index for e in events if e.type == "response.output_item.done"]
        assert added == done == list(range(len(final.output)))
        streamed_text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        streamed_reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
        assert (streamed_reasoning, streamed_text) == (sample.reasoning, sample.content)
        arguments = [json.loads(e.arguments) for e in events if e.type == "response.function_call_arguments.done"]
        assert arguments == [args for _, args in _calls(sample)]

        with client.responses.stream(**kwargs) as stream:
            helper = stream.get_final_response()
        assert _summary(helper) == (sample.reasoning, sample.content, _calls(sample))


def test_responses_text_and_the_token_limit(served):
    _, server, _ = served
    client = _client(server)
    force(server, "<think>plan</think>Plain words.")
    reply = client.responses.create(model="m", input=[{"role": "user", "content": "hi"}], temperature=0)
    assert reply.output_text == "Plain words." and reply.status == "completed"
    assert _summary(reply)[0] == "plan"
    assert reply.usage.output_tokens_details.reasoning_tokens > 0
    short = client.responses.create(model="m", input="hi", max_output_tokens=2, temperature=0)
    assert short.status == "incomplete" and short.incomplete_details.reason == "max_output_tokens"
    events = list(client.responses.create(model="m", input="hi", max_output_tokens=2, temperature=0, stream=True))
    assert events[-1].type == "response.incomplete"


def test_responses_tool_round_trip_renders_as_transformers(served):
    family, server, directory = served
    hf = transformers.AutoTokenizer.from_pretrained(str(directory))
    client = _client(server)
    sample = _tool_sample(family)
    extra = _thinking(family, sample)
    force(server, sample.text)
    first = client.responses.create(model="m", instructions="Be brief.", input=USER[0]["content"],
                                    tools=RESPONSES_TOOLS, temperature=0, extra_body=extra)
    calls = [item for item in first.output if item.type == "function_call"]
    follow_up = [{"role": "user", "content": USER[0]["content"]}]
    follow_up += [item.model_dump(exclude_none=True) for item in first.output]
    follow_up += [{"type": "function_call_output", "call_id": c.call_id, "output": json.dumps({"ok": i})}
                  for i, c in enumerate(calls)]
    force(server, ("Done.</think>" if sample.in_reasoning else "") + "It is sunny.")
    ForcingEngine.prompts.clear()
    second = client.responses.create(model="m", instructions="Be brief.", input=follow_up, tools=RESPONSES_TOOLS,
                                     temperature=0, extra_body=extra)
    assert second.output_text == "It is sunny."
    # the same conversation in the chat shape, as transformers renders it (arguments as objects)
    assistant = {"role": "assistant", "content": sample.content, "tool_calls": [
        {"id": c.call_id, "type": "function", "function": {"name": c.name, "arguments": json.loads(c.arguments)}}
        for c in calls]}
    if sample.reasoning:
        assistant["reasoning_content"] = sample.reasoning
    results = [{"role": "tool", "tool_call_id": c.call_id, "content": json.dumps({"ok": i})}
               for i, c in enumerate(calls)]
    conversation = [{"role": "system", "content": "Be brief."}, *USER, assistant, *results]
    want = hf.apply_chat_template(conversation, tools=TOOLS, tokenize=False, add_generation_prompt=True,
                                  **extra.get("chat_template_kwargs", {}))
    assert ForcingEngine.prompts == [server.codec.encode(want, add_special_tokens=False)]


@pytest.mark.parametrize("body,param", [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].type"),
    ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"truncation": "auto"}, "truncation"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].tool_call_id"),
])
def test_responses_refusals_name_the_field(served, body, param):
    _, server, _ = served
    r = httpx.post(server.base + "/v1/responses", json={"model": "m", "input": "hi", **body}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_anthropic_prefill_continues_the_final_message(served):
    family, server, directory = served
    hf = transformers.AutoTokenizer.from_pretrained(str(directory))
    client = anthropic.Anthropic(base_url=server.base, api_key="x", max_retries=0)
    prefill = [*USER, {"role": "assistant", "content": "The weather in Köln is"}]
    force(server, " sunny.")
    ForcingEngine.prompts.clear()
    reply = client.messages.create(model="m", max_tokens=64, messages=prefill)
    assert [b.text for b in reply.content] == [" sunny."] and reply.stop_reason == "end_turn"
    with client.messages.stream(model="m", max_tokens=64, messages=prefill) as stream:
        assert "".join(stream.text_stream) == " sunny."
    want = hf.apply_chat_template(prefill, tokenize=False, continue_final_message=True)
    assert ForcingEngine.prompts == [server.codec.encode(want, add_special_tokens=False)] * 2
    with pytest.raises(anthropic.BadRequestError, match="trailing whitespace"):
        client.messages.create(model="m", max_tokens=64, messages=[*USER, {"role": "assistant", "content": "Hi "}])


def test_anthropic_count_tokens_is_the_generations_prompt(served):
    family, server, _ = served
    client = anthropic.Anthropic(base_url=server.base, api_key="x", max_retries=0)
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in TOOLS]
    kwargs = dict(model="m", system="Be brief.", messages=USER, tools=tools)
    counted = client.messages.count_tokens(**kwargs)
    force(server, "ok")
    ForcingEngine.prompts.clear()
    client.messages.create(max_tokens=16, **kwargs)
    assert counted.input_tokens == len(ForcingEngine.prompts[0]) > 0
    with pytest.raises(anthropic.BadRequestError, match="messages"):
        client.messages.count_tokens(model="m", messages=[])


def test_reasoning_effort_on_a_plain_thinking_switch(served):
    family, server, directory = served
    client = _client(server)
    force(server, "ok")
    if not family.thinking_switch:
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="m", messages=USER, reasoning_effort="none")
        assert err.value.body["param"] == "reasoning_effort"
        return
    hf = transformers.AutoTokenizer.from_pretrained(str(directory))
    ForcingEngine.prompts.clear()
    client.chat.completions.create(model="m", messages=USER, reasoning_effort="none")
    client.responses.create(model="m", input=USER[0]["content"], reasoning={"effort": "none"})
    want = hf.apply_chat_template(USER, tokenize=False, add_generation_prompt=True, **{family.thinking_switch: False})
    assert ForcingEngine.prompts == [server.codec.encode(want, add_special_tokens=False)] * 2
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="m", messages=USER, reasoning_effort="high")
    assert err.value.body["param"] == "reasoning_effort"
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model="m", input="hi", reasoning={"effort": "high"})
    assert err.value.body["param"] == "reasoning.effort"


EFFORT_TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
                   "{% if add_generation_prompt %}<|assistant|>effort={{ reasoning_effort | default('medium') }}"
                   "{% endif %}")


def test_reasoning_effort_levels_of_a_template_render_as_transformers(tmp_path):
    """A template with its own ``reasoning_effort`` variable (gpt-oss style) gets the level as it is named."""
    from colibri.server.codec import TokenizerCodec
    from serve_harness import build_tokenizer_dir, start_server

    directory = build_tokenizer_dir(tmp_path / "effort")
    (directory / "chat_template.jinja").write_text(EFFORT_TEMPLATE, encoding="utf-8")
    codec = TokenizerCodec.from_model_dir(directory)
    assert codec.reasoning_effort_variable
    hf = transformers.AutoTokenizer.from_pretrained(str(directory))
    server = start_server(directory, ctx=512, codec=codec)
    try:
        for effort in ("low", "high"):
            want = hf.apply_chat_template(USER, tokenize=False, add_generation_prompt=True, reasoning_effort=effort)
            assert codec.render_chat(USER, template_kwargs={"reasoning_effort": effort}) == want
            reply = _client(server).chat.completions.create(model="m", messages=USER, reasoning_effort=effort,
                                                            max_tokens=2)
            assert reply.usage.prompt_tokens == len(codec.encode(want, add_special_tokens=False))
    finally:
        server.stop()


def test_deepseek_v4_chat_endpoints_serve_through_its_encoder(tmp_path):
    """The server renders V4 chats with the encoder: thinking per request, tools, DSML calls parsed back."""
    pytest.importorskip("colibri_deepseek_v4")
    from serve_harness import fake_argv, start_server

    from colibri.records import ResolvedModel
    from colibri.server.codec import TokenizerCodec
    from colibri.testing.tiny import train_tokenizer
    from colibri_deepseek_v4.encoding import EFFORT_MAX, render

    v4_dir = tmp_path
    train_tokenizer(v4_dir, "deepseek_v3")
    config = json.loads((v4_dir / "tokenizer_config.json").read_text())
    del config["chat_template"]       # as released: the format is the encoder
    (v4_dir / "tokenizer_config.json").write_text(json.dumps(config))
    B, U, A = "<｜begin▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"
    weather = {"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                                "parameters": {"type": "object", "properties": {"city": {}}}}}
    model = ResolvedModel(v4_dir, "deepseek-v4", "deepseek_v4", {})
    codec = TokenizerCodec(TokenizerCodec.from_model_dir(v4_dir).tokenizer, model)
    assert codec.renders_chat and codec.tools_supported and codec.thinking_switch == "thinking"
    argv = fake_argv(v4_dir, 4096, 1, codec.vocab_size)   # the effort instruction and the tools section are long
    server = start_server(v4_dir, ctx=4096, codec=codec, factory=lambda: ForcingEngine(argv, ready_timeout=30))
    try:
        client = openai.OpenAI(base_url=server.base + "/v1", api_key="x", max_retries=0)
        user = [{"role": "user", "content": "Weather in Köln?"}]
        force(server, 'plan</think>\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n'
                      '<｜DSML｜parameter name="city" string="true">Köln</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
                      '</｜DSML｜tool_calls>')
        ForcingEngine.prompts.clear()
        reply = client.chat.completions.create(model="m", messages=user, tools=[weather], temperature=0,
                                               extra_body={"chat_template_kwargs": {"thinking": True}},
                                               reasoning_effort="max")
        message = reply.choices[0].message
        assert message.reasoning_content == "plan" and reply.choices[0].finish_reason == "tool_calls"
        assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == \
            [("get_weather", {"city": "Köln"})]
        want = render(user, [weather], {"template_kwargs": {"thinking": True, "reasoning_effort": "max"}})
        assert want.startswith(B + EFFORT_MAX) and want.endswith(f"{U}Weather in Köln?{A}<think>")
        assert ForcingEngine.prompts == [codec.encode(want, add_special_tokens=False)]
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="m", messages=user, reasoning_effort="low")
        assert err.value.body["param"] == "reasoning_effort"
    finally:
        server.stop()
