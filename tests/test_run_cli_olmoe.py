"""``coli run`` end to end on the real OLMoE engine (colibri-olmoe) over a tiny transformers-built model: greedy
tokens equal transformers' generate, and a chat streams text with its stats line. Cross-package (core's CLI, a
family's engine, torch), so it lives here rather than in core's own tests."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from colibri import plugins
from colibri.cli import app
from colibri.tokenizer import load_tokenizer_dir


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture
def real_olmoe(tmp_path_factory, monkeypatch):
    pytest.importorskip("colibri_olmoe")
    pytest.importorskip("torch")
    from colibri.testing.tiny import tiny_model

    monkeypatch.setenv("COLIBRI_LOAD_PLUGINS", "olmoe")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    plugins.reset()
    yield tiny_model("olmoe", tmp_path_factory.getbasetemp() / "tiny-e2e")
    plugins.reset()


def test_e2e_olmoe_greedy_tokens_equal_transformers(real_olmoe):
    import torch
    from transformers import AutoModelForCausalLM

    path = real_olmoe.path
    n = 20
    res = invoke("run", "The quick brown fox jumps over", "--model", path, "--raw", "--json", "--temp", 0,
                 "--max-tokens", n, "--ctx", 256, "--threads", 2)
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    tok = load_tokenizer_dir(path)
    assert data["prompt_ids"] == tok.encode("The quick brown fox jumps over")
    model = AutoModelForCausalLM.from_pretrained(str(path), torch_dtype=torch.float32)
    with torch.no_grad():
        out = model.generate(torch.tensor([data["prompt_ids"]]), max_new_tokens=n, do_sample=False)
    expected = out[0, len(data["prompt_ids"]):].tolist()
    got = data["generated_ids"]
    # transformers runs the full length (no eos in the tiny generation_config); we stop at the model's eos.
    assert got == expected[:len(got)]
    assert len(got) == n or got[-1] in tok.stop_ids
    assert data["stats"]["generated_tokens"] == len(got) and 0.0 <= data["stats"]["hit_rate"] <= 1.0


def test_e2e_olmoe_chat_streams_text(real_olmoe):
    res = invoke("run", "Hi!", "--model", real_olmoe.path, "--max-tokens", 8, "--ram", 1, "--cap", 4,
                 "--threads", 2, "--seed", 1)
    assert res.exit_code == 0, res.output
    line = res.stderr.strip().splitlines()[-1]
    assert line.startswith("prefill ") and "expert hit rate" in line


def test_e2e_olmoe_default_run_under_a_tight_budget_sizes_its_kv_and_keeps_the_tokens(real_olmoe):
    """Without --ctx, a budget too tight for the default 4096-token KV still runs: the context is sized for the prompt
    and --max-tokens (ctx_choice.py), the cache keeps slots that evict, and greedy tokens equal transformers'."""
    import torch
    from transformers import AutoModelForCausalLM

    from colibri import launch
    from colibri.inventory import load_facts
    from colibri.model import resolve_model

    path = real_olmoe.path
    facts = load_facts(resolve_model(str(path)))
    at = launch.plan_at(facts, 1 << 40, 256, 1, None)
    ram = (at.dense_bytes + at.kv_bytes + at.state_bytes + at.reserve_bytes
           + 3 * at.expert_bytes * at.moe_layers + at.expert_bytes // 2)
    assert launch.plan_at(facts, ram, 4096, 1, None).cache_slots_per_layer < 3
    n = 20
    args = ["run", "The quick brown fox jumps over", "--model", path, "--raw", "--json", "--temp", 0,
            "--max-tokens", n, "--threads", 2, "--ram", repr(ram / launch.GIB)]
    res = invoke(*args)
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["ctx"] == 256 and 0 < data["cap"] <= 3 < at.experts_per_layer
    assert "warning: ctx 4096 -> 256 to keep 3 expert slots per layer" in res.stderr
    model = AutoModelForCausalLM.from_pretrained(str(path), torch_dtype=torch.float32)
    with torch.no_grad():
        out = model.generate(torch.tensor([data["prompt_ids"]]), max_new_tokens=n, do_sample=False)
    expected = out[0, len(data["prompt_ids"]):].tolist()
    got = data["generated_ids"]
    assert got == expected[:len(got)] and (len(got) == n or got[-1] in load_tokenizer_dir(path).stop_ids)
    # more reads than the cache holds: it evicted, and experts were read again
    assert data["stats"]["expert_misses"] > data["cap"] * at.moe_layers
