"""End to end on real engines: ``coli serve`` (the CLI, as a subprocess) over a tiny model of each family, compared
with ``coli run`` and with fresh engine runs of the same prompts. Traffic stays on 127.0.0.1.

One module parametrized over the family, not thin modules in each family's tests/: the checks are the same for
every family, so there is one copy of them, and a family package's tests run alone (``nox -s package_tests``) could
not import a harness from core's tests/. Being cross-package, it lives in the top-level tests/. A family whose
package is not installed is skipped. The module-scoped ``served`` fixture makes pytest run every test of one
family against one server before it starts the next family's.

``qwen3_next`` is hybrid (Gated DeltaNet + full attention): its linear layers keep a recurrent state that cannot be
rewound, so the multi-turn test and the slot-continuation test check that the server's slot reuse restores that
state exactly (after the reply, or from the end-of-prompt checkpoint), not just a KV prefix.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "colibri-core" / "tests"))  # core's serve harness
from cli_server import COLI, coli_server
from serve_harness import connect, raw_request, read_at_least

CTX = 256

# family id -> (tiny_model kind, the package that serves it)
FAMILIES = {
    "olmoe": ("olmoe", "colibri_olmoe"),
    "qwen3_next": ("qwen3_next", "colibri_qwen"),
    "glm4_moe_lite": ("glm4_moe_lite", "colibri_glm"),
    "deepseek_v3": ("deepseek_v3", "colibri_deepseek_v4"),
    "kimi_k2": ("kimi_k2", "colibri_kimi"),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def model_dir(request, tiny_root) -> Path:
    kind, package = FAMILIES[request.param]
    pytest.importorskip(package)
    from colibri.testing.tiny import tiny_model

    return tiny_model(kind, tiny_root).path


@pytest.fixture(scope="module")
def served(model_dir):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "NO_COLOR": "1"}
    env.pop("COLI_API_KEY", None)
    with coli_server(["serve", "--model", str(model_dir), "--kv-slots", "2", "--ctx", str(CTX), "--threads", "1",
                      "--log-level", "warning"], env) as running:
        yield running


def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)


def coli_run(model_dir, prompt: str, max_tokens: int) -> dict:
    args = [*COLI, "run", prompt, "--model", str(model_dir), "--temp", "0", "-n",
            str(max_tokens), "--ctx", str(CTX), "--threads", "1", "--json"]
    out = subprocess.run(args, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def load_tokenizer(model_dir):
    from colibri.inventory import family_answer
    from colibri.model import resolve_model

    return family_answer(resolve_model(str(model_dir)), "load_tokenizer")


@contextlib.contextmanager
def fresh_engine(model_dir, slots: int):
    """A new engine for the model; yields ``reply(ids, slot)``: its greedy reply (colibri.streaming.Reply) to
    token ids in that slot. Each prompt gets a slot of its own, so nothing is reused from an earlier prompt."""
    from colibri import launch
    from colibri.model import resolve_model
    from colibri.streaming import stream_reply

    tok = load_tokenizer(model_dir)
    with launch.open_engine(resolve_model(str(model_dir)), ctx=CTX, slots=slots, threads=1) as engine:
        yield lambda ids, slot, max_tokens: stream_reply(
            engine, tok, ids, slot=slot, write=lambda _t: None, max_tokens=max_tokens, stop=tok.stop_ids,
            temperature=0.0, top_p=1.0, top_k=0, seed=0)


def test_openai_and_anthropic_clients_equal_coli_run(served, model_dir):
    base, _ = served
    prompt = "The capital of France is"
    expected = coli_run(model_dir, prompt, 16)
    assert expected["mode"] == "chat", "the tiny model lost its chat template"
    assert expected["text"] and expected["stats"]["generated_tokens"] > 0
    oai = client(base)
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


def test_each_turn_prefills_only_the_new_tokens(served, model_dir):
    base, _ = served
    oai = client(base)
    conversation = [{"role": "system", "content": "You are terse."},
                    {"role": "user", "content": "Tell me about rivers."}]
    sent, replies = [], []
    for follow_up in ("And lakes?", "Which is deeper?", None):
        sent.append(conversation)
        replies.append(oai.chat.completions.create(model="x", messages=conversation, max_tokens=12, temperature=0))
        if len(sent) == 1:   # another conversation in between, on the other slot
            oai.chat.completions.create(model="x", messages=[{"role": "user", "content": "Something else."}],
                                        max_tokens=8, temperature=0)
        if follow_up:
            conversation = conversation + [{"role": "assistant", "content": replies[-1].choices[0].message.content},
                                           {"role": "user", "content": follow_up}]
    tok = load_tokenizer(model_dir)
    prompts = [tok.encode_chat(c, add_generation_prompt=True) for c in sent]
    with fresh_engine(model_dir, slots=len(prompts)) as reply:
        expected = [reply(ids, slot, 12).text for slot, ids in enumerate(prompts)]
    assert [r.choices[0].message.content for r in replies] == expected
    assert [r.usage.prompt_tokens for r in replies] == [len(ids) for ids in prompts]
    for before, after in zip(replies, replies[1:]):
        # The slot kept the conversation: the new turn reuses at least all of the previous prompt.
        assert after.usage.prompt_tokens_details.cached_tokens >= before.usage.prompt_tokens
    metrics = httpx.get(base + "/metrics", timeout=10).text
    assert "colibri_expert_cache_hit_rate" in metrics


def test_completions_continue_a_slot_from_its_own_reply(served, model_dir):
    """A text prompt, then token ids extending it with the exact tokens the slot generated, both pinned to one
    slot: the engine must reuse the state it reached while generating (for a hybrid model, the recurrent state
    after the reply, not merely the end-of-prompt checkpoint)."""
    from colibri.prompt import build_prompt

    base, _ = served
    oai = client(base)
    tok = load_tokenizer(model_dir)
    text = "Placement may change speed"
    first_ids = build_prompt(tok, text, chat=False).ids   # what `coli run --raw` sends
    with fresh_engine(model_dir, slots=2) as reply:
        first = reply(first_ids, 0, 10)
        second_ids = first_ids + first.tokens + tok.encode(" never the tokens.", add_special_tokens=False)
        second = reply(second_ids, 1, 10)
    assert first.text and second.text
    one = oai.completions.create(model="x", prompt=text, max_tokens=10, temperature=0,
                                 extra_body={"cache_slot": 1})
    assert one.choices[0].text == first.text
    assert (one.usage.prompt_tokens, one.usage.completion_tokens) == (len(first_ids), len(first.tokens))
    two = oai.completions.create(model="x", prompt=second_ids, max_tokens=10, temperature=0,
                                 extra_body={"cache_slot": 1})
    assert two.choices[0].text == second.text
    assert two.usage.prompt_tokens == len(second_ids)
    # The slot holds the state of the prompt and of every generated token but the last (which was never fed).
    assert two.usage.prompt_tokens_details.cached_tokens >= len(first_ids) + len(first.tokens) - 1


def test_hang_ups_at_random_moments_leave_the_real_engine_serving(served):
    """A hang-up's cancel (during the prefill, mid-stream, or just as the sequence ends) is confirmed by the engine
    before its slot is reused: a slot freed early would meet a sequence still running in it (engine ``busy``)."""
    base, _ = served
    messages = [{"role": "user", "content": "Tell me about rivers."}]
    oai = client(base)
    before = oai.chat.completions.create(model="x", messages=messages, max_tokens=12, temperature=0)
    rng = random.Random(5)
    for i in range(20):
        body = {"model": "x", "messages": [{"role": "user", "content": f"story {i}"}], "max_tokens": CTX,
                "temperature": 0, "stream": True}
        sock = connect(base)
        try:
            sock.sendall(raw_request(base, ("/v1/chat/completions", "/v1/messages")[i % 2], body))
            read_at_least(sock, rng.choice((0, 1, 400, 1500)))
        finally:
            sock.close()
    deadline = time.monotonic() + 30
    while True:
        health = httpx.get(base + "/health", timeout=5).json()
        if health["slots_busy"] == 0 and health["queued"] == 0:
            break
        assert time.monotonic() < deadline, health
        time.sleep(0.05)
    replies = [oai.chat.completions.create(model="x", messages=messages, max_tokens=12, temperature=0,
                                           extra_body={"cache_slot": slot}) for slot in (0, 1)]
    for reply in replies:
        assert reply.choices[0].message.content == before.choices[0].message.content


def test_engine_kill_is_survived(served):
    base, proc = served
    children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    assert len(children) == 1, children
    oai = client(base)
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
