import pytest

from memrad.request import Identity, SamplingParams
from memrad.server.errors import APIError
from memrad.server.chat_api import parse_chat, parse_completion

USER = [{"role": "user", "content": "hi"}]


def rejected(body, header=None, parse=parse_chat):
    with pytest.raises(APIError) as info:
        parse(body, header)
    assert info.value.status == 400
    return info.value


@pytest.mark.parametrize("body, param", [
    ({}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": ["hi"]}, "messages[0]"),
    ({"messages": [{"role": "bot", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {}}]}]}, "messages[0].content[0]"),
    ({"messages": USER, "n": 2}, "n"),
    ({"messages": USER, "max_tokens": 0}, "max_tokens"),
    ({"messages": USER, "max_tokens": -5}, "max_tokens"),
    ({"messages": USER, "max_tokens": "ten"}, "max_tokens"),
    ({"messages": USER, "max_tokens": 1.5}, "max_tokens"),
    ({"messages": USER, "max_completion_tokens": 0}, "max_completion_tokens"),
    ({"messages": USER, "temperature": "hot"}, "temperature"),
    ({"messages": USER, "temperature": 3}, "temperature"),
    ({"messages": USER, "top_p": 0}, "top_p"),
    ({"messages": USER, "seed": "x"}, "seed"),
    ({"messages": USER, "stream": "yes"}, "stream"),
    ({"messages": USER, "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
    ({"messages": USER, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"messages": USER, "stop": [""]}, "stop"),
    ({"messages": USER, "session_id": ""}, "session_id"),
    ({"messages": USER, "session_id": "x" * 257}, "session_id"),
    ({"messages": USER, "user": 7}, "user"),
    ({"messages": USER, "cache_salt": ""}, "cache_salt"),
    ({"messages": USER, "logprobs": "yes"}, "logprobs"),
    ({"messages": USER, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"messages": USER, "presence_penalty": 2.5}, "presence_penalty"),
    ({"messages": USER, "model": 3}, "model"),
    ({"messages": USER, "response_format": {"type": "xml"}}, "response_format"),
])
def test_each_bad_chat_field_is_named(body, param):
    assert rejected(body).param == param


def test_a_body_that_is_not_an_object_is_rejected():
    assert rejected([1, 2]).message == "the request body must be a JSON object"


def test_header_session_id_is_validated_too():
    assert rejected({"messages": USER}, header="y" * 300).param == "x-session-id"


def test_defaults_follow_openai():
    parsed = parse_chat({"messages": USER}, None)
    assert parsed.sampling == SamplingParams(temperature=1.0, top_p=1.0, seed=None, max_tokens=None, stop=())
    assert (parsed.stream, parsed.include_usage, parsed.identity, parsed.cache_salt) == (False, False, None, None)


def test_max_completion_tokens_beats_the_legacy_max_tokens():
    parsed = parse_chat({"messages": USER, "max_tokens": 10, "max_completion_tokens": 20}, None)
    assert parsed.sampling.max_tokens == 20


def test_identity_body_session_id_then_user_then_header():
    both = {"messages": USER, "session_id": "s1", "user": "u1"}
    assert parse_chat(both, "h1").identity == Identity("s1", "session_id")
    assert parse_chat({"messages": USER, "user": "u1"}, "h1").identity == Identity("u1", "user")
    assert parse_chat({"messages": USER}, "h1").identity == Identity("h1", "x-session-id")
    assert parse_chat({"messages": USER}, None).identity is None


def test_cache_salt_and_stop_are_carried():
    parsed = parse_chat({"messages": USER, "cache_salt": "tenant-a", "stop": "END"}, None)
    assert parsed.cache_salt == "tenant-a"
    assert parsed.sampling.stop == ("END",)


def test_messages_are_normalised_for_the_template():
    parsed = parse_chat({"messages": [
        {"role": "developer", "content": "rules"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function",
                                                               "function": {"name": "ls", "arguments": "{}"}}]},
        {"role": "tool", "content": "README.md", "tool_call_id": "1"},
    ]}, None)
    assert parsed.messages[0] == {"role": "system", "content": "rules"}
    assert parsed.messages[1] == {"role": "user", "content": "a\nb"}
    assert parsed.messages[2]["content"] == "" and parsed.messages[2]["tool_calls"][0]["id"] == "1"
    assert parsed.messages[3] == {"role": "tool", "content": "README.md", "tool_call_id": "1"}


@pytest.mark.parametrize("body, param", [
    ({}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": "x", "echo": True}, "echo"),
    ({"prompt": "x", "best_of": 3}, "best_of"),
    ({"prompt": "x", "n": 3}, "n"),
])
def test_each_bad_completion_field_is_named(body, param):
    assert rejected(body, parse=parse_completion).param == param


def test_completion_prompts_string_or_token_ids():
    assert parse_completion({"prompt": "abc"}, None).prompt == "abc"
    assert parse_completion({"prompt": ["abc"]}, None).prompt == "abc"
    assert parse_completion({"prompt": [5, 6]}, None).prompt == (5, 6)
    assert parse_completion({"prompt": [[5, 6]]}, None).prompt == (5, 6)
