"""Agent frameworks on their default Responses-API models against the real server: the
``openai-agents`` SDK (``OpenAIResponsesModel``, its default) running an Agent with a function
tool through ``Runner.run_sync`` and ``Runner.run_streamed``, and pydantic-ai's
``OpenAIResponsesModel`` with a plain and a structured-output request.

The answers are a 135M model's: the tests assert the run's shape (a tool call, its output, a
final message; an output that validates), not its wisdom. Sampling is greedy and bounded so a
run is repeatable: sampled, the small model sometimes writes to the context's end, which both
frameworks rightly raise on (``status: incomplete``). The first turn's ``tool_choice`` is
``required`` so the function tool is exercised every time; the Agents SDK resets it to ``auto``
after the call (its default ``reset_tool_choice``), so the second turn ends with a message.
"""
from __future__ import annotations

import asyncio

import pytest
from pydantic import BaseModel

pytestmark = pytest.mark.slow

pytest.importorskip("agents")
pytest.importorskip("pydantic_ai")

ASK = "What is the weather in Paris?"


def get_weather(city: str) -> str:
    """Current weather in a city."""
    return f"Sunny in {city}"


@pytest.fixture
def weather_agent(live_server):
    from agents import Agent, ModelSettings, function_tool, set_tracing_disabled

    set_tracing_disabled(True)
    return Agent(name="helper", instructions="You answer briefly.", model=live_server.model,
                 tools=[function_tool(get_weather)],
                 model_settings=ModelSettings(temperature=0, tool_choice="required", max_tokens=200))


def use_kvserve(live_server) -> None:
    """The SDK's default client, pointed at kvserve. AsyncOpenAI binds to its event loop: one per run."""
    from agents import set_default_openai_client
    from openai import AsyncOpenAI

    set_default_openai_client(AsyncOpenAI(base_url=live_server.v1, api_key=live_server.api_key, max_retries=0,
                                          timeout=120), use_for_tracing=False)


def assert_tool_then_message(items) -> None:
    kinds = [type(i).__name__ for i in items]
    assert kinds[:2] == ["ToolCallItem", "ToolCallOutputItem"] and kinds[-1] == "MessageOutputItem", kinds
    assert items[0].raw_item.name == "get_weather" and items[1].output.startswith("Sunny in ")


def test_openai_agents_run_sync(live_server, weather_agent):
    from agents import Runner

    use_kvserve(live_server)
    result = Runner.run_sync(weather_agent, ASK, max_turns=4)
    assert isinstance(result.final_output, str) and result.final_output.strip()
    assert_tool_then_message(result.new_items)
    assert result.raw_responses[-1].response_id.startswith("resp_")


def test_openai_agents_run_streamed(live_server, weather_agent):
    from agents import Runner

    async def run():
        use_kvserve(live_server)
        result = Runner.run_streamed(weather_agent, ASK, max_turns=4)
        events = [event async for event in result.stream_events()]
        return result, events

    result, events = asyncio.run(run())
    assert isinstance(result.final_output, str) and result.final_output.strip()
    assert_tool_then_message(result.new_items)
    raw = [e.data.type for e in events if e.type == "raw_response_event"]
    assert raw.count("response.completed") == 2 and "response.output_text.delta" in raw, raw
    streamed = "".join(e.data.delta for e in events
                       if e.type == "raw_response_event" and e.data.type == "response.output_text.delta")
    assert streamed == result.final_output


def responses_model(live_server):
    from pydantic_ai.models.openai import OpenAIResponsesModel
    from pydantic_ai.providers.openai import OpenAIProvider

    return OpenAIResponsesModel(live_server.model, provider=OpenAIProvider(base_url=live_server.v1,
                                                                           api_key=live_server.api_key))


def test_pydantic_ai_responses_plain(live_server):
    from pydantic_ai import Agent

    agent = Agent(responses_model(live_server), model_settings={"temperature": 0, "max_tokens": 64})
    result = agent.run_sync("Name a color.")
    assert isinstance(result.output, str) and result.output.strip()
    assert result.usage.input_tokens > 0 and result.usage.output_tokens > 0


class City(BaseModel):
    name: str
    country: str


def test_pydantic_ai_responses_structured_output(live_server):
    from pydantic_ai import Agent

    agent = Agent(responses_model(live_server), output_type=City,
                  model_settings={"temperature": 0, "max_tokens": 200})
    result = agent.run_sync("Paris is a city in France. Extract it.")
    assert isinstance(result.output, City) and result.output.name and result.output.country
