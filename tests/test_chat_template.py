"""Chat templates render byte-identically to transformers' apply_chat_template, and tokenize identically."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from colibri import chat_template as ct
from colibri.demo_tokenizer import stdlib_texts, train_bpe, write_tokenizer_files
from colibri.errors import ConfigError, UsageError
from colibri.tokenizer import load_tokenizer_dir

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

# OLMoE-Instruct / Tulu style: bos first, role headers, eos after each assistant turn.
OLMOE_STYLE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ '<|system|>\n' + message['content'] + '\n' }}"
    "{% elif message['role'] == 'user' %}{{ '<|user|>\n' + message['content'] + '\n' }}"
    "{% elif message['role'] == 'assistant' %}{% if not loop.last %}"
    "{{ '<|assistant|>\n' + message['content'] + eos_token + '\n' }}"
    "{% else %}{{ '<|assistant|>\n' + message['content'] + eos_token }}{% endif %}{% endif %}"
    "{% if loop.last and add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}{% endfor %}"
)

# Qwen3 style: tools as JSON, namespace bookkeeping, reasoning blocks, enable_thinking, whitespace control.
QWEN_STYLE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
    {{- "# Tools\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}{{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(last_query=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if message.role == "user" and message.content is string and not message.content.startswith('<tool_response>') %}
        {%- set ns.last_query = index %}
        {%- break %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.role == "user" or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set content = message.content if message.content is string else '' %}
        {%- set reasoning = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning = message.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query and reasoning %}
            {{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' + content }}
        {%- else %}
            {{- '<|im_start|>assistant\\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for call in message.tool_calls %}
                {{- '\\n<tool_call>\\n{"name": "' + call.function.name + '", "arguments": ' }}
                {{- call.function.arguments | tojson }}{{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}
    {%- elif message.role != "system" %}
        {{- raise_exception('unknown role ' + message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""

# A system-prompt template with a default system message, a date, dict(), and a {% generation %} block.
SYSTEM_STYLE = """{% set sys = dict(text="You are a helpful assistant.") %}
{% if messages[0]['role'] == 'system' %}
    {% set sys_text = messages[0]['content'] %}
    {% set rest = messages[1:] %}
{% else %}
    {% set sys_text = sys.text %}
    {% set rest = messages %}
{% endif %}
<|system|>
{{ sys_text }}
Today: {{ strftime_now("%Y") }}
{% for m in rest %}
    {% if m['role'] == 'assistant' %}
<|assistant|>
{% generation %}{{ m['content'] | trim }}{% endgeneration %}{{ eos_token }}
    {% else %}
