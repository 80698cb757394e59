"""The openai-agents SDK (pinned: openai-agents==0.24.0) runs a tool round trip against memrad on
Chat Completions and on Responses, whole and streamed (issue 20, item 6).

The engine is scripted (tests/unit/scripted_chat.py): the SDK, the openai client, memrad's
server, the tokenizer, template, tool format and reply parser are real; the model's reply
is chosen from what the prompt holds: call the tool, then answer from its result.
"""

from __future__ import annotations

import pytest
from aiohttp.test_utils import TestServer

agents = pytest.importorskip("agents")

from openai import AsyncOpenAI  # noqa: E402

from memrad.chat.chat import Chat  # noqa: E402
from memrad.config import Settings  # noqa: E402
from memrad.server.app import make_app  # noqa: E402
from scripted_chat import ScriptedChatEngine  # noqa: E402
from tiny import build_tokenizer  # noqa: E402

agents.set_tracing_disabled(True)  # the SDK would otherwise post traces to api.openai.com
ANSWER = "It is sunny in Paris."
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def reply(request) -> str:
    text = request.prompt_text
    return ANSWER if "<tool_response>" in text and "sunny" in text.rsplit("<tool_response>", 1)[1] else CALL


@agents.function_tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"sunny in {city}"


@pytest.fixture
async def served():
    engine = ScriptedChatEngine(Chat(build_tokenizer()), reply_for=reply)
    server = TestServer(make_app(Settings(), engine, "cpu", "float32"), host="127.0.0.1")
    await server.start_server()
    client = AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key="dummy", max_retries=0)
    try:
        yield engine, client
    finally:
        await client.close()
        await server.close()


def model_for(api: str, client: AsyncOpenAI):
    if api == "chat":
        return agents.OpenAIChatCompletionsModel(model="default", openai_client=client)
    return agents.OpenAIResponsesModel(model="default", openai_client=client)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("api", ["chat", "responses"])
async def test_an_agent_calls_its_tool_and_answers_from_the_result(served, api, stream):
    engine, client = served
    agent = agents.Agent(name="weather", instructions="Answer with the tool.", tools=[get_weather],
                         model=model_for(api, client))
    if stream:
        result = agents.Runner.run_streamed(agent, "What is the weather in Paris?")
        kinds = [event.type async for event in result.stream_events()]
        assert "raw_response_event" in kinds and "run_item_stream_event" in kinds
    else:
        result = await agents.Runner.run(agent, "What is the weather in Paris?")
    assert result.final_output == ANSWER
    calls = [item for item in result.new_items if item.type == "tool_call_item"]
    outputs = [item for item in result.new_items if item.type == "tool_call_output_item"]
    assert len(calls) == 1 and outputs[0].output == "sunny in Paris"
    assert len(engine.requests) == 2
    first, second = (request.prompt_text for request in engine.requests)
    # The SDK re-sends the call as memrad wrote it: turn 2 renders turn 1 as an exact prefix.
    assert second.startswith(first[:-len("<|im_start|>assistant\n")])
    assert CALL in second and "<tool_response>\nsunny in Paris\n</tool_response>" in second
