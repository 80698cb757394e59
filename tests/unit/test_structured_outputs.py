"""Structured outputs, constrained tool calls and the sampling fields, through the real
`openai` and `anthropic` clients and the real server, on the tiny random model: whatever its
weights, a constrained reply parses (issue 25)."""

from __future__ import annotations

import json
from typing import Literal

import anthropic
import openai
import pydantic
import pytest

from memrad.engine.engine import Engine, EngineOptions
from memrad.reuse.pool import ReusePool
from scripted import ScriptedEngine
from test_agent_apis import claude, oai
from test_server import serve as started

PARAMS = {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}, "ok": {"type": "boolean"}},
          "required": ["unit", "ok"], "additionalProperties": False}
CHAT_TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": PARAMS}},
              {"type": "function", "function": {"name": "clock", "parameters": {
                  "type": "object", "properties": {"tz": {"enum": ["utc", "local"]}}, "required": ["tz"],
                  "additionalProperties": False}}}]
RESPONSES_TOOLS = [{"type": "function", **t["function"]} for t in CHAT_TOOLS]
MESSAGES_TOOLS = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in CHAT_TOOLS]
BAD_SCHEMA = {"type": "string", "pattern": "(?<=x)a"}
ASK = [{"role": "user", "content": "Read the file, then answer."}]


class Verdict(pydantic.BaseModel):
    answer: Literal["yes", "no"]
    sure: bool


