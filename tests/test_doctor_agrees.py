"""``coli doctor`` passes exactly what ``run``/``chat``/``serve`` can load, and says what they say: a checkpoint
whose tokenizer is GPT-2-style ``vocab.json`` + ``merges.txt`` loads (tokenized as transformers tokenizes it), a
sentencepiece ``tokenizer.model`` alone fails everywhere with the command that writes tokenizer.json, and a model
without a chat template gets the same sentence from doctor, run, chat and serve. Through the installed script."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

pytest.importorskip("colibri_olmoe")

from colibri.builder import build_family
from colibri.prompt import NO_TEMPLATE_FIX, NO_TEMPLATE_NOTICE
from colibri.testing.tiny import tiny_model
from test_cli_bad_input import coli, one_error_line

GREEDY = ("--temp", "0", "--max-tokens", "8")
TEXTS = ("def fibonacci(n):\n    return n  # ünïcode ✓ 😀", "  leading spaces\tand tabs", "a" * 40)


@pytest.fixture(scope="module")
def original(tmp_path_factory) -> Path:
    build_family("olmoe")
    return tiny_model("olmoe", tmp_path_factory.mktemp("agree"), seed=5).path


def copy_of(model: Path, directory: Path) -> Path:
    shutil.copytree(model, directory)
    return directory


def as_vocab_and_merges(directory: Path, tokenizer_class: str = "GPT2Tokenizer") -> None:
    """Replace tokenizer.json by the files a slow GPT-2 tokenizer reads (what older checkpoints ship)."""
    from tokenizers import Tokenizer

    data = json.loads((directory / "tokenizer.json").read_text())
    Tokenizer.from_file(str(directory / "tokenizer.json")).model.save(str(directory))
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["tokenizer_class"] = tokenizer_class
    config["added_tokens_decoder"] = {str(t["id"]): {k: t[k] for k in ("content", "lstrip", "rstrip", "normalized",
                                                                       "single_word", "special")}
                                      for t in data["added_tokens"]}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    (directory / "tokenizer.json").unlink()


def statuses(model: Path) -> dict[str, dict]:
    done = coli("doctor", "--json", "--model", str(model))
    return {c["name"]: c for c in json.loads(done.stdout)["checks"]}


@pytest.mark.parametrize("tokenizer_class", ["GPT2Tokenizer", "Qwen2Tokenizer"])
def test_vocab_and_merges_load_as_transformers_tokenizes_them(original, tmp_path, tokenizer_class):
    """GPT-2's split rule, and Qwen2's (NFC, then its own regex: e.g. a Qwen-Image pipeline's tokenizer/)."""
    import transformers

    from colibri.tokenizer import load_tokenizer_dir

    converted = copy_of(original, tmp_path / "bpe")
    as_vocab_and_merges(converted, tokenizer_class)
    ours, theirs = load_tokenizer_dir(converted), transformers.AutoTokenizer.from_pretrained(str(converted))
    assert type(theirs).__name__.startswith(tokenizer_class)
    reference = load_tokenizer_dir(original)
    specials = "".join(reference.special_tokens.values())
    for text in (*TEXTS, f"{specials}x{specials}", "(n) 12345 caf\u0065\u0301 it's\r\n\n  x"):
        ids = theirs(text)["input_ids"]
        assert ours.encode(text) == ids, text
        if tokenizer_class == "GPT2Tokenizer":   # the tokenizer.json it came from splits as GPT-2 does
            assert ids == reference.encode(text), text
        assert ours.decode(ids) == theirs.decode(ids)
        assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(ids, skip_special_tokens=True)
    assert ours.stop_ids == reference.stop_ids and ours.has_chat_template


def test_doctor_and_run_accept_vocab_and_merges(original, tmp_path):
    converted = copy_of(original, tmp_path / "bpe")
    as_vocab_and_merges(converted)
    checks = statuses(converted)
    assert checks["tokenizer"]["status"] == "pass" and "vocab.json" in checks["tokenizer"]["detail"]
    assert checks["chat template"]["status"] == "pass"
    for mode in ("--raw", "--chat"):
        here = coli("run", "def fibonacci(n):", "--model", str(converted), mode, *GREEDY)
        there = coli("run", "def fibonacci(n):", "--model", str(original), mode, *GREEDY)
        assert here.returncode == there.returncode == 0, here.stderr + there.stderr
        assert here.stdout == there.stdout


def test_vocab_and_merges_of_another_tokenizer_class_fail_everywhere_with_the_fix(original, tmp_path):
    other = copy_of(original, tmp_path / "other")
    as_vocab_and_merges(other, tokenizer_class="SomeOtherBPETokenizer")
    check = statuses(other)["tokenizer"]
    assert check["status"] == "fail" and "SomeOtherBPETokenizer" in check["detail"]
    done = coli("run", "hi", "--model", str(other))
    run = one_error_line(done.stderr, done.returncode)
    assert run == f"error: {check['detail']}" and "save_pretrained" in run


def test_a_sentencepiece_model_alone_fails_everywhere_with_the_fix(original, tmp_path):
    sp = copy_of(original, tmp_path / "sp")
    (sp / "tokenizer.json").unlink()
    (sp / "tokenizer.model").write_bytes(b"\x0a\x00")
    check = statuses(sp)["tokenizer"]
    assert check["status"] == "fail" and "tokenizer.model" in check["detail"] and "save_pretrained" in check["detail"]
    done = coli("doctor", "--model", str(sp))
    assert done.returncode == 1
    for command in (["run", "hi"], ["chat"], ["serve", "--port", "1"]):
        done = coli(*command, "--model", str(sp))
        assert one_error_line(done.stderr, done.returncode) == f"error: {check['detail']}", command


def test_no_chat_template_is_said_the_same_way_everywhere(original, tmp_path):
    bare = copy_of(original, tmp_path / "bare")
    config = json.loads((bare / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (bare / "tokenizer_config.json").write_text(json.dumps(config))
    check = statuses(bare)["chat template"]
    assert check["status"] == "warn" and check["detail"] == f"{bare}: {NO_TEMPLATE_NOTICE}"
    run = coli("run", "hi", "--model", str(bare), *GREEDY)
    assert run.returncode == 0 and f"warning: {NO_TEMPLATE_NOTICE}" in run.stderr.splitlines()
    chat = coli("chat", "--model", str(bare), "--temp", "0", "--max-tokens", "4", stdin="hello\n")
    assert chat.returncode == 0 and f"warning: {NO_TEMPLATE_NOTICE}" in chat.stderr.splitlines()


def test_serve_chat_route_says_what_to_do_without_a_template(original, tmp_path):
    from colibri.errors import ConfigError
    from colibri.server.codec import TokenizerCodec
    from colibri.tokenizer import load_tokenizer_dir

    bare = copy_of(original, tmp_path / "bare")
    config = json.loads((bare / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (bare / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError) as info:
        TokenizerCodec(load_tokenizer_dir(bare)).chat_ids([{"role": "user", "content": "hi"}])
    assert info.value.hint == NO_TEMPLATE_FIX and "/v1/completions" in NO_TEMPLATE_FIX


@pytest.mark.parametrize("family", ["qwen", "image"])
def test_each_family_that_knows_qwen2_tokenizer_splits_as_transformers(original, tmp_path, monkeypatch, family):
    """colibri-qwen and colibri-image each answer byte_level_split for Qwen2Tokenizer (a Qwen-Image pipeline's
    tokenizer/): with only one of them installed, the converted files still tokenize as transformers does."""
    import transformers

    from colibri import plugins
    from colibri.tokenizer import load_tokenizer_dir

    pytest.importorskip(f"colibri_{family}")
    monkeypatch.setenv("COLIBRI_DISABLE_PLUGINS", {"qwen": "image", "image": "qwen"}[family])
    plugins.reset()
    try:
        converted = copy_of(original, tmp_path / "bpe")
        as_vocab_and_merges(converted, "Qwen2Tokenizer")
        ours, theirs = load_tokenizer_dir(converted), transformers.AutoTokenizer.from_pretrained(str(converted))
        for text in (*TEXTS, "(n) 12345 caf\u0065\u0301 it's\r\n\n  x"):
            assert ours.encode(text) == theirs(text)["input_ids"], text
    finally:
        monkeypatch.delenv("COLIBRI_DISABLE_PLUGINS")
        plugins.reset()
