"""Tool calls from each tool-calling family's real C engine: the engine is teacher-forced (the protocol's
``forced`` ids, which it reports as token events like sampled ones) to write the family's own tool-call syntax,
and the official ``openai`` and ``anthropic`` clients must receive the structured calls, streamed and not. The
checkpoints are tiny random models; the chat templates are the families' test templates (family_syntax.py)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import anthropic
import openai
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "colibri-core" / "tests"))  # core's harnesses
from family_syntax import FAMILIES, TOOLS
from forcing_server import ANTHROPIC_TOOLS, USER, force, forcing_server

# family -> the tiny checkpoint kind whose engine serves it
KINDS = {"glm": "glm4_moe_lite", "qwen": "qwen3_next", "deepseek-v4": "deepseek_v3", "kimi": "kimi_k2"}


@pytest.fixture(scope="module", params=sorted(KINDS))
def served(request, tiny_root, tmp_path_factory):
    family = FAMILIES[request.param]
    pytest.importorskip(family.package)
    from colibri.testing.tiny import tiny_model

    directory = tmp_path_factory.mktemp(request.param) / "tiny"
    shutil.copytree(tiny_model(KINDS[request.param], tiny_root).path, directory)
    (directory / "chat_template.jinja").write_text(family.template, encoding="utf-8")
    forced = forcing_server(family, directory, real=True)
    yield family, forced.server
    forced.server.stop()


def test_real_engine_tool_calls_reach_both_clients(served):
    family, server = served
    sample = next(s for s in family.samples if s.calls)
    thinks = sample.in_reasoning and bool(family.thinking_switch)
    extra = {"chat_template_kwargs": {family.thinking_switch: True}} if thinks else {}
    want = [(name, args) for name, args, _ in sample.calls]
    force(server, sample.text)
    client = openai.OpenAI(base_url=server.base + "/v1", api_key="x", max_retries=0, timeout=120)
    reply = client.chat.completions.create(model="m", messages=USER, tools=TOOLS, temperature=0, extra_body=extra)
    assert reply.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in reply.choices[0].message.tool_calls] == want
    calls: dict[int, dict] = {}
    for chunk in client.chat.completions.create(model="m", messages=USER, tools=TOOLS, temperature=0, stream=True,
                                                extra_body=extra):
        for call in chunk.choices[0].delta.tool_calls or []:
            entry = calls.setdefault(call.index, {"name": "", "arguments": ""})
            entry["name"] += call.function.name or ""
            entry["arguments"] += call.function.arguments or ""
    assert [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())] == want

    messages = anthropic.Anthropic(base_url=server.base, api_key="x", max_retries=0, timeout=120).messages
    thinking = {"thinking": {"type": "enabled", "budget_tokens": 1024}} if thinks else {}
    replied = messages.create(model="m", max_tokens=2048, messages=USER, tools=ANTHROPIC_TOOLS, **thinking)
    with messages.stream(model="m", max_tokens=2048, messages=USER, tools=ANTHROPIC_TOOLS, **thinking) as stream:
        streamed = stream.get_final_message()
    for message in (replied, streamed):
        assert message.stop_reason == "tool_use"
        assert [(b.name, b.input) for b in message.content if b.type == "tool_use"] == want