class Engines(Engine):
    """The real engine, keeping each request it ran."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.requests = []

    def admit(self, request, emit, cancelled, on_decision=None):
        self.requests.append(request)
        return super().admit(request, emit, cancelled, on_decision)


@pytest.fixture
def engine(tiny_loaded):
    return Engines(tiny_loaded, EngineOptions(16, 1), ReusePool(8, 1 << 30))


@pytest.fixture
async def server(engine):
    server = await started(engine)
    yield server
    await server.close()


@pytest.mark.parametrize("seed", [0, 1, 2])
async def test_the_parse_helpers_get_the_model_on_chat_and_responses(server, engine, seed):
    client = oai(server)
    chat = await client.chat.completions.parse(model="default", messages=ASK, response_format=Verdict,
                                               max_tokens=40, seed=seed)
    assert isinstance(chat.choices[0].message.parsed, Verdict) and chat.choices[0].finish_reason == "stop"
    responses = await client.responses.parse(model="default", input="Read the file, then answer.",
                                             text_format=Verdict, max_output_tokens=40, temperature=0)
    assert isinstance(responses.output_parsed, Verdict)
    assert responses.text.format.type == "json_schema"  # the format is echoed as sent
    assert [r.sampling.constraint.kind for r in engine.requests] == ["json_schema", "json_schema"]


async def test_json_object_is_any_json_object_and_messages_take_output_config(server, engine):
    chat = await oai(server).chat.completions.create(model="default", messages=ASK, max_tokens=64, temperature=0,
                                                     response_format={"type": "json_object"})
    assert engine.requests[-1].sampling.constraint.kind == "json_object"
    if chat.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(chat.choices[0].message.content), dict)
    for field in ("output_config", "output_format"):
        fmt = {"type": "json_schema", "schema": Verdict.model_json_schema()}
        message = await claude(server).messages.create(
            model="default", max_tokens=40, messages=ASK,
            extra_body={field: {"format": fmt} if field == "output_config" else fmt})
        Verdict.model_validate_json(message.content[0].text)
        assert engine.requests[-1].sampling.constraint.param == f"{field}{'.format' if field == 'output_config' else ''}.schema"


async def test_a_schema_that_cannot_compile_is_a_400_naming_the_field_on_each_api(server, engine):
    with pytest.raises(openai.BadRequestError) as chat:
        await oai(server).chat.completions.create(
            model="default", messages=ASK, response_format={"type": "json_schema", "json_schema": {
                "name": "x", "schema": BAD_SCHEMA}})
    assert chat.value.body["param"] == "response_format.json_schema.schema"
    assert "look-around" in chat.value.body["message"]
    with pytest.raises(openai.BadRequestError) as responses:
        await oai(server).responses.create(model="default", input="hi", text={"format": {
            "type": "json_schema", "name": "x", "schema": BAD_SCHEMA}})
    assert responses.value.body["param"] == "text.format.schema"
    with pytest.raises(anthropic.BadRequestError) as messages:
        await claude(server).messages.create(model="default", max_tokens=8, messages=ASK, extra_body={
            "output_config": {"format": {"type": "json_schema", "schema": BAD_SCHEMA}}})
    assert "output_config.format.schema" in messages.value.message
    assert engine.requests == []  # refused before queueing


@pytest.mark.parametrize("choice", ["required", "named"])
async def test_a_forced_tool_choice_gives_a_valid_call_of_a_given_tool_on_each_api(server, engine, choice):
    names = {"weather", "clock"} if choice == "required" else {"clock"}
    chat = await oai(server).chat.completions.create(
        model="default", messages=ASK, tools=CHAT_TOOLS, max_tokens=96, temperature=0,
        tool_choice="required" if choice == "required" else {"type": "function", "function": {"name": "clock"}})
    call = chat.choices[0].message.tool_calls[0].function
    assert call.name in names and chat.choices[0].finish_reason == "tool_calls"
    json.loads(call.arguments)
    responses = await oai(server).responses.create(
        model="default", input="Read the file, then answer.", tools=RESPONSES_TOOLS, max_output_tokens=96,
        temperature=0, tool_choice="required" if choice == "required" else {"type": "function", "name": "clock"})
    assert responses.output[-1].type == "function_call" and responses.output[-1].name in names
    message = await claude(server).messages.create(
        model="default", max_tokens=96, messages=ASK, tools=MESSAGES_TOOLS,
        tool_choice={"type": "any"} if choice == "required" else {"type": "tool", "name": "clock"})
    assert message.stop_reason == "tool_use" and message.content[-1].name in names, message
    assert {r.sampling.constraint.param for r in engine.requests} == {"tool_choice"}


async def test_a_call_naming_a_tool_that_was_not_given_is_never_a_tool_call(tiny_loaded):
    """The scripted model ignores the mask: the parser still refuses the name (auto mode)."""
    engine = ScriptedEngine(tiny_loaded, EngineOptions(16, 1), ReusePool(8, 1 << 30))
    server = await started(engine)
    try:
        bad = '<tool_call>\n{"name": "2 + 3", "arguments": {}}\n</tool_call>'
        engine.script(bad, bad)
        chat = await oai(server).chat.completions.create(model="default", messages=ASK, tools=CHAT_TOOLS)
        assert chat.choices[0].message.tool_calls is None and chat.choices[0].finish_reason == "stop"
        assert '"2 + 3"' in chat.choices[0].message.content
        responses = await oai(server).responses.create(model="default", input="hi", tools=RESPONSES_TOOLS)
        assert [item.type for item in responses.output] == ["message"]
    finally:
        await server.close()


@pytest.mark.parametrize(("field", "value"), [
    ("frequency_penalty", 2.5), ("presence_penalty", -3), ("repetition_penalty", 0), ("repetition_penalty", 2.5),
    ("top_k", -2), ("top_k", 1.5), ("min_p", 1.5), ("logit_bias", {"x": 1}), ("logit_bias", {"5": 101}),
    ("logit_bias", {"100000": 1}),
])
async def test_a_sampling_field_out_of_range_is_a_400_naming_it(server, engine, field, value):
    with pytest.raises(openai.BadRequestError) as chat:
        await oai(server).chat.completions.create(model="default", messages=ASK, extra_body={field: value})
    assert chat.value.body["param"] == field


async def test_sampling_fields_reach_the_engine_and_a_ban_holds(server, engine, tiny_loaded):
    tokenizer = tiny_loaded.tokenizer
    free = await oai(server).chat.completions.create(model="default", messages=ASK, max_tokens=6, temperature=0)
    first = tokenizer.encode(free.choices[0].message.content, add_special_tokens=False)[0]
    banned = await oai(server).chat.completions.create(
        model="default", messages=ASK, max_tokens=6, temperature=0, logit_bias={str(first): -100},
        frequency_penalty=0.5, presence_penalty=0.25, extra_body={"top_k": 5, "min_p": 0.1, "repetition_penalty": 1.2})
    params = engine.requests[-1].sampling
    assert (params.logit_bias, params.frequency_penalty, params.presence_penalty, params.top_k, params.min_p,
            params.repetition_penalty) == (((first, -100.0),), 0.5, 0.25, 5, 0.1, 1.2)
    assert tokenizer.encode(banned.choices[0].message.content, add_special_tokens=False)[0] != first
    message = await claude(server).messages.create(model="default", max_tokens=4, messages=ASK, extra_body={"top_k": 3})
    assert engine.requests[-1].sampling.top_k == 3 and message.stop_reason in ("end_turn", "max_tokens")


async def test_logprobs_come_back_per_token_on_chat_and_responses_and_agree_with_greedy(server, engine):
    chat = await oai(server).chat.completions.create(model="default", messages=ASK, max_tokens=5, temperature=0,
                                                     logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens == 5
    assert bytes(b for t in content for b in t.bytes).decode() == chat.choices[0].message.content
    for token in content:
        assert len(token.top_logprobs) == 3 and token.logprob <= 0
        assert token.top_logprobs[0].logprob == token.logprob  # greedy: the chosen token is the likeliest
    responses = await oai(server).responses.create(model="default", input="Read the file, then answer.",
                                                   max_output_tokens=5, temperature=0, top_logprobs=2,
                                                   include=["message.output_text.logprobs"])
    part = responses.output[-1].content[0]
    assert len(part.logprobs) == 5 and all(len(t.top_logprobs) == 2 for t in part.logprobs)
    plain = await oai(server).chat.completions.create(model="default", messages=ASK, max_tokens=5, temperature=0)
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == chat.choices[0].message.content


def entries(tokens) -> list[tuple]:
    return [(t.token, t.logprob, tuple(t.bytes or ()), tuple((a.token, a.logprob) for a in t.top_logprobs))
            for t in tokens]


@pytest.mark.parametrize("fmt", [None, {"type": "json_schema", "json_schema": {
    "name": "verdict", "schema": Verdict.model_json_schema()}}])
async def test_streamed_logprobs_are_the_whole_reply_s_token_for_token_on_chat(server, engine, fmt):
    ask = dict(model="default", messages=ASK, max_tokens=40, temperature=0, logprobs=True, top_logprobs=2)
    if fmt is not None:
        ask["response_format"] = fmt
    whole = await oai(server).chat.completions.create(**ask)
    streamed, text, carrying = [], "", 0
    async for chunk in await oai(server).chat.completions.create(**ask, stream=True):
        choice = chunk.choices[0]
        text += choice.delta.content or ""
        if choice.logprobs is not None:
            carrying += 1
            streamed += choice.logprobs.content
    assert len(whole.choices[0].logprobs.content) == whole.usage.completion_tokens
    assert whole.usage.completion_tokens == 40 if fmt is None else Verdict.model_validate_json(text)
    assert entries(streamed) == entries(whole.choices[0].logprobs.content)  # the same tokens, numbers and bytes
    assert text == whole.choices[0].message.content and carrying >= 2  # spread over the chunks, not one lump
    plain = [c async for c in await oai(server).chat.completions.create(**{**ask, "logprobs": False}, stream=True)]
    assert all(c.choices[0].logprobs is None for c in plain if c.choices)
    if fmt is None:  # a stop string's tokens never leave as text: they ride on the finishing chunk
        stop = whole.choices[0].message.content[8:11]
        cut = await oai(server).chat.completions.create(**ask, stop=[stop])
        chunks = [c async for c in await oai(server).chat.completions.create(**ask, stop=[stop], stream=True)]
        finishing = next(c.choices[0] for c in chunks if c.choices and c.choices[0].finish_reason)
        assert cut.choices[0].finish_reason == "stop" and finishing.logprobs is not None
        assert entries(t for c in chunks if c.choices and c.choices[0].logprobs
                       for t in c.choices[0].logprobs.content) == entries(cut.choices[0].logprobs.content)


async def test_streamed_logprobs_are_the_whole_reply_s_token_for_token_on_responses(server, engine):
    ask = dict(model="default", input="Read the file, then answer.", max_output_tokens=10, temperature=0,
               top_logprobs=3, include=["message.output_text.logprobs"])
    whole = await oai(server).responses.create(**ask)
    deltas, done, final = [], None, None
    async for event in await oai(server).responses.create(**ask, stream=True):
        if event.type == "response.output_text.delta":
            deltas += event.logprobs
        elif event.type == "response.output_text.done":
            done = event.logprobs
        elif event.type in ("response.completed", "response.incomplete"):
            final = event.response
    expected = entries(whole.output[-1].content[0].logprobs)
    assert len(expected) == whole.usage.output_tokens == 10
    assert entries(deltas) == expected and entries(done) == expected
    assert entries(final.output[-1].content[0].logprobs) == expected


class Note(pydantic.BaseModel):
    note: str  # no maxLength: nothing but max_tokens ends a model that never closes it


async def test_a_reply_cut_by_max_tokens_under_a_schema_says_length_and_is_never_parsed(server, engine):
    """memrad, like vLLM, llama.cpp and OpenAI, lets max_tokens end a schema's reply: the
    finish says so on every API, so no client takes the cut JSON for a parsed object."""
    client = oai(server)
    with pytest.raises(openai.LengthFinishReasonError) as cut:
        await client.chat.completions.parse(model="default", messages=ASK, response_format=Note, max_tokens=3)
    choice = cut.value.completion.choices[0]
    assert (choice.finish_reason, cut.value.completion.usage.completion_tokens) == ("length", 3)
    assert choice.message.content.startswith('{"')  # the cut text, never a parsed object
    chunks = [c async for c in await client.chat.completions.create(
        model="default", messages=ASK, max_tokens=3, stream=True, response_format={
            "type": "json_schema", "json_schema": {"name": "note", "schema": Note.model_json_schema()}})]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    responses = await client.responses.create(model="default", input="hi", max_output_tokens=3, text={"format": {
        "type": "json_schema", "name": "note", "schema": Note.model_json_schema()}})
    assert (responses.status, responses.incomplete_details.reason) == ("incomplete", "max_output_tokens")
    with pytest.raises(pydantic.ValidationError):  # the SDK parses what it was given: the cut text is no Note
        await client.responses.parse(model="default", input="hi", max_output_tokens=3, text_format=Note)
    message = await claude(server).messages.create(model="default", max_tokens=3, messages=ASK, extra_body={
        "output_config": {"format": {"type": "json_schema", "schema": Note.model_json_schema()}}})
    assert message.stop_reason == "max_tokens" and message.content[0].text.startswith('{"')
    forced = await client.chat.completions.create(model="default", messages=ASK, tools=CHAT_TOOLS, max_tokens=2,
                                                  tool_choice={"type": "function", "function": {"name": "clock"}})
    choice = forced.choices[0]
    assert (choice.finish_reason, choice.message.tool_calls) == ("length", None)
    # the cut call is content as written, from the opening memrad put in the prompt on
    assert choice.message.content.startswith('{"name": "clock", "arguments": {')
