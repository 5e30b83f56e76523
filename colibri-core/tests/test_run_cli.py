"""``coli run`` end to end against the fake engine: prompt ids, streamed text, stats, JSON, and refusals."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from colibri import ctx_choice, launch, plugins
from colibri.cli import app
from colibri.demo_tokenizer import stdlib_texts, train_bpe
from colibri.inventory import load_facts
from colibri.model import resolve_model
from colibri.tokenizer import load_tokenizer_dir

sys.path.insert(0, str(Path(__file__).resolve().parent))  # --import-mode=importlib adds no test dir
from fakefamily import MAX_CONTEXT, install_engine_wrapper, make_checkpoint, register


def expected_tokens(prompt, n, vocab, stop=()):
    out = []
    for i in range(n):
        tok = (sum(prompt) * 31 + i * 7 + 3) % vocab
        out.append(tok)
        if tok in stop:
            break
    return out


@pytest.fixture(scope="module")
def trained():
    return train_bpe(stdlib_texts(200_000), 700)


@pytest.fixture
def fake(tmp_path, monkeypatch, trained):
    monkeypatch.setenv("COLIBRI_LOAD_PLUGINS", "")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("FAKE_ENGINE_BIN", str(install_engine_wrapper(tmp_path)))
    monkeypatch.delenv("FAKE_ENGINE_MODE", raising=False)
    plugins.reset()
    register()
    model = make_checkpoint(tmp_path / "model", trained)
    yield model
    plugins.reset()


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args], catch_exceptions=False)


def test_json_raw_prompt_ids_and_generated_ids(fake):
    tok = load_tokenizer_dir(fake)
    res = invoke("run", "def hello(world):", "--model", fake, "--raw", "--json", "--max-tokens", 12,
                 "--temp", 0, "--ctx", 128, "--ram", 1)
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["mode"] == "raw"
    assert data["prompt_ids"] == tok.encode("def hello(world):")
    vocab = tok.vocab_size
    want = expected_tokens(data["prompt_ids"], 12, vocab, stop=tok.stop_ids)
    assert data["generated_ids"] == want
    assert data["text"] == tok.decode([t for t in want if t not in tok.stop_ids], skip_special_tokens=True)
    assert data["stats"]["hit_rate"] == 0.75 and data["stats"]["generated_tokens"] == len(want)
    assert data["ctx"] == 128 and data["sampling"]["temperature"] == 0.0
    assert data["cap"] == 4                        # 1 GiB holds every fake expert


def test_chat_mode_uses_the_template_and_streams_text(fake):
    tok = load_tokenizer_dir(fake)
    res = invoke("run", "Grüß dich", "--model", fake, "--max-tokens", 8, "--temp", 0, "--ctx", 128)
    assert res.exit_code == 0, res.output
    rendered = tok.render_chat([{"role": "user", "content": "Grüß dich"}])
    ids = tok.encode(rendered, add_special_tokens=False)
    want = expected_tokens(ids, 8, tok.vocab_size, stop=tok.stop_ids)
    text = tok.decode([t for t in want if t not in tok.stop_ids], skip_special_tokens=True)
    assert res.stdout == text + ("" if text.endswith("\n") else "\n")
    line = res.stderr.strip().splitlines()[-1]
    for part in (f"prefill {len(ids)} tok @ 1000.0 tok/s", "decode 8 tok @ 100.0 tok/s", "expert hit rate 75.0%",
                 "RSS 50.00 MiB"):
        assert part in line


def test_no_template_falls_back_with_a_notice(fake, trained, tmp_path):
    bare = make_checkpoint(tmp_path / "bare", trained, chat_template=None)
    res = invoke("run", "hello", "--model", bare, "--json", "--max-tokens", 2)
    assert res.exit_code == 0, res.output
    assert "no chat template" in res.stderr
    assert json.loads(res.stdout)["mode"] == "raw"


def test_prompt_file(fake, tmp_path):
    good = tmp_path / "p.txt"
    good.write_text("from a file ✓", encoding="utf-8")
    res = invoke("run", "--prompt-file", good, "--model", fake, "--raw", "--json", "--max-tokens", 1)
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["prompt_ids"] == load_tokenizer_dir(fake).encode("from a file ✓")
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf\xe9".encode("latin-1"))
    res = invoke("run", "--prompt-file", bad, "--model", fake)
    assert res.exit_code == 1
    err = res.stderr.strip()
    assert err.count("\n") == 0 and "latin1.txt" in err and "not UTF-8" in err and "0xe9 at offset 3" in err


@pytest.mark.parametrize("args,needle", [
    (["--ctx", MAX_CONTEXT + 1], f"--ctx {MAX_CONTEXT + 1} exceeds"),
    (["--ctx", 0], "--ctx 0"),
    (["--temp", -1], "--temp -1"),
    (["--top-p", 0], "--top-p 0"),
    (["--ram", 0.00001], "does not fit"),
    (["--cap", -2], "--cap -2"),
])
def test_flags_past_limits_are_refused(fake, args, needle):
    res = invoke("run", "hi", "--model", fake, *args)
    assert res.exit_code == 1
    assert needle in res.stderr and res.stderr.startswith("error: ") and res.stderr.count("\n") == 1


def test_usage_errors(fake):
    res = invoke("run", "--model", fake)
    assert res.exit_code == 1 and "no prompt given" in res.stderr
    res = invoke("run", "x", "--model", fake, "--prompt-file", "/dev/null")
    assert res.exit_code == 1 and "both a PROMPT and --prompt-file" in res.stderr


def test_max_tokens_is_clamped_to_the_context(fake):
    res = invoke("run", "hi", "--model", fake, "--raw", "--json", "--ctx", 16, "--max-tokens", 1000, "--temp", 0)
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert "clamped" in res.stderr
    assert len(data["generated_ids"]) <= 16 - len(data["prompt_ids"])


def test_engine_death_is_one_line(fake, monkeypatch):
    monkeypatch.setenv("FAKE_ENGINE_MODE", "sigkill_on_load")
    res = invoke("run", "hi", "--model", fake, "--ram", 1)
    assert res.exit_code == 1
    assert "SIGKILL while loading" in res.stderr and "OOM killer" in res.stderr and res.stderr.count("\n") == 1


def test_hook_load_tokenizer_default_and_family_override(fake, trained):
    """Core's default reads the directory; a family answering the hook wins, and `coli run` uses its answer."""
    from colibri import hookimpl
    from colibri.chat_template import ChatTemplate
    from colibri.inventory import family_answer
    from colibri.model import resolve_model
    from colibri.tokenizer import TextTokenizer

    model = resolve_model(fake)
    default = family_answer(model, "load_tokenizer")
    assert isinstance(default, TextTokenizer) and default.has_chat_template
    assert default.encode("abc") == load_tokenizer_dir(fake).encode("abc")

    class OwnPromptFormat:
        @hookimpl
        def load_tokenizer(self, model):
            tok = load_tokenizer_dir(model.path)
            tok.templates = {"default": ChatTemplate("[[{{ messages[-1]['content'] }}]]", "family plugin")}
            return tok

    plugins.manager().register(OwnPromptFormat(), name="fakemoe-tokenizer")
    try:
        # Restricted to the claiming family: another plugin's answer must not leak in.
        assert family_answer(model, "load_tokenizer").templates == default.templates
    finally:
        plugins.manager().unregister(name="fakemoe-tokenizer")

    family_plugin = plugins.manager().get_plugin("fakemoe")
    family_plugin.load_tokenizer = OwnPromptFormat().load_tokenizer
    plugins.manager().unregister(name="fakemoe")
    plugins.manager().register(family_plugin, name="fakemoe")
    res = invoke("run", "hey", "--model", fake, "--json", "--max-tokens", 1)
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["prompt_ids"] == default.encode("[[hey]]", add_special_tokens=False)


