"""The pure API adapters: identity precedence, item and block mapping, the response store."""

from __future__ import annotations

import pytest

from memrad.request import Identity
from memrad.server.chat_api import parse_chat
from memrad.server.errors import APIError, error_style
from memrad.server.messages_api import parse_messages
from memrad.server.response_store import ResponseStore, StoredResponse
from memrad.server.responses_api import parse_responses

USER = [{"role": "user", "content": "hi"}]


def no_lookup(_):
    return None


def test_chat_identity_is_session_id_then_prompt_cache_key_then_user_then_header():
    body = {"messages": USER, "session_id": "s", "prompt_cache_key": "k", "user": "u"}
    assert parse_chat(body, "h").identity == Identity("s", "session_id")
    assert parse_chat({**body, "session_id": None}, "h").identity == Identity("k", "prompt_cache_key")
    assert parse_chat({"messages": USER, "user": "u"}, "h").identity == Identity("u", "user")
    assert parse_chat({"messages": USER}, "h").identity == Identity("h", "x-session-id")


def test_responses_identity_adds_the_previous_responses_name_before_the_header():
    store = ResponseStore()
    store.put(StoredResponse("resp_1", ({"role": "user", "content": "hi"},), Identity("agent", "prompt_cache_key")))
    follow = parse_responses({"previous_response_id": "resp_1", "input": "more"}, "h", store.get)
    assert follow.parsed.identity == Identity("agent", "previous_response_id")
    assert [m["content"] for m in follow.parsed.messages] == ["hi", "more"]
    named = parse_responses({"previous_response_id": "resp_1", "input": "x", "prompt_cache_key": "k"}, "h", store.get)
    assert named.parsed.identity == Identity("k", "prompt_cache_key")
    assert parse_responses({"input": "x"}, "h", no_lookup).parsed.identity == Identity("h", "x-session-id")


def test_messages_identity_is_metadata_user_id_then_header():
    body = {"model": "m", "max_tokens": 5, "messages": USER, "metadata": {"user_id": "user_1_session_9"}}
    assert parse_messages(body, "h").identity == Identity("user_1_session_9", "metadata.user_id")
    assert parse_messages({**body, "metadata": {}}, "h").identity == Identity("h", "x-session-id")


