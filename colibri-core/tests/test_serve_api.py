"""coli serve over the fake engine, through the official openai and anthropic clients (127.0.0.1 only)."""

from __future__ import annotations

import sys
from pathlib import Path

import json

import anthropic
import httpx
import openai
import pytest

sys.path.insert(0, str(Path(__file__).parent))  # the harness beside this file (importlib mode)
from serve_harness import build_tokenizer_dir, reference_text, start_server



@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tokenizer_dir(tmp_path_factory.mktemp("serve") / "tiny-chat")


@pytest.fixture(scope="module")
def server(model_dir):
    running = start_server(model_dir, ctx=256, slots=2, eos_every=40)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=30)


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.base, api_key="unused", max_retries=0, timeout=30)


def chat_ids(server, messages):
    return server.codec.chat_ids(messages)


# this anthropic client has no sampling arguments of its own; the Messages API still takes them in the body
GREEDY = {"temperature": 0}
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three birds."}]


def test_chat_completion_equals_engine_output_and_counts_usage(server, oai):
    reply = oai.chat.completions.create(model="tiny-chat", messages=MESSAGES, max_tokens=24, temperature=0)
    ids = chat_ids(server, MESSAGES)
    expected, tokens = reference_text(server, ids, 24)
    assert reply.choices[0].message.content == expected
    assert reply.choices[0].message.role == "assistant"
    assert reply.usage.prompt_tokens == len(ids)
    assert reply.usage.completion_tokens == len(tokens)
    assert reply.usage.total_tokens == len(ids) + len(tokens)
    stopped = tokens[-1] in server.codec.stop_ids
    assert reply.choices[0].finish_reason == ("stop" if stopped else "length")
    assert reply.model == "tiny-chat"


