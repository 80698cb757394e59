"""Tool round trips through the real `openai` and `anthropic` clients on all three APIs, with a
scripted model behind the real server (issue 11: 6a, 6d, errors, decisions, previous_response_id)."""

from __future__ import annotations

import dataclasses
import json

import aiohttp
import anthropic
import openai
import pytest
from aiohttp.test_utils import TestServer

from memrad.engine.engine import EngineOptions
from memrad.config import Settings
from memrad.reuse.pool import ReusePool
from memrad.server.app import make_app
from scripted import (CALL_REPLY, CHAT_TOOLS, MESSAGES_TOOLS, RESPONSES_TOOLS, ScriptedEngine, chat_stream_parts,
                      claude, messages_answer, oai)

RESULT = "def add(a, b):\n    return a + b\n"


@pytest.fixture
def engine(tiny_loaded):
    return ScriptedEngine(tiny_loaded, EngineOptions(16, 1), ReusePool(8, 1 << 30))


@pytest.fixture
async def server(engine):
    server = TestServer(make_app(Settings(), engine, "cpu", "float32"), host="127.0.0.1")
    await server.start_server()
    yield server
    await server.close()


def last_prompt(engine) -> str:
    return engine.loaded.tokenizer.decode(list(engine.prompts[-1]))


def rendered_result_turn(engine) -> None:
    """The next turn renders the call the model made and the client's result."""
    prompt = last_prompt(engine)
    assert ('<tool_call>\n{"name": "read_file", "arguments": {"path": "src/a.py"}}\n</tool_call><|im_end|>\n'
            '<|im_start|>user\n<tool_response>\n' + RESULT + '\n</tool_response><|im_end|>\n'
            '<|im_start|>assistant\n') in prompt
    assert "# Tools" in prompt and '"name": "read_file"' in prompt


@pytest.mark.parametrize("stream", [False, True])
async def test_chat_completions_tool_round_trip(server, engine, stream):
    client = oai(server)
    messages = [{"role": "user", "content": "What does src/a.py do?"}]
    engine.script(CALL_REPLY, "It adds two numbers.")
    if stream:
        chunks = [c async for c in await client.chat.completions.create(
            model="default", messages=messages, tools=CHAT_TOOLS, temperature=0, stream=True)]
        reasoning, content, calls, finish = chat_stream_parts(chunks)
        # id and name first, then argument chunks that concatenate to the arguments.
        assert calls[0].id.startswith("call_") and calls[0].function.name == "read_file"
        assert {tc.index for tc in calls} == {0}
        call_id, name = calls[0].id, calls[0].function.name
        arguments = "".join(tc.function.arguments or "" for tc in calls)
    else:
        whole = await client.chat.completions.create(model="default", messages=messages, tools=CHAT_TOOLS,
                                                     temperature=0)
        message = whole.choices[0].message
        reasoning, content = message.reasoning_content, message.content
        call_id, name, arguments = message.tool_calls[0].id, message.tool_calls[0].function.name, \
            message.tool_calls[0].function.arguments
        finish = whole.choices[0].finish_reason
        assert len(message.tool_calls) == 1
    assert (reasoning, content, name, json.loads(arguments), finish) == (
        "I should look at the file.", "Let me read it.", "read_file", {"path": "src/a.py"}, "tool_calls")
    assert "<tool_call>" not in content and "<think>" not in content
    messages += [{"role": "assistant", "content": content,
                  "tool_calls": [{"id": call_id, "type": "function",
                                  "function": {"name": name, "arguments": arguments}}]},
                 {"role": "tool", "tool_call_id": call_id, "content": RESULT}]
    final = await client.chat.completions.create(model="default", messages=messages, tools=CHAT_TOOLS,
                                                 temperature=0)
    assert final.choices[0].message.content == "It adds two numbers."
    assert final.choices[0].finish_reason == "stop"
    rendered_result_turn(engine)


