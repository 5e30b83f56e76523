"""DeepSeek V4's prompt format (its release ships a Python encoder, no chat template), rendered by the family's
``render_prompt``: each expected string below is written out by hand from the format the encoder describes
(BOS; system text and the tools section; ``<｜User｜>`` turns merging tool results; ``<｜Assistant｜>`` with
``<think>`` or ``</think>``; reasoning dropped before the last user turn unless there are tools; DSML calls; the
maximum-effort instruction). The server's use of it is tested in core (test_serve_agent_api.py)."""

from __future__ import annotations

import json

import pytest

from colibri.records import ResolvedModel
from colibri_deepseek_v4.encoding import EFFORT_MAX, OptionError, render
from colibri_deepseek_v4.plugin import render_prompt

B, E = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
U, A = "<｜User｜>", "<｜Assistant｜>"
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                            "parameters": {"type": "object", "properties": {"city": {}}}}}
TOOLS_HEAD = ('## Tools\n\nYou have access to a set of tools to help answer the user\'s question. You can invoke '
              'tools by writing a "<｜DSML｜tool_calls>" block like the following:\n\n')
SCHEMAS = ('### Available Tool Schemas\n\n{"name": "get_weather", "description": "Weather", "parameters": '
           '{"type": "object", "properties": {"city": {}}}}\n\nYou MUST strictly follow the above defined tool '
           'name and parameter schemas to invoke tool calls.\n')


def opts(**variables) -> dict:
    return {"add_generation_prompt": True, "template_kwargs": variables}


def call(cid: str, name: str, **arguments) -> dict:
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": arguments}}


def test_chat_mode_closes_thinking_at_once():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert render(messages, None, opts()) == f"{B}Be brief.{U}hi{A}</think>"


def test_thinking_mode_drops_earlier_reasoning():
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": "Hello", "reasoning_content": "greet"},
                {"role": "user", "content": "1+1=?"}]
    assert render(messages, None, opts(thinking=True)) == f"{B}{U}hi{A}</think>Hello{E}{U}1+1=?{A}<think>"
    assert render(messages, None, opts(thinking=True, drop_thinking=False)) == \
        f"{B}{U}hi{A}<think>greet</think>Hello{E}{U}1+1=?{A}<think>"
    assert render(messages, None, opts(thinking=False)) == f"{B}{U}hi{A}</think>Hello{E}{U}1+1=?{A}</think>"


def test_a_tool_loop_in_thinking_mode():
    messages = [{"role": "user", "content": "Weather in Köln?"},
                {"role": "assistant", "content": "", "reasoning_content": "use the tool",
                 "tool_calls": [call("a", "get_weather", city="Köln", days=3),
                                call("b", "get_weather", city="Bonn", opts={"u": "C"})]},
                {"role": "tool", "tool_call_id": "b", "content": "rain"},
                {"role": "tool", "tool_call_id": "a", "content": '{"t": 21}'},
                {"role": "user", "content": "And tomorrow?"}]
    got = render(messages, [WEATHER], opts(thinking=True))
    assert got.startswith(f"{B}\n\n{TOOLS_HEAD}<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"$TOOL_NAME\">\n")
    tools_end = got.index(SCHEMAS) + len(SCHEMAS)
    assert got[tools_end:] == (
        f"{U}Weather in Köln?{A}<think>use the tool</think>\n\n<｜DSML｜tool_calls>\n"
        '<｜DSML｜invoke name="get_weather">\n'
        '<｜DSML｜parameter name="city" string="true">Köln</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
        '<｜DSML｜invoke name="get_weather">\n'
        '<｜DSML｜parameter name="city" string="true">Bonn</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="opts" string="false">{"u": "C"}</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
        f"</｜DSML｜tool_calls>{E}"
        # results in the calls' order, the user's text in the same turn
        f'{U}<tool_result>{{"t": 21}}</tool_result>\n\n<tool_result>rain</tool_result>\n\nAnd tomorrow?{A}<think>')


def test_tools_join_an_existing_system_message():
    got = render([{"role": "system", "content": "S"}, {"role": "user", "content": "q"}], [WEATHER], opts())
    assert got.startswith(f"{B}S\n\n{TOOLS_HEAD}") and got.endswith(f"{SCHEMAS}{U}q{A}</think>")


def test_reasoning_effort_levels():
    messages = [{"role": "user", "content": "q"}]
    plain = render(messages, None, opts(thinking=True))
    assert render(messages, None, opts(thinking=True, reasoning_effort="max")) == f"{B}{EFFORT_MAX}{U}q{A}<think>"
    assert render(messages, None, opts(thinking=True, reasoning_effort="high")) == plain
    assert render(messages, None, opts(reasoning_effort="max")) == f"{B}{U}q{A}</think>"   # only when thinking
    assert EFFORT_MAX.startswith("Reasoning Effort: Absolute maximum with no shortcuts permitted.\n")
    with pytest.raises(OptionError) as err:
        render(messages, None, opts(reasoning_effort="low"))
    assert err.value.option == "reasoning_effort"
    with pytest.raises(OptionError) as err:
        render(messages, None, opts(enable_thinking=True))
    assert err.value.option == "chat_template_kwargs.enable_thinking"


def test_a_prefill_stays_open():
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The"}]
    assert render(messages, None, {"continue_final_message": True}) == f"{B}{U}hi{A}</think>The"
    assert render(messages, None, {"continue_final_message": True, "template_kwargs": {"thinking": True}}) == \
        f"{B}{U}hi{A}<think></think>The"


@pytest.fixture
def v4_dir(tmp_path):
    from colibri.testing.tiny import train_tokenizer

    train_tokenizer(tmp_path, "deepseek_v3")
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    del config["chat_template"]       # as released: the format is the encoder
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return tmp_path


def test_the_hook_answers_for_v4_without_a_template_only(v4_dir):
    messages = [{"role": "user", "content": "hi"}]
    v4 = ResolvedModel(v4_dir, "deepseek-v4", "deepseek_v4", {})
    assert render_prompt(v4, messages, None, opts()) == f"{B}{U}hi{A}</think>"
    assert render_prompt(ResolvedModel(v4_dir, "deepseek-v4", "deepseek_v3", {}), messages, None, opts()) is None
    (v4_dir / "chat_template.jinja").write_text("{{ messages[0].content }}")
    assert render_prompt(v4, messages, None, opts()) is None