def test_chat_stream_equals_non_stream_and_ends_with_usage(server, oai):
    messages = [{"role": "user", "content": "Stream me something."}]
    whole = oai.chat.completions.create(model="m", messages=messages, max_tokens=30, temperature=0)
    chunks = list(oai.chat.completions.create(model="m", messages=messages, max_tokens=30, temperature=0,
                                              stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert [c.choices[0].finish_reason for c in finals] == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_raw_stream_framing_has_done_marker(server):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": True,
            "temperature": 0}
    with httpx.stream("POST", server.base + "/v1/chat/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        assert json.loads(line.removeprefix("data: "))["object"] == "chat.completion.chunk"


def test_completions_stream_and_not(server, oai):
    prompt = "def fibonacci(n):"
    ids = server.codec.text_ids(prompt)
    expected, tokens = reference_text(server, ids, 12)
    whole = oai.completions.create(model="m", prompt=prompt, max_tokens=12, temperature=0)
    assert whole.choices[0].text == expected
    assert whole.usage.prompt_tokens == len(ids) and whole.usage.completion_tokens == len(tokens)
    streamed = "".join(c.choices[0].text for c in oai.completions.create(
        model="m", prompt=prompt, max_tokens=12, temperature=0, stream=True))
    assert streamed == expected
    by_ids = oai.completions.create(model="m", prompt=ids, max_tokens=12, temperature=0)
    assert by_ids.choices[0].text == expected


def test_completions_default_max_tokens_is_sixteen(server, oai):
    reply = oai.completions.create(model="m", prompt="import os", temperature=0)
    assert reply.usage.completion_tokens <= 16
    ids = server.codec.text_ids("import os")
    assert reply.choices[0].text == reference_text(server, ids, 16)[0]


def test_anthropic_messages_equals_engine_output(server, claude):
    message = claude.messages.create(model="tiny-chat", max_tokens=24, extra_body=GREEDY, system="You are terse.",
                                     messages=[{"role": "user", "content": "Name three birds."}])
    ids = chat_ids(server, MESSAGES)
    expected, tokens = reference_text(server, ids, 24)
    assert message.content[0].type == "text" and message.content[0].text == expected
    assert message.stop_reason == ("end_turn" if tokens[-1] in server.codec.stop_ids else "max_tokens")
    assert message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0) == len(ids)
    assert message.usage.output_tokens == len(tokens)


def test_anthropic_stream_events_and_text(server, claude):
    kwargs = dict(model="m", max_tokens=20, extra_body=GREEDY,
                  messages=[{"role": "user", "content": [{"type": "text", "text": "Tell me a story."}]}])
    whole = claude.messages.create(**kwargs)
    with claude.messages.stream(**kwargs) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text == final.content[0].text
    assert final.usage.output_tokens == whole.usage.output_tokens
    raw_body = {**{k: v for k, v in kwargs.items() if k != "extra_body"}, **GREEDY, "stream": True}
    with httpx.stream("POST", server.base + "/v1/messages", json=raw_body, timeout=30) as r:
        assert r.status_code == 200
        names = [line.removeprefix("event: ") for line in r.iter_lines() if line.startswith("event: ")]
    assert names[:3] == ["message_start", "content_block_start", "ping"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) <= {"content_block_delta", "ping"}


def test_stop_sequence_is_never_leaked_while_streaming(server, oai):
    for attempt in range(20):   # a prompt whose continuation is long enough to hold a stop in its middle
        messages = [{"role": "user", "content": f"Count slowly ({attempt})."}]
        full, _ = reference_text(server, chat_ids(server, messages), 40)
        if len(full) >= 24 and "\ufffd" not in full[8:14]:
            break
    stop = full[8:11]
    expected = full[:full.index(stop)]
    chunks = list(oai.chat.completions.create(model="m", messages=messages, max_tokens=40, temperature=0,
                                              stop=[stop, "never-appears-xyz"], stream=True))
    deltas = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert "".join(deltas) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"
    whole = oai.chat.completions.create(model="m", messages=messages, max_tokens=40, temperature=0, stop=stop)
    assert whole.choices[0].message.content == expected
    claude_reply = anthropic.Anthropic(base_url=server.base, api_key="x", max_retries=0).messages.create(
        model="m", max_tokens=40, extra_body=GREEDY, messages=messages, stop_sequences=[stop])
    assert claude_reply.content[0].text == expected
    assert claude_reply.stop_reason == "stop_sequence" and claude_reply.stop_sequence == stop


def test_seeded_sampling_is_reproducible(server, oai):
    kwargs = dict(model="m", messages=[{"role": "user", "content": "Surprise me."}], max_tokens=16,
                  temperature=0.8, top_p=0.9, seed=1234)
    first = oai.chat.completions.create(**kwargs).choices[0].message.content
    again = oai.chat.completions.create(**kwargs).choices[0].message.content
    other = oai.chat.completions.create(**{**kwargs, "seed": 99}).choices[0].message.content
    greedy = oai.chat.completions.create(**{**kwargs, "temperature": 0}).choices[0].message.content
    assert first == again
    assert first != other or first != greedy


def test_over_large_max_tokens_is_clamped_to_the_context(server, oai):
    messages = [{"role": "user", "content": "Go on forever."}]
    ids = chat_ids(server, messages)
    reply = oai.chat.completions.create(model="m", messages=messages, max_tokens=10**6, temperature=0)
    expected, tokens = reference_text(server, ids, 256 - len(ids))
    assert reply.choices[0].message.content == expected
    assert reply.usage.completion_tokens == len(tokens) <= 256 - len(ids)


def test_over_long_prompt_is_a_clean_400_even_when_streaming(server, oai):
    long = "word " * 400
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as err:
            result = oai.chat.completions.create(model="m", messages=[{"role": "user", "content": long}],
                                                 max_tokens=5, stream=stream)
            list(result) if stream else None
        assert err.value.code == "context_length_exceeded"
    with pytest.raises(anthropic.BadRequestError) as err:
        anthropic.Anthropic(base_url=server.base, api_key="x", max_retries=0).messages.create(
            model="m", max_tokens=5, messages=[{"role": "user", "content": long}], stream=True)
    assert err.value.body["type"] == "error" and err.value.body["error"]["type"] == "invalid_request_error"


def test_models_routes(server, oai):
    listed = oai.models.list()
    assert [m.id for m in listed.data] == [server.app.state.config.model_id]
    assert oai.models.retrieve(server.app.state.config.model_id).id == server.app.state.config.model_id
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("no-such-model")


def test_second_turn_reuses_the_slot_prefix_and_equals_a_fresh_run(server, oai):
    first_turn = [{"role": "system", "content": "Remember things."}, {"role": "user", "content": "My name is Ada."}]
    other = [{"role": "user", "content": "An unrelated conversation on the other slot."}]
    one = oai.chat.completions.create(model="m", messages=first_turn, max_tokens=20, temperature=0)
    oai.chat.completions.create(model="m", messages=other, max_tokens=20, temperature=0)
    second_turn = first_turn + [{"role": "assistant", "content": one.choices[0].message.content},
                                {"role": "user", "content": "What is my name?"}]
    two = oai.chat.completions.create(model="m", messages=second_turn, max_tokens=20, temperature=0)
    first_ids = chat_ids(server, first_turn)
    all_ids = chat_ids(server, second_turn)
    cached = two.usage.prompt_tokens_details.cached_tokens
    # the whole first prompt (and more: the reply) came from the slot; only the new turn was prefilled
    assert cached >= len(first_ids)
    assert two.usage.prompt_tokens == len(all_ids)
    assert two.choices[0].message.content == reference_text(server, all_ids, 20)[0]


def test_explicit_cache_slot_pins_the_conversation(server):
    body = {"model": "m", "messages": [{"role": "user", "content": "pinned " * 20}], "max_tokens": 4,
            "temperature": 0, "cache_slot": 1}
    first = httpx.post(server.base + "/v1/chat/completions", json=body, timeout=30).json()
    again = httpx.post(server.base + "/v1/chat/completions", json=body, timeout=30).json()
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] < again["usage"]["prompt_tokens_details"][
        "cached_tokens"] == again["usage"]["prompt_tokens"] - 1
    bad = httpx.post(server.base + "/v1/chat/completions", json={**body, "cache_slot": 2}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "cache_slot"


def test_health_and_metrics(server, oai):
    health = httpx.get(server.base + "/health", timeout=10)
    assert health.status_code == 200 and health.json()["status"] == "ok"
    oai.chat.completions.create(model="m", messages=[{"role": "user", "content": "count me"}], max_tokens=3)
    text = httpx.get(server.base + "/metrics", timeout=10).text
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
              if line and not line.startswith("#")}
    for name in ("colibri_prompt_tokens_total", "colibri_generated_tokens_total", "colibri_expert_cache_hit_rate",
                 "colibri_expert_bytes_read_total", "colibri_queue_depth", "colibri_slots_busy",
                 "colibri_decode_tokens_per_second", "colibri_engine_up"):
        assert name in values, name
    assert values["colibri_generated_tokens_total"] > 0
    assert values["colibri_expert_cache_hit_rate"] == pytest.approx(0.75)
    assert values['colibri_requests_total{code="200",route="chat"}'] >= 1
    assert values["colibri_engine_up"] == 1
