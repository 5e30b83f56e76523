"""Saved KV through the commands a person runs: ``coli serve`` restarted between two turns of a conversation,
``coli chat --resume``, and ``coli kv list|clear``, on a tiny OLMoE with one expert slot per layer.

The second turn after a restart takes from disk exactly the tokens the saved file shares with its prompt (the
server's usage reports them as cached; only the rest is prefilled), and its greedy reply is the one a server
without saved KV gives to the same conversation.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import openai
import pytest
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "colibri-core" / "tests"))  # core's serve harness
from cli_server import coli_server

from colibri.cli import app
from colibri.kv_store import common_prefix, read_saved

CTX = 256
FLAGS = ["--ctx", str(CTX), "--cap", "1", "--threads", "1"]


@pytest.fixture(scope="module")
def model_dir(tiny_root) -> Path:
    pytest.importorskip("colibri_olmoe")
    from colibri.testing.tiny import tiny_model

    return tiny_model("olmoe", tiny_root).path


def tokenizer(model_dir):
    from colibri import hooks
    from colibri.model import resolve_model

    return hooks.load_tokenizer(resolve_model(str(model_dir)))


def ask(base: str, messages: list[dict]) -> openai.types.chat.ChatCompletion:
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
    return client.chat.completions.create(model="x", messages=messages, max_tokens=8, temperature=0)


def serve(model_dir, *flags):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "NO_COLOR": "1"}
    env.pop("COLI_API_KEY", None)
    return coli_server(["serve", "--model", str(model_dir), *FLAGS, "--log-level", "warning", *flags], env)


def test_serve_restart_prefills_only_the_new_tokens(model_dir, tmp_path):
    kv_dir = tmp_path / "kv"
    first = [{"role": "user", "content": "Tell me about rivers."}]
    with serve(model_dir, "--kv-dir", str(kv_dir)) as (base, _):
        one = ask(base, first)
    saved = [read_saved(p) for p in kv_dir.glob("*/*.kv")]
    assert len(saved) == 1 and saved[0] is not None
    second = first + [{"role": "assistant", "content": one.choices[0].message.content},
                      {"role": "user", "content": "And lakes?"}]
    ids = tokenizer(model_dir).encode_chat(second, add_generation_prompt=True)
    from_disk = min(common_prefix(saved[0].tokens, ids), len(ids) - 1)
    # at least the whole first prompt (the reply too where its text re-tokenizes to the sampled tokens, which a
    # random-weight model's byte soup rarely does)
    assert from_disk >= one.usage.prompt_tokens
    with serve(model_dir, "--kv-dir", str(kv_dir)) as (base, _):   # a new server: nothing in memory
        two = ask(base, second)
    assert two.usage.prompt_tokens == len(ids)
    assert two.usage.prompt_tokens_details.cached_tokens == from_disk
    with serve(model_dir, "--no-kv") as (base, _):
        fresh = ask(base, second)
    assert fresh.usage.prompt_tokens_details.cached_tokens == 0
    assert two.choices[0].message.content == fresh.choices[0].message.content


def chat(args: list[str], script: str):
    res = CliRunner().invoke(app, ["chat", *args, "--temp", "0", "--max-tokens", "6", *FLAGS], input=script,
                             catch_exceptions=False)
    assert res.exit_code == 0, res.output
    return res.stdout


LAST_TURN = re.compile(r"last turn: (\d+) prompt tokens = (\d+) reused \+ (\d+) prefilled")


def test_chat_resume_and_kv_list_clear(model_dir, tmp_path):
    kv = ["--model", str(model_dir), "--kv-dir", str(tmp_path / "kv")]
    chat(kv, "hello there\n")
    files = list((tmp_path / "kv").glob("*/*.kv"))
    assert len(files) == 1
    saved = read_saved(files[0])
    kept = json.loads((files[0].parent / "chat.json").read_text())["messages"]
    assert [m["role"] for m in kept] == ["user", "assistant"]
    ids = tokenizer(model_dir).encode_chat([*kept, {"role": "user", "content": "and again"}],
                                           add_generation_prompt=True)
    resumed = chat([*kv, "--resume"], "and again\n/stats\n")
    m = LAST_TURN.search(resumed)
    assert m, resumed
    prompt, reused, prefilled = map(int, m.groups())
    assert prompt == len(ids) and reused == min(common_prefix(saved.tokens, ids), len(ids) - 1) > 0
    assert prefilled == prompt - reused
    # the same conversation in one sitting, without saved KV: the same second reply
    whole = chat(["--model", str(model_dir), "--no-kv", "--kv-dir", str(tmp_path / "other")],
                 "hello there\nand again\n/stats\n")
    assert whole.split("last turn:")[0].endswith(resumed.split("last turn:")[0])
    assert LAST_TURN.search(whole).group(1) == str(prompt)
    assert not list((tmp_path / "other").glob("*/*.kv"))     # --no-kv saves nothing

    runner = CliRunner()
    listed = runner.invoke(app, ["kv", "list", "--kv-dir", str(tmp_path / "kv"), "--json"])
    assert listed.exit_code == 0, listed.output
    rows = json.loads(listed.stdout)["models"]
    mine = [r for r in rows if r["files"]]
    assert len(mine) == 1 and mine[0]["name"] == model_dir.name and mine[0]["family"] == "olmoe"
    table = runner.invoke(app, ["kv", "list", "--kv-dir", str(tmp_path / "kv")])
    assert model_dir.name in table.stdout and "olmoe" in table.stdout
    refused = runner.invoke(app, ["kv", "clear", "--kv-dir", str(tmp_path / "kv")])
    assert refused.exit_code == 1 and "--model NAME or --all" in refused.output
    unknown = runner.invoke(app, ["kv", "clear", "--model", "nothing-here", "--kv-dir", str(tmp_path / "kv")])
    assert unknown.exit_code == 1 and "no saved KV" in unknown.output
    cleared = runner.invoke(app, ["kv", "clear", "--model", str(model_dir), "--kv-dir", str(tmp_path / "kv")])
    assert cleared.exit_code == 0 and "cleared 1 model(s)" in cleared.stdout
    assert not list((tmp_path / "kv").glob("*/*.kv"))
    again = chat([*kv, "--resume"], "/stats\n")            # the kept conversation went with it
    assert "no conversation kept" in again or "no turns yet" in again
    chat(kv, "hello there\n")
    gone = runner.invoke(app, ["kv", "clear", "--all", "--kv-dir", str(tmp_path / "kv")])
    assert gone.exit_code == 0 and "cleared 1 model(s)" in gone.stdout
    empty = runner.invoke(app, ["kv", "list", "--kv-dir", str(tmp_path / "kv")])
    assert "no saved KV" in empty.stdout


def test_run_opts_in_and_reuses_its_own_prompt(model_dir, tmp_path):
    args = ["run", "Tell me about rivers.", "--model", str(model_dir), "--temp", "0", "-n", "5", *FLAGS, "--json"]
    runner = CliRunner()
    plain = runner.invoke(app, args, catch_exceptions=False)
    assert plain.exit_code == 0, plain.output
    assert json.loads(plain.stdout)["kv_loaded_tokens"] == 0     # off by default for run
    first = json.loads(runner.invoke(app, [*args, "--kv-dir", str(tmp_path)], catch_exceptions=False).stdout)
    again = json.loads(runner.invoke(app, [*args, "--kv-dir", str(tmp_path)], catch_exceptions=False).stdout)
    assert first["kv_loaded_tokens"] == 0 and again["kv_loaded_tokens"] == len(again["prompt_ids"]) - 1
    assert again["stats"]["prefilled_tokens"] == 1
    assert again["generated_ids"] == first["generated_ids"] == json.loads(plain.stdout)["generated_ids"]
