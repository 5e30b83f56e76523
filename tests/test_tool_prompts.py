"""The render_prompt hook: a whole tool loop (call, tool result, answer) in each family's template renders byte
for byte as transformers' ``apply_chat_template`` renders it, and the thinking switch changes it as the template
says."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from colibri import plugins
from colibri.errors import UsageError
from colibri.records import ResolvedModel

sys.path.insert(0, str(Path(__file__).parent))
from family_syntax import FAMILIES, TOOLS

transformers = pytest.importorskip("transformers")


def call_id(family: str, name: str, index: int) -> str:
    return f"functions.{name}:{index}" if family == "kimi" else f"call_{index}"


def tool_loop(family: str) -> list[dict]:
    """user → assistant calls two tools (with reasoning) → two tool results → assistant answers."""
    return [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Weather in Köln, and search 'a < b'?"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "Two tools.",
         "tool_calls": [
             {"id": call_id(family, "get_weather", 0), "type": "function",
              "function": {"name": "get_weather", "arguments": {"city": "Köln", "days": 3}}},
             {"id": call_id(family, "search", 1), "type": "function",
              "function": {"name": "search", "arguments": {"query": "a < b", "filters": {"n": [1, 2]}}}}]},
        {"role": "tool", "tool_call_id": call_id(family, "get_weather", 0), "content": "{\"temp\": 21}"},
        {"role": "tool", "tool_call_id": call_id(family, "search", 1), "content": "no results"},
        {"role": "assistant", "content": "21 degrees; nothing found."},
        {"role": "user", "content": "Thanks"},
    ]


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    from colibri.testing.tiny import train_tokenizer

    made = {}
    for name, family in FAMILIES.items():
        out = tmp_path_factory.mktemp(name) / "tok"
        train_tokenizer(out, family.tiny_kind)
        (out / "chat_template.jinja").write_text(family.template, encoding="utf-8")
        made[name] = out
    return made


def render(name: str, directory: Path, messages, tools, **options) -> str:
    family = FAMILIES[name]
    pytest.importorskip(family.package)
    model = ResolvedModel(directory, family.name, family.tiny_kind, {})
    return plugins.family_hook(family.name, "render_prompt")(model=model, messages=messages, tools=tools,
                                                             options=options)


def variants(name: str) -> list[dict]:
    switch = FAMILIES[name].thinking_switch
    return [{}] + ([{switch: True}, {switch: False}] if switch else [])


@pytest.mark.parametrize("name", sorted(FAMILIES))
@pytest.mark.parametrize("steps", [3, 5, 6, 7])    # after the call, after the results, the answer, the next turn
def test_hook_render_prompt(family_dirs, name, steps):
    hf = transformers.AutoTokenizer.from_pretrained(str(family_dirs[name]))
    messages = tool_loop(name)[:steps]
    for kwargs in variants(name):
        for gen in (True, False):
            want = hf.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=gen, **kwargs)
            got = render(name, family_dirs[name], messages, TOOLS, add_generation_prompt=gen,
                         template_kwargs=kwargs)
            assert got == want, f"{name} {kwargs} gen={gen}"


@pytest.mark.parametrize("name", sorted(n for n in FAMILIES if FAMILIES[n].thinking_switch))
def test_thinking_switch_changes_the_prompt_as_the_template_does(family_dirs, name):
    switch = FAMILIES[name].thinking_switch
    messages = [{"role": "user", "content": "hi"}]
    on = render(name, family_dirs[name], messages, None, template_kwargs={switch: True})
    off = render(name, family_dirs[name], messages, None, template_kwargs={switch: False})
    assert on != off


def test_a_request_cannot_replace_the_renderers_own_variables(family_dirs):
    with pytest.raises(UsageError, match="'messages'"):
        render("qwen", family_dirs["qwen"], [{"role": "user", "content": "hi"}], None,
               template_kwargs={"messages": []})
