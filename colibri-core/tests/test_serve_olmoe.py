"""End to end on a real engine: ``coli serve`` (the CLI, as a subprocess) over a tiny OLMoE, compared with
``coli run`` and with a fresh engine run of the same conversation. Traffic stays on 127.0.0.1."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import anthropic
import httpx
import openai
import pytest

pytest.importorskip("colibri_olmoe")

CTX = 256
COLI = [sys.executable, "-c", "from colibri.cli import main; main()"]


@pytest.fixture(scope="module")
def olmoe_dir(tmp_path_factory):
    from colibri.testing.tiny import tiny_model

    return tiny_model("olmoe", tmp_path_factory.mktemp("serve-olmoe")).path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served(olmoe_dir):
    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "NO_COLOR": "1"}
    env.pop("COLI_API_KEY", None)
    proc = subprocess.Popen([*COLI, "serve", "--model", str(olmoe_dir), "--port",
                             str(port), "--kv-slots", "2", "--ctx", str(CTX), "--threads", "1",
                             "--log-level", "warning"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300   # the first run may compile the engine
    try:
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"coli serve exited: {proc.stderr.read().decode()[-2000:]}")
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError("coli serve never became healthy")
            time.sleep(0.1)
        yield base, proc
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def coli_run(model_dir, prompt: str, max_tokens: int, raw: bool = False) -> dict:
    args = [*COLI, "run", prompt, "--model", str(model_dir), "--temp", "0", "-n",
            str(max_tokens), "--ctx", str(CTX), "--threads", "1", "--json"] + (["--raw"] if raw else [])
    out = subprocess.run(args, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def fresh_engine_text(model_dir, messages, max_tokens: int) -> tuple[str, int]:
    from colibri import launch
    from colibri.inventory import family_answer
    from colibri.model import resolve_model
    from colibri.streaming import stream_reply

    resolved = resolve_model(str(model_dir))
    tok = family_answer(resolved, "load_tokenizer")
    ids = tok.encode_chat(messages, add_generation_prompt=True)
    with launch.open_engine(resolved, ctx=CTX, threads=1) as engine:
        reply = stream_reply(engine, tok, ids, write=lambda _t: None, max_tokens=max_tokens, stop=tok.stop_ids,
                             temperature=0.0, top_p=1.0, top_k=0, seed=0)
    return reply.text, len(ids)


def test_openai_and_anthropic_clients_equal_coli_run(served, olmoe_dir):
    base, _ = served
    prompt = "The capital of France is"
    expected = coli_run(olmoe_dir, prompt, 16)
    assert expected["text"] and expected["stats"]["generated_tokens"] > 0
    oai = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": prompt}]
    reply = oai.chat.completions.create(model="x", messages=messages, max_tokens=16, temperature=0)
    assert reply.choices[0].message.content == expected["text"]
    assert reply.usage.prompt_tokens == len(expected["prompt_ids"])
    assert reply.usage.completion_tokens == expected["stats"]["generated_tokens"]
    streamed = "".join(c.choices[0].delta.content or "" for c in oai.chat.completions.create(
        model="x", messages=messages, max_tokens=16, temperature=0, stream=True) if c.choices)
    assert streamed == expected["text"]
    claude = anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0, timeout=120)
    with claude.messages.stream(model="x", max_tokens=16, messages=messages, extra_body={"temperature": 0}) as s:
        assert "".join(s.text_stream) == expected["text"]
        assert s.get_final_message().usage.output_tokens == expected["stats"]["generated_tokens"]
    raw = coli_run(olmoe_dir, prompt, 12, raw=True)
    completion = oai.completions.create(model="x", prompt=prompt, max_tokens=12, temperature=0)
    assert completion.choices[0].text == raw["text"]
    assert completion.usage.prompt_tokens == len(raw["prompt_ids"])


def test_second_turn_prefills_only_the_new_tokens(served, olmoe_dir):
    base, _ = served
    oai = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
    first = [{"role": "user", "content": "Tell me about rivers."}]
    one = oai.chat.completions.create(model="x", messages=first, max_tokens=12, temperature=0)
    oai.chat.completions.create(model="x", messages=[{"role": "user", "content": "Something else entirely."}],
                                max_tokens=8, temperature=0)   # another conversation in between
    second = first + [{"role": "assistant", "content": one.choices[0].message.content},
                      {"role": "user", "content": "And lakes?"}]
    two = oai.chat.completions.create(model="x", messages=second, max_tokens=12, temperature=0)
    expected, prompt_len = fresh_engine_text(olmoe_dir, second, 12)
    assert two.choices[0].message.content == expected
    assert two.usage.prompt_tokens == prompt_len
    assert two.usage.prompt_tokens_details.cached_tokens >= one.usage.prompt_tokens
    metrics = httpx.get(base + "/metrics", timeout=10).text
    assert "colibri_expert_cache_hit_rate" in metrics


def test_engine_kill_is_survived(served):
    base, proc = served
    children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    assert len(children) == 1, children
    oai = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
    os.kill(int(children[0]), signal.SIGKILL)
    deadline = time.monotonic() + 60

    def restarted() -> bool:
        # /health can still say 200 in the instant before the server notices the death: wait for a new engine.
        now = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
        return bool(now) and now != children and httpx.get(base + "/health", timeout=5).status_code == 200

    while not restarted():
        assert time.monotonic() < deadline, "no restart"
        time.sleep(0.1)
    reply = oai.chat.completions.create(model="x", messages=[{"role": "user", "content": "Still there?"}],
                                        max_tokens=4, temperature=0)
    assert reply.usage.completion_tokens >= 1
