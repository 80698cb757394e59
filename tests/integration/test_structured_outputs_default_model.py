"""Output that always parses, on a real daemon with the default model (issue 25): the
official clients' parse helpers, and forced tool calls on all three APIs, 20 of 20 each."""

from __future__ import annotations

import json

import openai
import pydantic
import pytest

from test_agent_apis_default_model import claude, oai  # noqa: F401 (the module-scoped client fixtures)

pytestmark = pytest.mark.integration

CITIES = ["Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Quito", "Rome", "Delhi", "Perth", "Accra",
          "Hanoi", "Dakar", "Seoul", "Riga", "Bern", "Doha", "Kyiv", "Baku", "Suva", "Male"]
RUNS = len(CITIES)
# The strings are bounded: greedy SmolLM2 loops inside an unbounded string for 1 city of 20
# ("Suva" -> "Savai-Savai-…") until max_tokens; a bounded one is closed by the grammar. The
# forced calls' budget covers the longest call the schema allows (a 40-character city, ~40
# tokens, and the call's ~25 fixed tokens): under yarn x4 (the default 32k) SmolLM2 fills
# the city string to its bound more often, and 48 tokens cut such a call short.
CALL_TOKENS = 96
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"]}
READ = {"type": "object", "properties": {"path": {"type": "string", "maxLength": 60}}, "required": ["path"]}
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                                "parameters": WEATHER}},
              {"type": "function", "function": {"name": "read_file", "description": "Read a file",
                                                "parameters": READ}}]
RESPONSES_TOOLS = [{"type": "function", **t["function"]} for t in CHAT_TOOLS]
MESSAGES_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
                   "input_schema": t["function"]["parameters"]} for t in CHAT_TOOLS]
ARGUMENTS = {"get_weather": ({"city", "unit"}, WEATHER), "read_file": ({"path"}, READ)}


class CityFacts(pydantic.BaseModel):
    city: str
    country: str
    coastal: bool


def question(city: str) -> str:
    return f"Give the facts about {city} as JSON."


def test_chat_parse_gives_the_pydantic_model_20_of_20(oai):
    parsed = []
    for seed, city in enumerate(CITIES):
        reply = oai.chat.completions.parse(model="default", messages=[{"role": "user", "content": question(city)}],
                                           response_format=CityFacts, max_tokens=48, temperature=0.7, seed=seed)
        assert reply.choices[0].finish_reason == "stop", reply.choices[0].message.content
        parsed.append(reply.choices[0].message.parsed)
    assert sum(isinstance(p, CityFacts) for p in parsed) == RUNS


def test_responses_parse_gives_the_pydantic_model_20_of_20(oai):
    parsed = []
    for city in CITIES:
        reply = oai.responses.parse(model="default", input=question(city), text_format=CityFacts,
                                    max_output_tokens=48, temperature=0)
        assert reply.status == "completed", reply.output_text
        parsed.append(reply.output_parsed)
    assert sum(isinstance(p, CityFacts) for p in parsed) == RUNS


def valid_call(name: str, arguments: dict, names: set[str]) -> bool:
    keys, schema = ARGUMENTS[name]
    return (name in names and set(arguments) == keys and all(isinstance(v, str) for v in arguments.values())
            and arguments.get("unit", "celsius") in schema["properties"].get("unit", {"enum": ["celsius"]})["enum"])


@pytest.mark.parametrize("api", ["chat", "responses", "messages"])
@pytest.mark.parametrize("choice", ["required", "named"])
def test_a_forced_tool_choice_gives_a_valid_call_20_of_20(oai, claude, api, choice):
    names = {"get_weather", "read_file"} if choice == "required" else {"get_weather"}
    valid = 0
    for city in CITIES:
        ask = f"What is the weather in {city}?"
        if api == "chat":
            reply = oai.chat.completions.create(
                model="default", messages=[{"role": "user", "content": ask}], tools=CHAT_TOOLS, max_tokens=CALL_TOKENS,
                temperature=0, tool_choice="required" if choice == "required"
                else {"type": "function", "function": {"name": "get_weather"}})
            assert reply.choices[0].finish_reason == "tool_calls", reply.choices[0].message
            call = reply.choices[0].message.tool_calls[0].function
            name, arguments = call.name, json.loads(call.arguments)
        elif api == "responses":
            reply = oai.responses.create(
                model="default", input=ask, tools=RESPONSES_TOOLS, max_output_tokens=CALL_TOKENS, temperature=0,
                tool_choice="required" if choice == "required" else {"type": "function", "name": "get_weather"})
            call = reply.output[-1]
            assert call.type == "function_call", reply.output
            name, arguments = call.name, json.loads(call.arguments)
        else:
            reply = claude.messages.create(
                model="default", max_tokens=CALL_TOKENS, messages=[{"role": "user", "content": ask}], tools=MESSAGES_TOOLS,
                tool_choice={"type": "any"} if choice == "required" else {"type": "tool", "name": "get_weather"},
                extra_body={"temperature": 0})
            assert reply.stop_reason == "tool_use", reply.content
            name, arguments = reply.content[-1].name, reply.content[-1].input
        valid += valid_call(name, arguments, names)
    assert valid == RUNS



