"""The context chosen without ``--ctx``: a run's KV sized for its prompt, chat/serve trading context for cache slots
under a tight budget, and the one line that says so (ctx_choice.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from colibri import ctx_choice, planner
from colibri.inventory import load_facts
from colibri.model import resolve_model
from colibri.records import PlanRequest


@pytest.fixture
def olmoe_like(olmoe_family, tiny_olmoe, monkeypatch):
    """The tiny OLMoE with a context as heavy against its experts as OLMoE-1B-7B's: 1024 positions cost about 3
    expert rows (one slot in every MoE layer) of KV. One-row prefill passes and one head keep the attention scores
    (rows x heads x 4 B per position) out of the ratio."""
    monkeypatch.setattr(planner, "PREFILL_ROWS", 1)
    monkeypatch.setattr(planner, "ENGINE_DEFAULT_ROWS", 1)
    facts = load_facts(resolve_model(tiny_olmoe.path))
    probe = planner.plan(facts.model, PlanRequest(1 << 40, 1), facts.geometry, facts.layout, facts.tensors)
    row = probe.expert_bytes * probe.moe_layers
    per_token = 3 * row // 1024
    scores_per_token = planner.SCRATCH_DTYPE_BYTES
    geometry = replace(facts.geometry, num_heads=1, kv_bytes_per_token=per_token - scores_per_token)
    return facts, geometry, row


def planner_at(facts, geometry, ram, slots=1, cap=0):
    return lambda ctx: planner.plan(facts.model, PlanRequest(ram, ctx, slots, cap=cap), geometry, facts.layout,
                                    facts.tensors)


def tight_ram(facts, geometry, row, slots_at_512=13):
    """A budget that gives 13 slots per layer at ctx 512, as the issue's one-third cap does for OLMoE-1B-7B."""
    at = planner_at(facts, geometry, 0)(512)
    fixed = at.dense_bytes + at.kv_bytes + at.state_bytes + at.reserve_bytes
    return fixed + slots_at_512 * row


def test_default_run_under_a_tight_cap_keeps_its_expert_slots(olmoe_like):
    facts, geometry, row = olmoe_like
    ram = tight_ram(facts, geometry, row)
    plan_at = planner_at(facts, geometry, ram)
    full, sized = plan_at(4096), plan_at(512)
    assert sized.cache_slots_per_layer == 13 and full.cache_slots_per_layer <= 3   # what the issue measured
    choice = ctx_choice.choose_ctx(4096, plan_at, needed=40 + 256)
    assert choice.ctx == 512
    assert choice.notice == (f"ctx 4096 -> 512 to keep 13 expert slots per layer ({full.cache_slots_per_layer} at "
                             f"ctx 4096) under --ram {ram / 1024 ** 3:.2f} GiB; the prompt and --max-tokens need 296 "
                             "positions; pass --ctx to choose")


def test_chat_and_serve_trade_context_for_slots_and_say_so(olmoe_like):
    facts, geometry, row = olmoe_like
    ram = tight_ram(facts, geometry, row)
    plan_at = planner_at(facts, geometry, ram)
    choice = ctx_choice.choose_ctx(4096, plan_at)
    assert choice.ctx == 1024                     # 2048 keeps fewer than 3/4 of the floor's slots
    assert plan_at(2048).cache_slots_per_layer < 0.75 * plan_at(1024).cache_slots_per_layer
    kept, before = plan_at(1024).cache_slots_per_layer, plan_at(4096).cache_slots_per_layer
    assert kept > before
    assert choice.notice.startswith(f"ctx 4096 -> 1024 to keep {kept} expert slots per layer ({before} at ctx 4096)")
    assert choice.notice.endswith("a conversation's length is not known up front; pass --ctx to choose")


def test_slots_of_a_server_count_in_the_trade(olmoe_like):
    facts, geometry, row = olmoe_like
    ram = tight_ram(facts, geometry, row, slots_at_512=40)
    assert ctx_choice.choose_ctx(4096, planner_at(facts, geometry, ram, slots=1)).ctx == 4096
    assert planner_at(facts, geometry, ram, slots=1)(4096).cache_slots_per_layer == 16      # every expert
    assert ctx_choice.choose_ctx(4096, planner_at(facts, geometry, ram, slots=4)).ctx == 2048


def test_no_trade_when_the_budget_is_generous_or_cap_fixes_the_slots(olmoe_like):
    facts, geometry, row = olmoe_like
    roomy = planner_at(facts, geometry, tight_ram(facts, geometry, row, slots_at_512=1000))
    assert roomy(4096).cache_slots_per_layer == roomy(4096).experts_per_layer
    assert ctx_choice.choose_ctx(4096, roomy) == ctx_choice.CtxChoice(4096)
    run = ctx_choice.choose_ctx(4096, roomy, needed=300)
    assert run == ctx_choice.CtxChoice(512)       # the KV is still sized for the run, silently: no slot bought
    tight = tight_ram(facts, geometry, row)
    assert ctx_choice.choose_ctx(4096, planner_at(facts, geometry, tight, cap=2), cap_given=True).ctx == 4096


def test_run_never_goes_past_the_default_or_the_models_maximum(olmoe_like):
    facts, geometry, row = olmoe_like
    plan_at = planner_at(facts, geometry, tight_ram(facts, geometry, row))
    assert ctx_choice.choose_ctx(4096, plan_at, needed=5000).ctx == 4096
    assert ctx_choice.choose_ctx(2048, plan_at, needed=3000).ctx == 2048
    assert ctx_choice.choose_ctx(4096, plan_at, needed=1).ctx == ctx_choice.CTX_STEP
