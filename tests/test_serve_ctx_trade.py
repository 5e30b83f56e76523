"""``coli serve`` without ``--ctx`` under a budget the default context's KV would fill: the context is traded for
expert slots (ctx_choice.py), the server says so and reports the context it serves, and requests are answered."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import openai
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "colibri-core" / "tests"))  # core's serve harness
from cli_server import coli_server


def test_serve_trades_context_for_expert_slots_and_says_so(tiny_root, monkeypatch):
    pytest.importorskip("colibri_olmoe")
    from colibri import launch, plugins
    from colibri.ctx_choice import TRADE_FLOOR, choose_ctx
    from colibri.inventory import load_facts
    from colibri.model import resolve_model
    from colibri.testing.tiny import tiny_model

    monkeypatch.setenv("COLIBRI_LOAD_PLUGINS", "olmoe")
    plugins.reset()
    path = tiny_model("olmoe", tiny_root).path
    facts = load_facts(resolve_model(str(path)))
    slots = 2
    floor = launch.plan_at(facts, 1 << 40, TRADE_FLOOR, slots, None)
    ram = (floor.dense_bytes + floor.kv_bytes + floor.state_bytes + floor.reserve_bytes
           + floor.experts_per_layer * floor.expert_bytes * floor.moe_layers)        # every expert at the floor
    default = launch.default_ctx(facts)
    before = launch.plan_at(facts, ram, default, slots, None)
    assert before.cache_slots_per_layer < 0.75 * floor.experts_per_layer    # the default context costs slots
    want = choose_ctx(default, lambda c: launch.plan_at(facts, ram, c, slots, None)).ctx
    assert TRADE_FLOOR <= want < default
    plugins.reset()

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "NO_COLOR": "1", "COLIBRI_LOAD_PLUGINS": "olmoe"}
    env.pop("COLI_API_KEY", None)
    args = ["serve", "--model", str(path), "--kv-slots", str(slots), "--threads", "1", "--ram", repr(ram / launch.GIB),
            "--log-level", "warning", "--no-kv"]
    with coli_server(args, env) as (base, proc):
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
        reply = client.chat.completions.create(model="x", messages=[{"role": "user", "content": "Hi"}],
                                               max_tokens=4, temperature=0)
        assert reply.usage.completion_tokens >= 1
    err = proc.stderr.read().decode()
    assert f"warning: ctx {default} -> {want} to keep " in err and "pass --ctx to choose" in err
    assert f"{slots} slot(s), ctx {want}," in err
