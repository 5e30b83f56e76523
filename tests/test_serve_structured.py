"""Structured output, log-probabilities and the sampler's fields through ``coli serve``'s app on a real engine
(a tiny random-weight model of the olmoe family): what the official ``openai`` client sends and parses.

An untrained model writes random tokens, so whatever it returns under a JSON schema is valid only because the
mask of every step allowed nothing else.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Literal

import openai
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "colibri-core" / "tests"))  # core's harnesses
from serve_harness import start_server

pytest.importorskip("llguidance")

CTX = 512
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
        "owner": {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120},
                                                   "verified": {"type": "boolean"}},
                  "required": ["age", "verified"], "additionalProperties": False},
    },
    "required": ["name", "kind", "tags", "owner"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def server(tiny_root):
    pytest.importorskip("colibri_olmoe")
    from colibri import hooks, launch
    from colibri.model import resolve_model
    from colibri.server.codec import TokenizerCodec
    from colibri.testing.tiny import tiny_model

    model = resolve_model(str(tiny_model("olmoe", tiny_root).path))
    codec = TokenizerCodec(hooks.load_tokenizer(model), model=model)
    running = start_server(model.path, ctx=CTX, slots=2, codec=codec,
                           factory=lambda: launch.open_engine(model, ctx=CTX, slots=2, threads=1))
    try:
        yield running
    finally:
        running.stop()


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=120)


def valid(value, schema) -> bool:
    """A small validator for the keywords SCHEMA uses (no jsonschema dependency)."""
    kind = schema.get("type")
    if "enum" in schema:
        return value in schema["enum"]
    if kind == "object":
        props = schema.get("properties", {})
        return (isinstance(value, dict) and all(k in value for k in schema.get("required", []))
                and all(k in props for k in value) and all(valid(v, props[k]) for k, v in value.items()))
    if kind == "array":
        return (isinstance(value, list) and len(value) <= schema.get("maxItems", 1 << 30)
                and all(valid(v, schema["items"]) for v in value))
    if kind == "string":
        return isinstance(value, str) and len(value) <= schema.get("maxLength", 1 << 30)
    if kind == "integer":
        return (isinstance(value, int) and not isinstance(value, bool)
                and schema.get("minimum", -1 << 60) <= value <= schema.get("maximum", 1 << 60))
    if kind == "boolean":
        return isinstance(value, bool)
    raise AssertionError(f"unhandled schema {schema}")


MESSAGES = [{"role": "user", "content": "Describe a pet as JSON."}]


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_json_schema_replies_validate_on_every_try(server, seed):
    reply = client(server).chat.completions.create(
        model="m", messages=MESSAGES, temperature=1.2, seed=seed, max_tokens=300,
        response_format={"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA, "strict": True}})
    choice = reply.choices[0]
    assert choice.finish_reason == "stop", choice
    assert valid(json.loads(choice.message.content), SCHEMA), choice.message.content


def test_json_schema_streamed(server):
    stream = client(server).chat.completions.create(
        model="m", messages=MESSAGES, temperature=1.0, seed=9, max_tokens=300, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA}})
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert valid(json.loads(text), SCHEMA), text


def test_json_object(server):
    for seed in (5, 6):
        reply = client(server).chat.completions.create(model="m", messages=MESSAGES, temperature=1.0, seed=seed,
                                                       max_tokens=400, response_format={"type": "json_object"})
        content = reply.choices[0].message.content
        if reply.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(content), dict), content
        else:   # an object the random model kept open until max_tokens: still a valid prefix
            assert content.startswith("{")


def test_parse_with_a_pydantic_model(server):
    pydantic = pytest.importorskip("pydantic")

    class Owner(pydantic.BaseModel):
        age: int = pydantic.Field(ge=0, le=99)
        verified: bool

    class Pet(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=5)
        kind: Literal["cat", "dog"]
        tags: list[str] = pydantic.Field(max_length=2)
        owner: Owner

    for seed in (11, 12):
        done = client(server).chat.completions.parse(model="m", messages=MESSAGES, temperature=1.0, seed=seed,
                                                     max_tokens=300, response_format=Pet)
        pet = done.choices[0].message.parsed
        assert isinstance(pet, Pet) and pet.kind in ("cat", "dog")


def test_chat_logprobs_streamed_and_not_agree(server):
    c = client(server)
    whole = c.chat.completions.create(model="m", messages=MESSAGES, temperature=0, max_tokens=6, logprobs=True,
                                      top_logprobs=5)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens
    assert all(len(e.top_logprobs) == 5 and e.top_logprobs[0].logprob >= e.top_logprobs[-1].logprob
               for e in content)
    assert all(e.logprob == e.top_logprobs[0].logprob for e in content)   # greedy takes the likeliest
    streamed = [e for chunk in c.chat.completions.create(model="m", messages=MESSAGES, temperature=0, max_tokens=6,
                                                         logprobs=True, top_logprobs=5, stream=True)
                if chunk.choices and chunk.choices[0].logprobs for e in chunk.choices[0].logprobs.content]
    assert [(e.token, round(e.logprob, 5)) for e in streamed] == [(e.token, round(e.logprob, 5)) for e in content]


def test_completions_echo_logprobs_and_a_batch(server):
    c = client(server)
    reply = c.completions.create(model="m", prompt=["a cat", "the dog sat"], max_tokens=4, temperature=0,
                                 logprobs=3, echo=True)
    assert [choice.index for choice in reply.choices] == [0, 1]
    for choice, prompt in zip(reply.choices, ["a cat", "the dog sat"]):
        assert choice.text.startswith(prompt)
        lp = choice.logprobs
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None   # the first prompt token
        assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
        # a map by token text: two tokens that decode alike (halves of one character) share an entry
        assert all(1 <= len(top) <= 3 for top in lp.top_logprobs[1:])
        assert "".join(lp.tokens) == choice.text
    single = c.completions.create(model="m", prompt="the dog sat", max_tokens=4, temperature=0)
    assert reply.choices[1].text == "the dog sat" + single.choices[0].text


def test_completions_batch_streamed_with_echo_equals_the_whole_reply(server):
    c = client(server)
    prompts = ["one two", "three"]
    whole = c.completions.create(model="m", prompt=prompts, max_tokens=5, temperature=0, logprobs=2, echo=True)
    texts, tokens = {0: "", 1: ""}, {0: [], 1: []}
    for chunk in c.completions.create(model="m", prompt=prompts, max_tokens=5, temperature=0, logprobs=2, echo=True,
                                      stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            tokens[choice.index] += choice.logprobs.tokens if choice.logprobs else []
    for choice in whole.choices:
        assert texts[choice.index] == choice.text
        assert tokens[choice.index] == choice.logprobs.tokens


def test_sampler_fields_reach_the_engine(server):
    """logit_bias +100 on one token makes it the only one a greedy reply can pick."""
    c = client(server)
    token = 300
    reply = c.completions.create(model="m", prompt="hello", max_tokens=3, temperature=0, logprobs=1,
                                 logit_bias={str(token): 100}, extra_body={"min_p": 0.1, "repetition_penalty": 1.1})
    codec = server.codec
    assert reply.choices[0].logprobs.tokens == [codec.tokenizer.decode([token], skip_special_tokens=False)] * 3


def test_coli_run_json_schema_produces_valid_json(server, tmp_path):
    import os
    import subprocess

    schema_file = tmp_path / "pet.schema.json"
    schema_file.write_text(json.dumps(SCHEMA))
    for seed in (1, 2):
        out = subprocess.run([sys.executable, "-c", "from colibri.cli import main; main()", "run", "a pet, as JSON",
                              "--model", str(server.app.state.services.codec.model.path), "--json-schema",
                              str(schema_file), "--temp", "1.0", "--seed", str(seed), "-n", "300", "--ctx",
                              str(CTX), "--threads", "1", "--json"], capture_output=True, text=True, timeout=300,
                             env={**os.environ, "HF_HUB_OFFLINE": "1"})
        assert out.returncode == 0, out.stderr
        assert valid(json.loads(json.loads(out.stdout)["text"]), SCHEMA)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    out = subprocess.run([sys.executable, "-c", "from colibri.cli import main; main()", "run", "x", "--model",
                          str(server.app.state.services.codec.model.path), "--json-schema", str(bad)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 1 and "--json-schema" in out.stderr and "Traceback" not in out.stderr
