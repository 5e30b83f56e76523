"""``coli run`` / ``coli chat`` on a Qwen checkpoint through the real engine, and the ``--think/--no-think``
switch: passed to templates that read ``enable_thinking`` (Qwen3's), refused on templates that do not."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from typer.testing import CliRunner

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("transformers")

from colibri import plugins
from colibri.cli import app
from colibri.testing.tiny import tiny_model
from colibri.tokenizer import load_tokenizer_dir

# Qwen3's rule, reduced to what matters here: --no-think pre-fills an empty think block.
THINKING_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}"
    "{% endif %}")
EMPTY_THINK = "<think>\n\n</think>\n\n"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen-think")
    plain = tiny_model("qwen3_next", root, seed=3, chat_template_in="jinja").path
    thinking = root / "thinking"
    shutil.copytree(plain, thinking)
    (thinking / "chat_template.jinja").write_text(THINKING_TEMPLATE, encoding="utf-8")
    plugins.reset()
    return plain, thinking


def run(*args):
    return CliRunner().invoke(app, ["run", *map(str, args)], catch_exceptions=False)


@pytest.mark.parametrize("flag, expect_empty_block", [("--no-think", True), ("--think", False), (None, False)])
def test_think_flag_reaches_the_template(models, flag, expect_empty_block):
    _, thinking = models
    res = run("hello", "--model", thinking, "--json", "-n", 4, "--temp", 0, "--ctx", 128, "--threads", 1,
              *([flag] if flag else []))
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    text = load_tokenizer_dir(thinking).decode(data["prompt_ids"])
    assert text.endswith(EMPTY_THINK) == expect_empty_block, text
    assert data["family"] == "qwen" and len(data["generated_ids"]) == 4
    assert data["stats"]["reason"] == "length"


def test_think_flag_is_refused_without_a_switch(models):
    plain, _ = models
    res = run("hello", "--model", plain, "--think", "-n", 2, "--ctx", 128)
    assert res.exit_code != 0 and "enable_thinking" in res.output
    res = run("hello", "--model", plain, "--raw", "--no-think", "-n", 2, "--ctx", 128)
    assert res.exit_code != 0 and "--raw" in res.output


def test_chat_no_think_applies_to_every_turn(models):
    _, thinking = models
    res = CliRunner().invoke(app, ["chat", "--model", str(thinking), "--no-think", "--temp", "0", "--max-tokens", "3",
                                   "--ctx", "256", "--threads", "1"], input="hi\nagain\n", catch_exceptions=False)
    assert res.exit_code == 0, res.output
