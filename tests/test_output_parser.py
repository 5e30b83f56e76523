"""The streaming output parser: every family's real tool-call and reasoning syntax, fed in chunks split at every
possible boundary, gives the same events as the whole text, and no partial marker ever reaches the client."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from colibri import plugins
from colibri.output_parser import (
    CONTENT, REASONING, OutputParser, OutputSyntax, TextEvent, ToolCallEvent, collect, merge_events,
    prompt_opens_reasoning,
)
from colibri.records import ResolvedModel

sys.path.insert(0, str(Path(__file__).parent))
from family_syntax import FAMILIES, TOOLS

CASES = [(name, i) for name, family in FAMILIES.items() for i in range(len(family.samples))]


def family_parser(name: str) -> OutputParser:
    family = FAMILIES[name]
    pytest.importorskip(family.package)
    model = ResolvedModel(Path("/nonexistent"), family.name, family.tiny_kind, {})
    parser = plugins.family_hook(family.name, "parse_output")(model=model)
    assert isinstance(parser, OutputParser), f"{name}: parse_output gave {parser!r}"
    return parser


def run(name: str, chunks: list[str], in_reasoning: bool) -> list:
    parser = family_parser(name).begin(TOOLS, in_reasoning)
    events = []
    for chunk in chunks:
        events += parser.feed(chunk)
    return events + parser.finish()


@pytest.mark.parametrize("name,index", CASES)
def test_hook_parse_output(name, index):
    sample = FAMILIES[name].samples[index]
    got = collect(run(name, [sample.text], sample.in_reasoning))
    assert got.reasoning == sample.reasoning
    assert got.content == sample.content
    calls = [(c.name, json.loads(c.arguments), c.id) for c in got.tool_calls]
    assert calls == [(n, a, i) for n, a, i in sample.calls]


@pytest.mark.parametrize("name,index", CASES)
def test_every_chunking_gives_the_same_events(name, index):
    sample = FAMILIES[name].samples[index]
    whole = merge_events(run(name, [sample.text], sample.in_reasoning))
    text = sample.text
    splittings = [[text[:i], text[i:]] for i in range(1, len(text))]
    splittings.append(list(text))                                   # one character at a time
    splittings += [[text[:i], text[i:j], text[j:]] for i in range(1, len(text), 7) for j in range(i + 1, len(text), 5)]
    for chunks in splittings:
        events = run(name, chunks, sample.in_reasoning)
        assert merge_events(events) == whole, f"split {[len(c) for c in chunks]}"


def test_partial_markers_are_held_back_until_settled():
    parser = family_parser("qwen").begin(TOOLS)
    assert parser.feed("Sure <tool") == [TextEvent(CONTENT, "Sure")]     # " <tool" could begin a call
    assert parser.feed("box> x") == [TextEvent(CONTENT, " <toolbox> x")]
    assert parser.feed("<tool_call>\n{\"name\": \"search\", \"argu") == []
    events = parser.feed("ments\": {}}\n</tool_call>")
    assert events == [ToolCallEvent(0, events[0].call)] and events[0].call.name == "search"
    assert parser.finish() == []


def test_a_string_typed_argument_stays_text_and_others_are_json():
    parser = family_parser("glm").begin(TOOLS)
    events = parser.feed("<tool_call>get_weather<arg_key>city</arg_key><arg_value>123</arg_value><arg_key>days"
                         "</arg_key><arg_value>7</arg_value></tool_call>") + parser.finish()
    assert json.loads(events[0].call.arguments) == {"city": "123", "days": 7}


def test_tool_choice_none_leaves_calls_as_text():
    parser = family_parser("glm").begin(TOOLS).without_tools()
    text = "<tool_call>search<arg_key>query</arg_key><arg_value>x</arg_value></tool_call>"
    assert collect(parser.feed(text) + parser.finish()).content == text


def test_reasoning_open_in_the_prompt():
    syntax = OutputSyntax("<think>", "</think>")
    assert prompt_opens_reasoning(syntax, "<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_reasoning(syntax, "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_reasoning(OutputSyntax(), "<think>")
    parser = OutputParser(syntax).begin(in_reasoning=True)
    assert merge_events(parser.feed("a</thi") + parser.feed("nk>b") + parser.finish()) == [
        TextEvent(REASONING, "a"), TextEvent(CONTENT, "b")]
    # a model that opens the block the prompt already opened: the second <think> is not reasoning text
    parser = OutputParser(syntax).begin(in_reasoning=True)
    assert merge_events(parser.feed("\n<thi") + parser.feed("nk>\na <think> b</think>c") + parser.finish()) == [
        TextEvent(REASONING, "a <think> b"), TextEvent(CONTENT, "c")]


def test_a_reply_without_markers_is_unchanged():
    text = "\n\n  Plain text, a < b, <b>bold</b>, ends in spaces  \n"
    for name in FAMILIES:
        parser = family_parser(name).begin(TOOLS)
        events = [e for chunk in text for e in parser.feed(chunk)] + parser.finish()
        assert collect(events).content == text