@pytest.mark.parametrize("stream", [False, True])
async def test_responses_tool_round_trip(server, engine, stream):
    client = oai(server)
    engine.script(CALL_REPLY, "It adds two numbers.")
    kwargs = dict(model="default", instructions="You are a coding agent.", input="What does src/a.py do?",
                  tools=RESPONSES_TOOLS, temperature=0)
    if stream:
        events = [e async for e in await client.responses.create(stream=True, **kwargs)]
        types = [e.type for e in events]
        assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.completed"
        assert "response.reasoning_text.delta" in types and "response.output_text.delta" in types
        assert types.index("response.output_text.delta") < types.index("response.function_call_arguments.delta")
        assert [e.sequence_number for e in events] == list(range(len(events)))
        text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
        response = events[-1].response
        assert text == response.output_text == "Let me read it."
    else:
        response = await client.responses.create(**kwargs)
    kinds = [item.type for item in response.output]
    assert kinds == ["reasoning", "message", "function_call"]
    call = response.output[2]
    assert (call.name, json.loads(call.arguments), call.call_id[:5]) == ("read_file", {"path": "src/a.py"}, "call_")
    if stream:
        assert arguments == call.arguments
    assert response.output[0].content[0].text == "I should look at the file."
    assert response.usage.input_tokens_details.cached_tokens == 0
    # Stateless follow-up, as agent CLIs send it: the whole conversation as items (reasoning
    # kept, so the prompt extends the parked tokens and resumes).
    items = [{"role": "user", "content": "What does src/a.py do?"},
             {"type": "reasoning", "id": response.output[0].id, "summary": [],
              "content": [{"type": "reasoning_text", "text": response.output[0].content[0].text}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text",
                                                                   "text": response.output[1].content[0].text}]},
             {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
             {"type": "function_call_output", "call_id": call.call_id, "output": RESULT}]
    final = await client.responses.create(**{**kwargs, "input": items})
    assert final.output_text == "It adds two numbers." and final.status == "completed"
    assert final.usage.input_tokens_details.cached_tokens > 0
    rendered_result_turn(engine)


@pytest.mark.parametrize("stream", [False, True])
async def test_messages_tool_round_trip(server, engine, stream):
    client = claude(server)
    engine.script(CALL_REPLY, "It adds two numbers.")
    messages = [{"role": "user", "content": "What does src/a.py do?"}]
    kwargs = dict(model="default", max_tokens=200, system="You are a coding agent.", tools=MESSAGES_TOOLS)
    if stream:
        async with client.messages.stream(messages=messages, **kwargs) as events:
            types = [e.type async for e in events]
            message = await events.get_final_message()
        assert types[0] == "message_start" and types[-1] == "message_stop"
        assert {"content_block_start", "content_block_delta", "content_block_stop", "message_delta"} <= set(types)
    else:
        message = await client.messages.create(messages=messages, **kwargs)
    messages = messages_answer(messages, message, RESULT)
    final = await client.messages.create(messages=messages, **kwargs)
    assert [b.text for b in final.content] == ["It adds two numbers."] and final.stop_reason == "end_turn"
    assert final.usage.cache_read_input_tokens > 0
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == len(engine.prompts[-1])
    rendered_result_turn(engine)