def test_responses_items_fold_into_chat_turns_and_instructions_lead():
    req = parse_responses({"instructions": "rules", "input": [
        {"role": "developer", "content": "more rules"},
        {"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "think"}]},
        {"type": "function_call", "call_id": "c1", "name": "ls", "arguments": ""},
        {"type": "function_call", "call_id": "c2", "name": "cat", "arguments": '{"path": "x"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "x"},
        {"type": "function_call_output", "call_id": "c2", "output": "y"},
    ]}, None, no_lookup)
    assert req.parsed.messages == (
        {"role": "system", "content": "rules"}, {"role": "system", "content": "more rules"},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": "", "reasoning_content": "think", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "ls", "arguments": "{}"}},
            {"id": "c2", "type": "function", "function": {"name": "cat", "arguments": '{"path": "x"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "x"}, {"role": "tool", "tool_call_id": "c2", "content": "y"})
    assert req.history == req.parsed.messages[1:]  # instructions are not carried to a follow-up


def test_messages_blocks_fold_into_chat_turns():
    parsed = parse_messages({"model": "m", "max_tokens": 5, "system": [{"type": "text", "text": "rules"}],
                             "messages": [
                                 {"role": "user", "content": "hi"},
                                 {"role": "assistant", "content": [
                                     {"type": "thinking", "thinking": "t", "signature": "s"},
                                     {"type": "tool_use", "id": "u1", "name": "ls", "input": {}}]},
                                 {"role": "user", "content": [
                                     {"type": "tool_result", "tool_use_id": "u1",
                                      "content": [{"type": "text", "text": "x"}]},
                                     {"type": "text", "text": "go on"}]}],
                             "tool_choice": {"type": "any"}, "tools": [{"name": "ls", "input_schema": {}}],
                             "stop_sequences": ["END"]}, None)
    assert parsed.messages == (
        {"role": "system", "content": "rules"}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "reasoning_content": "t", "tool_calls": [
            {"id": "u1", "type": "function", "function": {"name": "ls", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "u1", "content": "x"}, {"role": "user", "content": "go on"})
    assert parsed.tool_choice.mode == "required" and parsed.sampling.stop == ("END",)
    assert parsed.tools == ({"type": "function", "function": {"name": "ls", "parameters": {}}},)


@pytest.mark.parametrize("body, param", [
    ({"model": "m", "messages": USER}, "max_tokens"),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
    ({"model": "m", "max_tokens": 5, "messages": USER, "tool_choice": {"type": "tool", "name": "x"}},
     "tool_choice"),
    ({"model": "m", "max_tokens": 5, "messages": USER, "temperature": 1.5}, "temperature"),
])
def test_messages_rejections_name_the_field(body, param):
    with pytest.raises(APIError) as err:
        parse_messages(body, None)
    assert err.value.status == 400 and err.value.param == param


def test_errors_take_the_shape_of_the_route():
    err = APIError(429, "busy", type="rate_limit_error")
    assert error_style("/v1/messages/count_tokens") == "anthropic" and error_style("/v1/responses") == "openai"
    assert err.body("anthropic") == {"type": "error", "error": {"type": "rate_limit_error", "message": "busy"}}
    assert err.body()["error"]["message"] == "busy"


def test_the_response_store_drops_the_oldest_past_its_cap():
    store = ResponseStore(max_responses=2)
    for i in range(3):
        store.put(StoredResponse(f"resp_{i}", (), None))
    assert (store.get("resp_0"), len(store)) == (None, 2) and store.get("resp_2") is not None


def test_a_codex_style_body_is_accepted_as_sent():
    body = {"model": "default", "instructions": "You are Codex.", "stream": True, "store": False,
            "tool_choice": "auto", "parallel_tool_calls": False, "prompt_cache_key": "conv-1",
            "reasoning": {"effort": "medium", "summary": "auto"}, "include": ["reasoning.encrypted_content"],
            "text": {"verbosity": "low"},
            "tools": [{"type": "function", "name": "shell", "description": "Run", "strict": False,
                       "parameters": {"type": "object", "properties": {"command": {"type": "array"}}}}],
            "input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "ls"}]},
                      {"type": "reasoning", "summary": [], "encrypted_content": "opaque"},
                      {"type": "function_call", "call_id": "c1", "name": "shell", "arguments": '{"command": ["ls"]}'},
                      {"type": "function_call_output", "call_id": "c1", "output": "README.md"}]}
    req = parse_responses(body, None, no_lookup)
    assert req.parsed.identity == Identity("conv-1", "prompt_cache_key") and not req.store
    assert req.parsed.stream and req.parsed.parse_tools and not req.parsed.parallel_tool_calls
    assert [m["role"] for m in req.parsed.messages] == ["system", "user", "assistant", "tool"]
    assert "reasoning_content" not in req.parsed.messages[2]  # encrypted reasoning has no text to render


def test_a_claude_code_style_body_is_accepted_as_sent():
    body = {"model": "default", "max_tokens": 32000, "stream": True, "temperature": 1,
            "metadata": {"user_id": "user_ab12_account_x_session_5f"},
            "thinking": {"type": "enabled", "budget_tokens": 4000},
            "system": [{"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}}],
            "tools": [{"name": "Bash", "description": "Run", "input_schema": {"type": "object"},
                       "cache_control": {"type": "ephemeral"}}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "ls",
                                                       "cache_control": {"type": "ephemeral"}}]},
                         {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "Bash",
                                                            "input": {"command": "ls"}}]},
                         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                                       "content": "README.md", "is_error": False}]}]}
    parsed = parse_messages(body, None)
    assert parsed.identity == Identity("user_ab12_account_x_session_5f", "metadata.user_id")
    assert [m["role"] for m in parsed.messages] == ["system", "user", "assistant", "tool"]
    assert parsed.sampling.max_tokens == 32000 and parsed.stream
