"""Responses and Messages on a real daemon with the default model: plain paths, no scripting."""

from __future__ import annotations

import anthropic
import openai
import pytest

pytestmark = pytest.mark.integration

QUESTION = "Name three colors."
TOOLS = [{"type": "function", "name": "read_file", "description": "Read a file",
          "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}]


@pytest.fixture(scope="module")
def oai(daemon):
    with openai.OpenAI(base_url=daemon.url + "/v1", api_key="x", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def claude(daemon):
    with anthropic.Anthropic(base_url=daemon.url, api_key="x", max_retries=0, timeout=120) as c:
        yield c


def test_responses_whole_and_streamed_agree_and_the_second_turn_resumes(oai):
    whole = oai.responses.create(model="default", input=QUESTION, max_output_tokens=8, temperature=0)
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert whole.usage.output_tokens == 8 and whole.output_text
    events = list(oai.responses.create(model="default", input=QUESTION, max_output_tokens=8, temperature=0,
                                       stream=True))
    assert events[0].type == "response.created" and events[-1].type == "response.incomplete"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    follow = oai.responses.create(model="default", previous_response_id=whole.id, input="And three more?",
                                  max_output_tokens=4, temperature=0)
    assert follow.usage.input_tokens_details.cached_tokens >= whole.usage.input_tokens - 64
    assert "resumed" in follow.memra["decision"]


def test_messages_whole_and_streamed_agree_and_count_tokens_matches(claude):
    messages = [{"role": "user", "content": QUESTION}]
    greedy = {"temperature": 0}  # this anthropic client has no temperature argument; the API has the field
    whole = claude.messages.create(model="default", max_tokens=8, messages=messages, system="Be brief.",
                                   extra_body=greedy)
    assert whole.stop_reason in ("max_tokens", "end_turn") and whole.usage.output_tokens <= 8
    with claude.messages.stream(model="default", max_tokens=8, messages=messages, system="Be brief.",
                                extra_body=greedy) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text and final.stop_reason == whole.stop_reason
    counted = claude.messages.count_tokens(model="default", messages=messages, system="Be brief.")
    assert counted.input_tokens == final.usage.input_tokens + final.usage.cache_read_input_tokens
    # The same prompt again has no suffix to prime: the decision says so, in the message's memra field.
    assert final.memra["decision"] == "affinity: declined (no suffix to prime (prompt 21 tokens, checkpoint 21))"


def test_the_default_model_takes_tools_through_memras_tool_template(oai):
    """SmolLM2's own template has no tool format; memra's Hermes template renders the tools."""
    r = oai.responses.create(model="default", input="Read README.md", tools=TOOLS, max_output_tokens=24,
                             temperature=0)
    assert r.status in ("completed", "incomplete") and r.usage.input_tokens > 100
    assert all(item.type in ("message", "function_call", "reasoning") for item in r.output)
    assert "<tool_call>" not in r.output_text