class Answer(pydantic.BaseModel):
    answer: str  # no maxLength: only max_tokens ends a string the model does not close


WRITE = {"type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
         "required": ["path", "content"]}
# Greedy SmolLM2 answers in digits that never end ("1234567890123…"), in a string or a call.
LONG = "List every prime number below 1000."


def test_an_unbounded_string_cut_by_max_tokens_says_length_on_each_api_and_is_never_parsed(oai, claude):
    """Like vLLM, llama.cpp and OpenAI, memrad lets max_tokens end a string the schema leaves
    unbounded (docs/SERVING.md, structured outputs): each API says the reply was cut, the
    parse helper refuses it, and a cut call is never returned as a call."""
    with pytest.raises(openai.LengthFinishReasonError) as cut:
        oai.chat.completions.parse(model="default", messages=[{"role": "user", "content": LONG}],
                                   response_format=Answer, max_tokens=24, temperature=0)
    completion = cut.value.completion
    assert (completion.choices[0].finish_reason, completion.usage.completion_tokens) == ("length", 24)
    assert completion.choices[0].message.content.startswith('{"answer": "')
    tools = [{"type": "function", "function": {"name": "write_file", "description": "Write a file",
                                               "parameters": WRITE}}]
    chat = oai.chat.completions.create(model="default", messages=[{"role": "user", "content": LONG + " Save it."}],
                                       tools=tools, max_tokens=24, temperature=0, tool_choice="required")
    choice = chat.choices[0]
    assert (choice.finish_reason, chat.usage.completion_tokens, choice.message.tool_calls) == ("length", 24, None)
    assert choice.message.content.startswith('{"name": "write_file", "arguments": {')  # memrad's opening kept
    responses = oai.responses.create(model="default", input=LONG, max_output_tokens=24, temperature=0, text={
        "format": {"type": "json_schema", "name": "answer", "schema": Answer.model_json_schema()}})
    assert (responses.status, responses.incomplete_details.reason) == ("incomplete", "max_output_tokens")
    called = oai.responses.create(model="default", input=LONG + " Save it.", max_output_tokens=24, temperature=0,
                                  tools=[{"type": "function", **tools[0]["function"]}], tool_choice="required")
    assert called.status == "incomplete" and all(item.type != "function_call" for item in called.output)
    message = claude.messages.create(model="default", max_tokens=24, messages=[{"role": "user", "content": LONG + " Save it."}],
                                     tools=[{"name": "write_file", "input_schema": WRITE}],
                                     tool_choice={"type": "any"}, extra_body={"temperature": 0})
    assert message.stop_reason == "max_tokens" and all(block.type != "tool_use" for block in message.content)


def test_streamed_logprobs_are_the_whole_reply_s_on_the_default_model(oai):
    """Real merges, multi-byte tokens and a resumed second request (exact mode): the entries
    streamed chunk by chunk are the whole reply's, token for token, on Chat and Responses."""
    ask = dict(model="default", messages=[{"role": "user", "content": "Say hello in three languages."}],
               max_tokens=16, temperature=0, logprobs=True, top_logprobs=2)
    whole = oai.chat.completions.create(**ask)
    streamed = [t for chunk in oai.chat.completions.create(**ask, stream=True) if chunk.choices
                and chunk.choices[0].logprobs for t in chunk.choices[0].logprobs.content]
    key = lambda tokens: [(t.token, t.logprob, t.bytes, [(a.token, a.logprob) for a in t.top_logprobs])  # noqa: E731
                          for t in tokens]
    assert len(whole.choices[0].logprobs.content) == whole.usage.completion_tokens
    assert key(streamed) == key(whole.choices[0].logprobs.content)
    ask = dict(model="default", input="Say hello in three languages.", max_output_tokens=16, temperature=0,
               top_logprobs=2, include=["message.output_text.logprobs"])
    reply = oai.responses.create(**ask)
    deltas = [t for event in oai.responses.create(**ask, stream=True) if event.type == "response.output_text.delta"
              for t in event.logprobs]
    assert [(t.token, t.logprob) for t in deltas] == [(t.token, t.logprob) for t in reply.output[-1].content[0].logprobs]
