"""Tools on a real model whose chat template has no tool format: Gemma 3 270M gets memra's
convention in its own turns (definitions in the first user turn, `<tool_call>` JSON, results
as `tool` turns), and a tool round trip works on all three APIs through the real clients,
with a scripted next token behind the real server (prefill, parsing, parking stay real).
Fingerprints still split at Gemma's turn markers, and turning `tools.fallback` off brings
the 400 back.

Needs `memrad pull gemma3-270m` once; skipped until then (tests never download weights)."""

from __future__ import annotations

import json

import openai
import pytest
from aiohttp.test_utils import TestServer

from memrad.config import Settings
from memrad.engine.engine import Engine, EngineOptions
from memrad.reuse.fingerprint import segment_spans
from memrad.reuse.pool import ReusePool
from memrad.server.app import make_app
from scripted import (CALL_REPLY, CHAT_TOOLS, MESSAGES_TOOLS, RESPONSES_TOOLS, ScriptedEngine, chat_stream_parts,
                      claude, messages_answer, oai)
from test_gemma_boundaries import gemma_loaded  # noqa: F401 (the fixture)

pytestmark = pytest.mark.integration

RESULT = "def add(a, b):\n    return a + b"
QUESTION = "What does src/a.py do?"
SYSTEM = "You are a coding agent."


@pytest.fixture
async def served(gemma_loaded):  # noqa: F811
    engine = ScriptedEngine(gemma_loaded, EngineOptions(256, 2), ReusePool(8, 2**31))
    server = TestServer(make_app(Settings(), engine, "cpu", "float32"), host="127.0.0.1")
    await server.start_server()
    yield engine, server
    await server.close()


def prompt_text(engine, index=-1) -> str:
    return engine.loaded.tokenizer.decode(list(engine.prompts[index]))


def check_result_turn(engine) -> None:
    """The follow-up renders the model's call and the client's result in Gemma's own turns,
    and its fingerprint splits there: one segment per turn, each opened by <start_of_turn>."""
    text = prompt_text(engine)
    assert text.startswith(f"<bos><start_of_turn>user\n{SYSTEM}\n\n# Tools\n\n")
    assert ("Let me read it.\n<tool_call>\n{\"name\": \"read_file\", \"arguments\": {\"path\": \"src/a.py\"}}\n"
            "</tool_call><end_of_turn>\n<start_of_turn>tool\n" + RESULT + "<end_of_turn>\n"
            "<start_of_turn>model\n") in text
    ids = list(engine.prompts[-1])
    spans = segment_spans(ids, engine.openers)
    decode = engine.loaded.tokenizer.decode
    heads = [decode(ids[a:b]).split("\n", 1)[0] for a, b in spans]
    assert heads == ["<bos><start_of_turn>user", "<start_of_turn>model", "<start_of_turn>tool",
                     "<start_of_turn>model"]


async def test_chat_completions_tool_round_trip_on_gemma_streamed(served):
    engine, server = served
    client = oai(server)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    engine.script(CALL_REPLY, "It adds two numbers.")
    chunks = [c async for c in await client.chat.completions.create(
        model="gemma3-270m", messages=messages, tools=CHAT_TOOLS, temperature=0, stream=True)]
    reasoning, content, calls, finish = chat_stream_parts(chunks)
    call_id, name = calls[0].id, calls[0].function.name
    arguments = "".join(tc.function.arguments or "" for tc in calls)
    assert (reasoning, content, name, json.loads(arguments), finish) == (
        "I should look at the file.", "Let me read it.", "read_file", {"path": "src/a.py"}, "tool_calls")
    first = prompt_text(engine)
    assert first.endswith(f"{QUESTION}<end_of_turn>\n<start_of_turn>model\n") and '"name": "read_file"' in first
    messages += [{"role": "assistant", "content": content, "tool_calls": [
                     {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}]},
                 {"role": "tool", "tool_call_id": call_id, "content": RESULT}]
    final = await client.chat.completions.create(model="gemma3-270m", messages=messages, tools=CHAT_TOOLS,
                                                 temperature=0)
    assert (final.choices[0].message.content, final.choices[0].finish_reason) == ("It adds two numbers.", "stop")
    assert final.usage.prompt_tokens_details.cached_tokens == len(engine.prompts[0])
    check_result_turn(engine)


async def test_responses_tool_round_trip_on_gemma(served):
    engine, server = served
    client = oai(server)
    engine.script(CALL_REPLY, "It adds two numbers.")
    kwargs = dict(model="gemma3-270m", instructions=SYSTEM, tools=RESPONSES_TOOLS, temperature=0)
    response = await client.responses.create(input=QUESTION, **kwargs)
    assert [item.type for item in response.output] == ["reasoning", "message", "function_call"]
    call = response.output[2]
    assert (call.name, json.loads(call.arguments)) == ("read_file", {"path": "src/a.py"})
    items = [{"role": "user", "content": QUESTION},
             {"type": "reasoning", "id": response.output[0].id, "summary": [],
              "content": [{"type": "reasoning_text", "text": response.output[0].content[0].text}]},
             {"type": "message", "role": "assistant",
              "content": [{"type": "output_text", "text": response.output[1].content[0].text}]},
             {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
             {"type": "function_call_output", "call_id": call.call_id, "output": RESULT}]
    final = await client.responses.create(input=items, **kwargs)
    assert final.output_text == "It adds two numbers." and final.status == "completed"
    assert final.usage.input_tokens_details.cached_tokens == len(engine.prompts[0])
    assert "<start_of_turn>model\n<think>\nI should look at the file.\n</think>\n\nLet me read it." in prompt_text(engine)
    check_result_turn(engine)


async def test_messages_tool_round_trip_on_gemma(served):
    engine, server = served
    client = claude(server)
    engine.script(CALL_REPLY, "It adds two numbers.")
    messages = [{"role": "user", "content": QUESTION}]
    kwargs = dict(model="gemma3-270m", max_tokens=200, system=SYSTEM, tools=MESSAGES_TOOLS)
    async with client.messages.stream(messages=messages, **kwargs) as events:
        types = [e.type async for e in events]
        message = await events.get_final_message()
    assert types[0] == "message_start" and types[-1] == "message_stop"
    messages = messages_answer(messages, message, RESULT)
    final = await client.messages.create(messages=messages, **kwargs)
    assert [b.text for b in final.content] == ["It adds two numbers."] and final.stop_reason == "end_turn"
    assert final.usage.cache_read_input_tokens == len(engine.prompts[0])
    check_result_turn(engine)


async def test_with_the_fallback_off_gemma_answers_tools_with_a_400(gemma_loaded):  # noqa: F811
    engine = Engine(gemma_loaded, EngineOptions(256, 2, tool_fallback=False))
    server = TestServer(make_app(Settings(), engine, "cpu", "float32"), host="127.0.0.1")
    await server.start_server()
    try:
        with pytest.raises(openai.BadRequestError) as chat:
            await oai(server).chat.completions.create(
                model="gemma3-270m", messages=[{"role": "user", "content": QUESTION}], tools=CHAT_TOOLS)
    finally:
        await server.close()
    assert chat.value.body["param"] == "tools"
    assert chat.value.message.startswith("Error code: 400 - ") and "no tool format" in chat.value.message