def test_ctrl_c_stops_generation_prints_stats_and_exits_130(fake, tmp_path):
    import os
    import signal
    import subprocess
    import time

    env = {**os.environ, "PYTHONUNBUFFERED": "1", "FAKE_TOKEN_DELAY": "0.05"}
    proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("fakefamily.py")), "run", "tell a story",
                             "--model", str(fake), "--max-tokens", "200", "--temp", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True,
                            # as a user at a terminal has it, even when this suite runs in the background of a
                            # non-interactive shell (which starts it with SIGINT ignored)
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert proc.stdout.read(1)   # text is streaming
    time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    line = err.strip().splitlines()[-1]
    assert "cancelled" in line
    generated = int(__import__("re").search(r"decode (\d+) tok", line).group(1))
    assert 0 < generated < 200


def test_coli_run_without_ctx_fits_a_budget_the_default_context_does_not(fake, monkeypatch):
    """The fake's default context is 256; at a 32-position step the run's KV is a few rows, so a budget that holds
    every expert at 32 positions holds none at 256: the run starts, says why, and its tokens stream as usual."""
    monkeypatch.setattr(ctx_choice, "CTX_STEP", 32)
    facts = load_facts(resolve_model(str(fake)))
    at32 = launch.plan_at(facts, 1 << 40, 32, 1, None)
    ram = at32.dense_bytes + at32.kv_bytes + at32.state_bytes + at32.reserve_bytes + 4 * at32.expert_bytes + 100
    assert launch.plan_at(facts, ram, 256, 1, None).cache_slots_per_layer == 0     # the default context: no room
    args = ["run", "hello", "--model", fake, "--raw", "--json", "--max-tokens", 12, "--temp", 0,
            "--ram", repr(ram / launch.GIB)]
    res = invoke(*args)
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["ctx"] == 32 and data["cap"] == 4 and len(data["generated_ids"]) == 12
    assert "warning: ctx 256 -> 32 to keep 4 expert slots per layer (0 at ctx 256)" in res.stderr
    assert "pass --ctx to choose" in res.stderr
    explicit = invoke(*args, "--ctx", 256)
    assert explicit.exit_code == 1 and "does not fit" in explicit.output    # an explicit --ctx is obeyed
