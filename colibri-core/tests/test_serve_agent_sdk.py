"""An unmodified agent framework from PyPI (the ``openai-agents`` SDK) completes a tool-using task against
``coli serve``'s app: teacher forcing makes the tiny model call the tool in GLM's real syntax, the SDK runs the
tool and sends its result back, and the model's answer ends the run. Both of the SDK's OpenAI models run it: the
Responses API one (its default) and the chat completions one. Tracing is off, so nothing leaves the machine."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from forcing_server import ForcingEngine, force_each, template_server

agents = pytest.importorskip("agents")
CALL = "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    forced = template_server("glm", tmp_path_factory)
    yield forced.server
    forced.server.stop()


@pytest.mark.parametrize("api", ["responses", "chat_completions"])
def test_openai_agents_sdk_completes_a_tool_task(served, api):
    from openai import AsyncOpenAI

    asked: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Current weather for a city."""
        asked.append(city)
        return f"21 C and sunny in {city}"

    agents.set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=served.base + "/v1", api_key="unused", max_retries=0)
    model_class = agents.OpenAIResponsesModel if api == "responses" else agents.OpenAIChatCompletionsModel
    agent = agents.Agent(name="weather", instructions="Answer with the weather.", tools=[get_weather],
                         model=model_class(model="tiny-glm", openai_client=client),
                         model_settings=agents.ModelSettings(temperature=0))
    force_each(served, [CALL, "It is 21 C and sunny in Paris."])
    ForcingEngine.prompts.clear()
    result = asyncio.run(agents.Runner.run(agent, "What is the weather in Paris?", max_turns=3))
    assert asked == ["Paris"]
    assert result.final_output == "It is 21 C and sunny in Paris."
    assert len(ForcingEngine.prompts) == 2
    second = served.codec.decode(ForcingEngine.prompts[1])
    assert "21 C and sunny in Paris" in second and "<arg_value>Paris</arg_value>" in second