<|{{ m['role'] }}|>
{{ m['content'] }}
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}<|assistant|>
{% endif %}"""

CONVERSATIONS = [
    [{"role": "user", "content": "Hello! Wie geht's? 日本語 😀"}],
    [{"role": "system", "content": "Be terse <b>&</b>."}, {"role": "user", "content": "2+2?"}],
    [{"role": "user", "content": "first"}, {"role": "assistant", "content": "  reply one  "},
     {"role": "user", "content": "second\nline"}],
    [{"role": "system", "content": "sys"}, {"role": "user", "content": "q"},
     {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nanswer"}, {"role": "user", "content": "again"}],
]

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather at <place> & time",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def trained():
    return train_bpe(stdlib_texts(300_000), 1200)


def make_dir(root: Path, trained, template=None, jinja_file: str | None = None) -> Path:
    d = root
    write_tokenizer_files(d, trained, chat_template=template)
    if jinja_file is not None:
        (d / "chat_template.jinja").write_text(jinja_file, encoding="utf-8")
    return d


def both(d: Path):
    return transformers.AutoTokenizer.from_pretrained(str(d)), load_tokenizer_dir(d)


@pytest.mark.parametrize("template", [OLMOE_STYLE, QWEN_STYLE, SYSTEM_STYLE], ids=["olmoe", "qwen", "system"])
@pytest.mark.parametrize("conv", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("gen_prompt", [True, False])
def test_render_is_byte_identical(tmp_path, trained, template, conv, gen_prompt):
    hf, mine = both(make_dir(tmp_path, trained, template))
    messages = CONVERSATIONS[conv]
    expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen_prompt)
    got = mine.render_chat(messages, add_generation_prompt=gen_prompt)
    assert got == expected
    assert mine.encode(got, add_special_tokens=False) == hf(expected, add_special_tokens=False).input_ids
    want_ids = hf(expected, add_special_tokens=False).input_ids
    assert mine.encode_chat(messages, add_generation_prompt=gen_prompt) == want_ids


@pytest.mark.parametrize("thinking", [True, False, None])
def test_qwen_enable_thinking_tools_and_reasoning(tmp_path, trained, thinking):
    hf, mine = both(make_dir(tmp_path, trained, QWEN_STYLE))
    messages = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "weather in Köln?"},
        {"role": "assistant", "content": None, "thinking": "need the tool",
         "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Köln"}}}]},
        {"role": "tool", "content": "{\"temp\": 3}"},
    ]
    kwargs = {} if thinking is None else {"enable_thinking": thinking}
    expected = hf.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=True, **kwargs)
    assert mine.render_chat(messages, tools=TOOLS, **kwargs) == expected
    assert "Köln" in expected and "<place> & time" in expected      # tojson: no ASCII or HTML escaping


def test_named_templates_and_jinja_file_precedence(tmp_path, trained):
    named = [{"name": "default", "template": OLMOE_STYLE}, {"name": "tool_use", "template": QWEN_STYLE}]
    d = make_dir(tmp_path / "named", trained, named)
    hf, mine = both(d)
    msgs = CONVERSATIONS[1]
    assert mine.render_chat(msgs) == hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert (mine.render_chat(msgs, tools=TOOLS)
            == hf.apply_chat_template(msgs, tools=TOOLS, tokenize=False, add_generation_prompt=True))
    d2 = make_dir(tmp_path / "file", trained, OLMOE_STYLE, jinja_file=SYSTEM_STYLE)
    hf2, mine2 = both(d2)
    assert mine2.render_chat(msgs) == hf2.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert "Today:" in mine2.render_chat(msgs)


def test_raise_exception_and_sandbox(tmp_path, trained):
    mine = load_tokenizer_dir(make_dir(tmp_path, trained, QWEN_STYLE))
    with pytest.raises(UsageError) as info:
        mine.render_chat([{"role": "robot", "content": "x"}])
    assert "unknown role robot" in info.value.message
    for src, why in [("{{ messages.__class__.__mro__ }}", "'__class__'"), ("{{ messages.append(1) }}", "'append'"),
                     ("{% set n = namespace(_x=1) %}{{ n._x }}", "'_x' is not allowed")]:
        with pytest.raises(UsageError) as info:
            ct.render(ct.ChatTemplate(src, "test"), [{"role": "user", "content": "x"}])
        assert why in info.value.message


def test_broken_template_is_a_config_error(tmp_path, trained):
    mine = load_tokenizer_dir(make_dir(tmp_path, trained, "{% for m in messages %}{{ m.content }"))
    with pytest.raises(ConfigError) as info:
        mine.render_chat([{"role": "user", "content": "x"}])
    assert "tokenizer_config.json" in info.value.message and "does not parse" in info.value.message


def test_no_template(tmp_path, trained):
    mine = load_tokenizer_dir(make_dir(tmp_path, trained, None))
    assert not mine.has_chat_template
    with pytest.raises(ConfigError):
        mine.render_chat([{"role": "user", "content": "x"}])


def test_special_tokens_and_stop_ids(tmp_path, trained):
    d = make_dir(tmp_path, trained, OLMOE_STYLE)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["eos_token"] = {"content": "<|assistant|>", "lstrip": False, "rstrip": False, "__type": "AddedToken"}
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 3]}))
    mine = load_tokenizer_dir(d, config={"eos_token_id": 1})
    assert mine.special_tokens["eos_token"] == "<|assistant|>"
    assert mine.stop_ids == (0, 3, 1, trained.token_to_id("<|assistant|>"))
    hf = transformers.AutoTokenizer.from_pretrained(str(d))
    msgs = CONVERSATIONS[2]
    assert mine.render_chat(msgs) == hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)


def test_raw_encoding_matches_transformers(tmp_path, trained):
    hf, mine = both(make_dir(tmp_path, trained, None))
    for text in ["plain ascii", "  leading spaces\n\ttabs", "ünïcödé 中文 🎉", "<|endoftext|> inside"]:
        assert mine.encode(text) == hf(text).input_ids
        assert mine.decode(mine.encode(text)) == hf.decode(hf(text).input_ids)