async def test_the_same_conversation_renders_identical_ids_through_all_three_apis(server, engine):
    """6d: one rendering path. The client of each API drops nothing here."""
    system, question, follow_up = "You are a coding agent.", "What does src/a.py do?", "Thanks. Now run it."
    args = '{"path": "src/a.py"}'
    chat = [{"role": "system", "content": system}, {"role": "user", "content": question},
            {"role": "assistant", "content": "Let me read it.", "reasoning_content": "Look first.",
             "tool_calls": [{"id": "call_7", "type": "function", "function": {"name": "read_file", "arguments": args}}]},
            {"role": "tool", "tool_call_id": "call_7", "content": RESULT}, {"role": "user", "content": follow_up}]
    items = [{"role": "user", "content": question},
             {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text",
                                                                             "text": "Look first."}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me read it."}]},
             {"type": "function_call", "call_id": "call_7", "name": "read_file", "arguments": args},
             {"type": "function_call_output", "call_id": "call_7", "output": RESULT},
             {"role": "user", "content": [{"type": "input_text", "text": follow_up}]}]
    blocks = [{"role": "user", "content": question},
              {"role": "assistant", "content": [
                  {"type": "thinking", "thinking": "Look first.", "signature": ""},
                  {"type": "text", "text": "Let me read it."},
                  {"type": "tool_use", "id": "call_7", "name": "read_file", "input": {"path": "src/a.py"}}]},
              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_7", "content": RESULT},
                                           {"type": "text", "text": follow_up}]}]
    engine.script("a", "a", "a")
    await oai(server).chat.completions.create(model="default", messages=chat, tools=CHAT_TOOLS, max_tokens=1)
    await oai(server).responses.create(model="default", instructions=system, input=items, tools=RESPONSES_TOOLS,
                                       max_output_tokens=1)
    await claude(server).messages.create(model="default", system=system, messages=blocks, tools=MESSAGES_TOOLS,
                                         max_tokens=1)
    counted = await claude(server).messages.count_tokens(model="default", system=system, messages=blocks,
                                                         tools=MESSAGES_TOOLS)
    assert engine.prompts[0] == engine.prompts[1] == engine.prompts[2]
    assert counted.input_tokens == len(engine.prompts[0])
    assert "<think>\nLook first.\n</think>\n\nLet me read it.\n<tool_call>" in last_prompt(engine)


