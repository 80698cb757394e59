"""Request limits: each a 4xx naming the field, checked before any tokenization."""

import json

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from memrad.config import LimitSettings, Settings
from memrad.server.app import make_app
from memrad.server.errors import APIError
from memrad.server.limits import ENVELOPE_DEPTH, Limits, check_body, depth, parse_body

LIMITS = Limits.from_settings(LimitSettings(max_messages=3, max_tokens=100, max_stop_chars=8, max_schema_depth=4))
USER = {"role": "user", "content": "hi"}


def nested(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels - 1):
        schema = {"p": schema}
    return schema


def refused(body) -> APIError:
    with pytest.raises(APIError) as caught:
        check_body(body, LIMITS)
    return caught.value


def test_depth_counts_levels_of_objects_and_arrays():
    assert depth(1, 10) == 0 and depth({}, 10) == 1 and depth([[], {"a": [1]}], 10) == 3
    assert depth(nested(5), 10) == 5
    assert depth(nested(50), 3) == 4  # stops counting once past the limit


@pytest.mark.parametrize("body, param, code", [
    ({"messages": [USER] * 4}, "messages", "too_many_messages"),
    ({"input": [USER] * 4}, "input", "too_many_messages"),
    ({"messages": [USER], "max_tokens": 101}, "max_tokens", "max_tokens_too_large"),
    ({"messages": [USER], "max_completion_tokens": 101}, "max_completion_tokens", "max_tokens_too_large"),
    ({"input": "x", "max_output_tokens": 500}, "max_output_tokens", "max_tokens_too_large"),
    ({"messages": [USER], "stop": ["a", "b", "c", "d", "e"]}, "stop", "too_many_stops"),
    ({"messages": [USER], "stop": "123456789"}, "stop", "stop_too_long"),
    ({"messages": [USER], "stop": ["ok", "123456789"]}, "stop[1]", "stop_too_long"),
    ({"messages": [USER], "stop_sequences": ["123456789"]}, "stop_sequences[0]", "stop_too_long"),
    ({"messages": [USER], "tools": [nested(4), nested(5)]}, "tools[1]", "schema_too_deep"),
    ({"messages": [USER], "seed": 2**64}, "seed", None),  # found by the fuzzer: was a 500 from torch
    ({"messages": [USER], "seed": -(2**63) - 1}, "seed", None),
])
def test_each_limit_names_its_field(body, param, code):
    err = refused(body)
    assert (err.status, err.param, err.code) == (400, param, code)
    assert str(LIMITS.max_messages if code == "too_many_messages" else "") in err.message


def test_bodies_within_every_limit_pass():
    check_body({"messages": [USER] * 3, "max_tokens": 100, "stop": ["12345678"] * 4, "tools": [nested(4)]}, LIMITS)
    check_body("not an object: validation answers that", LIMITS)
    check_body({"messages": "wrong type: validation answers that", "stop": 5}, LIMITS)
    unlimited = Limits.from_settings(LimitSettings())
    check_body({"messages": [USER], "max_tokens": 10**9}, unlimited)  # the context check bounds it


def test_deep_or_broken_json_is_a_400_never_a_recursion_error():
    for raw in (b"[" * 100_000, b'{"a":' * 50_000):
        with pytest.raises(APIError) as caught:
            parse_body(raw, LIMITS)
        assert caught.value.status == 400
    with pytest.raises(APIError, match="nests more than 12 levels") as caught:
        parse_body(json.dumps(nested(4 + ENVELOPE_DEPTH + 1)).encode(), LIMITS)
    assert caught.value.param == "body"
    with pytest.raises(APIError, match="not valid JSON"):
        parse_body(b"\xff{", LIMITS)
    assert parse_body(b'{"messages": []}', LIMITS) == {"messages": []}


def test_a_lone_surrogate_is_a_400_and_a_surrogate_pair_is_text():
    with pytest.raises(APIError, match="lone UTF-16 surrogate") as caught:
        parse_body(b'{"prompt": "a\\ud800b"}', LIMITS)  # found by the fuzzer: the tokenizer raised (500)
    assert (caught.value.param, caught.value.code) == ("body", "invalid_unicode")
    assert parse_body(b'{"prompt": "\\ud83d\\ude00"}', LIMITS) == {"prompt": "\U0001f600"}


async def test_the_served_limits_answer_before_the_model(fake_engine):
    settings = Settings(limits=LimitSettings(max_body_bytes=4096, max_messages=2))
    server = TestServer(make_app(settings, fake_engine, "cpu", "float32"), host="127.0.0.1")
    await server.start_server()
    url = server.make_url("/v1/chat/completions")
    try:
        async with aiohttp.ClientSession() as session:
            async with session.post(url, json={"messages": [{"role": "user", "content": "x" * 5000}]}) as resp:
                error = (await resp.json())["error"]
                assert resp.status == 413 and error["param"] == "body" and "4096 bytes" in error["message"]
            async with session.post(url, json={"messages": [USER] * 3}) as resp:
                assert resp.status == 400 and (await resp.json())["error"]["param"] == "messages"
            async with session.post(url, data=b"[" * 3000) as resp:
                assert resp.status == 400 and (await resp.json())["error"]["code"] == "too_deep"
            for body, param in (({"messages": [USER], "n": 2}, "n"), ({"messages": [USER], "logprobs": 1}, "logprobs"),
                                ({"messages": [USER], "top_logprobs": 21}, "top_logprobs")):
                async with session.post(url, json=body) as resp:
                    assert resp.status == 400 and (await resp.json())["error"]["param"] == param
            async with session.post(url, json={"messages": [USER], "max_tokens": 2}) as resp:
                assert resp.status == 200
    finally:
        await server.close()