async def test_previous_response_id_resolves_the_conversation_and_its_session(server, engine):
    client = oai(server)
    engine.script(CALL_REPLY, "It adds two numbers.")
    first = await client.responses.create(model="default", input="What does src/a.py do?", tools=RESPONSES_TOOLS,
                                          prompt_cache_key="agent-7")
    call = first.output[-1]
    follow = await client.responses.create(
        model="default", previous_response_id=first.id, tools=RESPONSES_TOOLS,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": RESULT}])
    assert follow.previous_response_id == first.id
    # The stored conversation extends the parked tokens exactly; the follow-up ran under the
    # name the first response had, so the session it parks keeps that name.
    assert "resumed" in follow.memra["decision"]
    assert follow.usage.input_tokens_details.cached_tokens == len(engine.prompts[0])
    assert [s.identity.name for s in engine.parking.pool.sessions()] == ["agent-7"]
    rendered_result_turn(engine)
    with pytest.raises(openai.BadRequestError) as err:
        await client.responses.create(model="default", previous_response_id="resp_gone", input="hi")
    assert "previous_response_id 'resp_gone' is unknown" in err.value.message
    assert err.value.body["param"] == "previous_response_id"


async def test_the_decision_reaches_the_client_on_every_api(server, engine):
    engine.script("ok", "ok", "ok", "ok", "ok", "ok")
    url = str(server.make_url(""))
    bodies = {"/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}]},
              "/v1/responses": {"input": "hi"},
              "/v1/messages": {"model": "default", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}}
    async with aiohttp.ClientSession() as http:
        for path, body in bodies.items():
            async with http.post(url + path, json=body) as resp:
                got = await resp.json()
                assert resp.headers["x-memra-decision"] == got["memra"]["decision"]
                assert got["memra"]["decision"].startswith(("cold", "affinity", "prefix"))
            async with http.post(url + path, json={**body, "stream": True}) as resp:
                first_data = next(line for line in (await resp.text()).splitlines() if line.startswith("data: "))
                assert resp.headers["x-memra-decision"]
        # The streamed natural places: response.created's response, message_start's message.
        async with http.post(url + "/v1/responses", json={"input": "hi", "stream": True}) as resp:
            created = json.loads(next(line[6:] for line in (await resp.text()).splitlines() if line.startswith("data")))
            assert created["response"]["memra"]["decision"] == resp.headers["x-memra-decision"]
        async with http.post(url + "/v1/messages", json={**bodies["/v1/messages"], "stream": True}) as resp:
            start = json.loads(next(line[6:] for line in (await resp.text()).splitlines() if line.startswith("data")))
            assert start["message"]["memra"]["decision"] == resp.headers["x-memra-decision"]
    assert first_data


async def test_bad_tool_input_is_a_4xx_in_each_apis_error_shape(server, engine):
    with pytest.raises(openai.BadRequestError) as chat:
        await oai(server).chat.completions.create(model="default", messages=[{"role": "user", "content": "x"}],
                                                  tools=[{"type": "function", "function": {"description": "no name"}}])
    assert chat.value.body["param"] == "tools[0]"
    with pytest.raises(openai.BadRequestError) as named:
        await oai(server).chat.completions.create(model="default", messages=[{"role": "user", "content": "x"}],
                                                  tools=CHAT_TOOLS,
                                                  tool_choice={"type": "function", "function": {"name": "rm"}})
    assert "'rm', which is not among the tools (read_file)" in named.value.message
    with pytest.raises(openai.BadRequestError) as responses:
        await oai(server).responses.create(model="default", input="x", tools=[{"name": "untyped"}])
    assert responses.value.body["param"] == "tools[0]" and "must be a tool object with a type" in responses.value.message
    with pytest.raises(anthropic.BadRequestError) as messages:
        await claude(server).messages.create(model="default", max_tokens=5, messages=[
            {"role": "user", "content": [{"type": "tool_result", "content": "x"}]}])
    assert messages.value.body["type"] == "error"
    assert messages.value.body["error"]["type"] == "invalid_request_error"
    assert "the id of the tool call it answers" in messages.value.body["error"]["message"]


async def test_a_model_without_a_tool_format_rejects_tools_with_a_400_on_each_api(server, engine):
    engine.chat.format = dataclasses.replace(engine.chat.format, tools_supported=False, tool_template=None)
    with pytest.raises(openai.BadRequestError) as chat:
        await oai(server).chat.completions.create(model="default", messages=[{"role": "user", "content": "x"}],
                                                  tools=CHAT_TOOLS)
    assert "no tool format" in chat.value.message and chat.value.body["param"] == "tools"
    with pytest.raises(anthropic.BadRequestError) as messages:
        await claude(server).messages.create(model="default", max_tokens=5, tools=MESSAGES_TOOLS,
                                             messages=[{"role": "user", "content": "x"}])
    assert "no tool format" in messages.value.body["error"]["message"]


async def test_tool_choice_none_returns_tool_markup_as_text(server, engine):
    engine.script(CALL_REPLY)
    whole = await oai(server).chat.completions.create(model="default", messages=[{"role": "user", "content": "x"}],
                                                      tools=CHAT_TOOLS, tool_choice="none")
    message = whole.choices[0].message
    assert message.tool_calls is None and whole.choices[0].finish_reason == "stop"
    assert message.content.endswith('<tool_call>\n{"name": "read_file", "arguments": {"path": "src/a.py"}}\n'
                                    '</tool_call>')


def tokens_until(engine, text: str, marker: str) -> int:
    """How many tokens of `text` end just inside `marker` (a reply cut there)."""
    ids = engine.loaded.tokenizer(text, add_special_tokens=False)["input_ids"]
    inside = text.index(marker) + len(marker) // 2
    return next(n for n in range(1, len(ids) + 1) if len(engine.loaded.tokenizer.decode(ids[:n])) > inside - 2)


@pytest.mark.parametrize("marker", ["<tool_call>", "</think>"])
async def test_a_stream_cut_by_max_tokens_inside_markup_sends_no_markup(server, engine, marker):
    reply = "<think>\nLook.\n</think>\n\n" + CALL_REPLY.split("\n\n", 1)[1]
    n = tokens_until(engine, reply, marker)
    engine.script(reply)
    chunks = [c async for c in await oai(server).chat.completions.create(
        model="default", messages=[{"role": "user", "content": "x"}], tools=CHAT_TOOLS, max_tokens=n, stream=True)]
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    content = "".join(d.content or "" for d in deltas)
    reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert "<" not in content + reasoning and not any(d.tool_calls for d in deltas)
    assert (reasoning, content) == (("Look.", "Let me read it.") if marker == "<tool_call>" else ("Look.", ""))


async def test_a_stop_string_inside_a_tag_ends_the_reply_without_the_partial_tag(server, engine):
    engine.script(CALL_REPLY)
    message = await claude(server).messages.create(model="default", max_tokens=200, tools=MESSAGES_TOOLS,
                                                   stop_sequences=["_call>"],
                                                   messages=[{"role": "user", "content": "x"}])
    assert [b.type for b in message.content] == ["thinking", "text"]
    assert message.content[1].text == "Let me read it."
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", "_call>")


async def test_messages_max_tokens_beyond_the_context_is_lowered_to_what_is_left(server, engine):
    engine.script("Fine.")
    message = await claude(server).messages.create(model="default", max_tokens=4096,
                                                   messages=[{"role": "user", "content": "x"}])
    assert message.content[0].text == "Fine." and message.stop_reason == "end_turn"
    assert engine.requests[-1].sampling.max_tokens == 1024 - len(engine.prompts[-1])


@pytest.mark.parametrize("api", ["chat", "responses", "messages"])
async def test_a_required_or_named_tool_choice_opens_the_reply_as_that_call(server, engine, api):
    """A required call is opened in the prompt (the rest is constrained: memrad.chat.grammar),
    so the model's reply (scripted here as what follows the opening) is parsed as that call."""
    question = "What does src/a.py do?"
    engine.script('{"path": "src/a.py"}}\n</tool_call>', 'read_file", "arguments": {"path": "b.py"}}\n</tool_call>')
    if api == "chat":
        client, messages = oai(server), [{"role": "user", "content": question}]
        named = await client.chat.completions.create(
            model="default", messages=messages, tools=CHAT_TOOLS, temperature=0,
            tool_choice={"type": "function", "function": {"name": "read_file"}})
        required = await client.chat.completions.create(model="default", messages=messages, tools=CHAT_TOOLS,
                                                        temperature=0, tool_choice="required")
        calls = [(r.choices[0].message.tool_calls[0].function.name, r.choices[0].message.tool_calls[0].function.arguments,
                  r.choices[0].finish_reason) for r in (named, required)]
    elif api == "responses":
        client = oai(server)
        named = await client.responses.create(model="default", input=question, tools=RESPONSES_TOOLS, temperature=0,
                                              tool_choice={"type": "function", "name": "read_file"})
        required = await client.responses.create(model="default", input=question, tools=RESPONSES_TOOLS,
                                                 temperature=0, tool_choice="required")
        calls = [(r.output[-1].name, r.output[-1].arguments, "tool_calls") for r in (named, required)]
    else:
        client = claude(server)
        kwargs = dict(model="default", max_tokens=64, tools=MESSAGES_TOOLS,
                      messages=[{"role": "user", "content": question}])
        named = await client.messages.create(tool_choice={"type": "tool", "name": "read_file"}, **kwargs)
        required = await client.messages.create(tool_choice={"type": "any"}, **kwargs)
        calls = [(r.content[-1].name, json.dumps(r.content[-1].input), "tool_calls") for r in (named, required)]
    assert [(name, json.loads(arguments), finish) for name, arguments, finish in calls] == [
        ("read_file", {"path": "src/a.py"}, "tool_calls"), ("read_file", {"path": "b.py"}, "tool_calls")]
    named_prompt, required_prompt = (engine.loaded.tokenizer.decode(list(p)) for p in engine.prompts[-2:])
    assert named_prompt.endswith('<|im_start|>assistant\n<tool_call>\n{"name": "read_file", "arguments": ')
    assert required_prompt.endswith('<|im_start|>assistant\n<tool_call>\n{"name": "')
