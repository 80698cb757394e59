"""What the four pinned agent CLIs send, replayed through the real app (issue 20).

The bodies in tests/fixtures/agent_clis/ were captured from Codex 0.171.0, Claude Code
2.1.197, Qwen Code 0.15.10 and opencode 1.18.33 (long texts trimmed, shapes kept). Each was
a 400 or a loop before; each test asserts the request is served (2xx) and the exact effect
on the rendered prompt, the parsed request or the reply. The engine is torch-free (only
the next words are scripted) behind the real tiny ChatML tokenizer, chat template and reply
parser, so rendering is the real path.
"""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from memrad.chat.chat import Chat
from memrad.chat.render import fold_systems
from memrad.config import LimitSettings, ServerSettings, Settings
from memrad.server.app import make_app
from memrad.server.messages_api import signature
from memrad.server.metrics import parse_samples
from scripted_chat import ScriptedChatEngine
from tiny import build_tokenizer

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "agent_clis"


def fixture(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}.json").read_text())


@pytest.fixture(scope="module")
def chat():
    return Chat(build_tokenizer())


@pytest.fixture
def engine(chat):
    return ScriptedChatEngine(chat)


@contextlib.asynccontextmanager
async def serving(engine, settings: Settings | None = None):
    server = TestServer(make_app(settings or Settings(), engine, "cpu", "float32"), host="127.0.0.1")
    await server.start_server()
    try:
        yield server
    finally:
        await server.close()


@pytest.fixture
async def server(engine):
    async with serving(engine) as server:
        yield server


async def post(server, path: str, body: dict, headers: dict | None = None) -> tuple[int, dict | list]:
    """POST; a streamed answer comes back as its list of (event, data) pairs."""
    async with aiohttp.ClientSession() as session:
        async with session.post(server.make_url(path), json=body, headers=headers or {}) as resp:
            if resp.content_type == "text/event-stream":
                return resp.status, sse_events(await resp.text())
            return resp.status, await resp.json()


async def replay(server, name: str) -> tuple[int, dict | list]:
    captured = fixture(name)
    headers = {k: v for k, v in captured["headers"].items() if k != "user-agent"}
    return await post(server, captured["path"], captured["body"], headers)


def sse_events(text: str) -> list[tuple[str | None, dict | str]]:
    events = []
    for block in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.split("\n") if ": " in line)
        data = lines.get("data", "")
        events.append((lines.get("event"), data if data == "[DONE]" else json.loads(data)))
    return events


def prompt(engine) -> str:
    return engine.requests[-1].prompt_text


def completed(events) -> dict:
    """The final response object of a Responses stream."""
    return [d for e, d in events if e in ("response.completed", "response.incomplete")][-1]["response"]


# --- Responses: Codex ---------------------------------------------------------------------

async def test_codex_first_turn_flattens_the_namespace_and_leaves_web_search_out(server, engine):
    status, events = await replay(server, "codex_tool_001")
    assert status == 200
    text = prompt(engine)
    for name in ("exec_command", "update_goal", "spawn_agent", "close_agent", "wait_agent"):
        assert f'"name": "{name}"' in text  # the namespace's five functions, flat among the others
    assert "multi_agent_v1" not in text and "web_search" not in text
    # Both developer messages render as system turns, in order, before the two user turns.
    assert text.count("<|im_start|>system\n") == 2 and text.count("<|im_start|>user\n") == 2
    response = completed(events)
    assert response["memra"]["notes"] == ["built-in tools this model cannot run were left out: web_search"]
    assert [item["type"] for item in response["output"]] == ["message"]


async def test_codex_call_of_a_namespaced_function_names_the_namespace_again(server, engine):
    engine.replies.append('<tool_call>\n{"name": "spawn_agent", "arguments": {"message": "go"}}\n</tool_call>')
    status, events = await replay(server, "codex_tool_001")
    assert status == 200
    done = [d["item"] for e, d in events if e == "response.output_item.done"]
    assert [(i["type"], i["name"], i.get("namespace")) for i in done] == [
        ("function_call", "spawn_agent", "multi_agent_v1")]
    assert json.loads(done[0]["arguments"]) == {"message": "go"}


async def test_codex_tool_round_trip_renders_the_call_and_its_output(server, engine):
    status, _ = await replay(server, "codex_tool_002")
    assert status == 200
    assert ('<tool_call>\n{"name": "exec_command", "arguments": {"cmd": "ls -la"}}\n</tool_call><|im_end|>\n'
            '<|im_start|>user\n<tool_response>\nChunk ID: ') in prompt(engine)


async def test_codex_reasoning_item_with_null_encrypted_content_renders_its_text(server, engine):
    status, _ = await replay(server, "codex_reasoning_tool_002")
    assert status == 200
    assert ("<|im_start|>assistant\n<think>\nThe user wants something; I will answer.\n</think>\n\n<tool_call>\n"
            '{"name": "exec_command"') in prompt(engine)


async def test_codex_custom_apply_patch_is_a_one_string_function_and_builtins_are_noted(server, engine):
    engine.replies.append('<tool_call>\n{"name": "apply_patch", "arguments": {"input": "*** Begin Patch\\n'
                          '*** End Patch\\n"}}\n</tool_call>')
    status, events = await replay(server, "codex_model_gpt55_001")
    assert status == 200
    text = prompt(engine)
    assert '"name": "apply_patch"' in text and "The input follows this lark grammar:\\nstart: begin_patch" in text
    assert '"required": ["input"]' in text and '"name": "tool_search"' not in text
    response = completed(events)
    assert response["memra"]["notes"] == [
        "built-in tools this model cannot run were left out: tool_search, web_search"]
    [item] = response["output"]
    assert (item["type"], item["name"], item["input"]) == ("custom_tool_call", "apply_patch",
                                                           "*** Begin Patch\n*** End Patch\n")
    assert item["id"].startswith("ctc_") and "arguments" not in item
    kinds = [e for e, _ in events]
    assert kinds.index("response.custom_tool_call_input.done") < kinds.index("response.output_item.done")


async def test_codex_custom_tool_call_and_output_history_render_as_a_call_and_a_result(server, engine):
    status, _ = await replay(server, "codex_model_gpt55_002")
    assert status == 200
    assert ('<tool_call>\n{"name": "apply_patch", "arguments": {"input": "*** Begin Patch\\n*** Add File: '
            'NOTE.txt\\n+hi\\n*** End Patch\\n"}}\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n'
            'Exit code: 0\nWall time: 0 seconds\n') in prompt(engine)


async def test_responses_skips_unknown_items_and_replaces_images_deterministically(server, engine):
    body = {"model": "gpt-5.5", "input": [
        {"type": "message", "id": "msg_1", "role": "user", "content": [
            {"type": "input_text", "text": "look"}, {"type": "input_image", "image_url": "data:image/png;base64,AA"}]},
        {"type": "web_search_call", "id": "ws_1", "status": "completed", "action": {"type": "search"}},
        {"type": "function_call", "call_id": "c1", "name": "view_image", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": [
            {"type": "input_text", "text": "an image:"}, {"type": "input_image", "image_url": "x"}]}],
        "tools": [{"type": "function", "name": "view_image", "parameters": {"type": "object", "properties": {}}}],
        "include": ["reasoning.encrypted_content"], "store": False, "client_metadata": {"a": "b"},
        "text": {"verbosity": "low", "format": {"type": "json_schema", "name": "x", "schema": {}}},
        "reasoning": {"effort": "medium", "summary": "auto"}}
    status, first = await post(server, "/v1/responses", body)
    assert status == 200
    placeholder = "[image omitted: this model reads text only]"
    assert f"<|im_start|>user\nlook\n{placeholder}<|im_end|>" in prompt(engine)
    assert f"<tool_response>\nan image:\n{placeholder}\n</tool_response>" in prompt(engine)
    assert "web_search" not in prompt(engine)
    assert first["memra"]["notes"] == [
        f"image parts were replaced by the text {placeholder!r}",
        "input items of type 'web_search_call' were skipped: memrad renders message, reasoning, function_call, "
        "custom_tool_call and their outputs"]
    assert first["model"] == "tiny-chatml"
    rendered = prompt(engine)
    await post(server, "/v1/responses", body)
    assert prompt(engine) == rendered  # skipped the same way every time


@pytest.mark.parametrize("reply, kinds", [
    ('Let me look.\n<tool_call>\n{"name": "view_image", "arguments": {}}\n</tool_call>\nThen more.',
     ["message", "function_call"]),
    ('<think>\nhmm\n</think>\n\nLet me look.\n<tool_call>\n{"name": "view_image", "arguments": {}}\n</tool_call>',
     ["reasoning", "message", "function_call"]),
])
async def test_responses_items_come_in_one_order_streamed_and_whole(server, engine, reply, kinds):
    body = {"model": "default", "input": "look",
            "tools": [{"type": "function", "name": "view_image", "parameters": {"type": "object", "properties": {}}}]}
    engine.replies.extend([reply, reply])
    _, whole = await post(server, "/v1/responses", body)
    _, events = await post(server, "/v1/responses", {**body, "stream": True})
    streamed = completed(events)
    strip = lambda items: [{k: v for k, v in i.items() if k not in ("id", "call_id")} for i in items]  # noqa: E731
    assert [i["type"] for i in whole["output"]] == [i["type"] for i in streamed["output"]] == kinds
    assert strip(whole["output"]) == strip(streamed["output"])
    added = [d["item"]["type"] for e, d in events if e == "response.output_item.added"]
    done = [d["item"] for e, d in events if e == "response.output_item.done"]
    assert added == [i["type"] for i in done] == kinds  # every item opened is closed, in order
    assert done == streamed["output"]
    if "reasoning" in kinds:
        assert done[0]["content"] == [{"type": "reasoning_text", "text": "hmm"}]
        assert done[0]["encrypted_content"] is None
    assert streamed["usage"]["input_tokens_details"] == {"cached_tokens": 0}


# --- Messages: Claude Code ----------------------------------------------------------------

async def test_claude_preflight_head_answers_200(server):
    async with aiohttp.ClientSession() as session:
        for path in ("/", "/api/hello"):
            async with session.head(server.make_url(path)) as resp:
                assert resp.status == 200


async def test_claude_title_query_with_output_config_format_is_served(server, engine):
    status, events = await replay(server, "claude_tool_002")
    assert status == 200
    assert events[0][1]["message"]["model"] == "tiny-chatml"  # asked for "default"
    assert events[-1][0] == "message_stop"


async def test_claude_system_turn_as_the_last_message_renders_as_a_system_turn(server, engine):
    status, events = await replay(server, "claude_tool_003")
    assert status == 200
    text = prompt(engine)
    reminder = "<|im_start|>system\nAvailable agent types for the Agent tool:\n"
    assert text.index("<|im_start|>user\n") < text.index(reminder) < text.rindex("<|im_start|>assistant\n")
    request = engine.requests[-1]
    # metadata.user_id is a JSON string: its session_id names the session.
    assert (request.identity.name, request.identity.source) == ("6814ef96-b77b-437f-a781-73f26a90402c",
                                                                "metadata.user_id")
    assert events[0][0] == "message_start"


async def test_claude_moves_cache_control_and_the_rendered_bytes_stay_a_prefix(server, engine):
    await replay(server, "claude_tool_003")
    turn1 = prompt(engine)
    status, _ = await replay(server, "claude_tool_004")
    assert status == 200
    turn2 = prompt(engine)
    opened = turn1[:-len("<|im_start|>assistant\n")]
    assert turn2.startswith(opened) and len(turn2) > len(turn1)
    assert '<tool_call>\n{"name": "Bash", "arguments": {"command": "ls -la"' in turn2[len(opened):]


async def test_claude_max_tokens_beyond_the_context_is_lowered_and_said(chat):
    engine = ScriptedChatEngine(chat, context_len=30_000)
    async with serving(engine, Settings(limits=LimitSettings(max_reply_tokens=0))) as server:
        status, events = await replay(server, "claude_tool_003")
    assert status == 200
    num_prompt = len(engine.requests[-1].prompt_ids)
    room = 30_000 - num_prompt
    assert engine.requests[-1].sampling.max_tokens == room
    assert events[0][1]["message"]["memra"]["notes"] == [
        f"max_tokens 32000 lowered to {room}: the prompt's {num_prompt} tokens leave {room} of this model's 30000"]


async def test_claude_max_tokens_past_the_reply_cap_is_lowered_to_it_and_said(chat):
    # The default cap (4,096) is below the room the prompt leaves (5,965): the cap decides.
    engine = ScriptedChatEngine(chat, context_len=30_000)
    async with serving(engine) as server:
        status, events = await replay(server, "claude_tool_003")
    assert status == 200
    assert 30_000 - len(engine.requests[-1].prompt_ids) > 4096
    assert engine.requests[-1].sampling.max_tokens == 4096
    assert events[0][1]["message"]["memra"]["notes"] == [
        "max_tokens 32000 lowered to 4096: this server's reply cap (limits.max_reply_tokens)"]


async def test_messages_thinking_signature_server_tools_media_and_many_stops(server, engine):
    engine.replies.append("<think>\nplan\n</think>\n\nDone.")
    body = {"model": "claude-haiku-4-5", "max_tokens": 64, "stream": True,
            "stop_sequences": [f"STOP{i}" for i in range(6)], "thinking": {"type": "adaptive"},
            "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
            "output_config": {"effort": "high"},
            "tools": [{"type": "web_search_20250305", "name": "web_search", "max_uses": 5},
                      {"name": "Read", "description": "Read a file", "input_schema": {"type": "object"},
                       "cache_control": {"type": "ephemeral"}}],
            "messages": [
                {"role": "user", "content": [
                    {"type": "text", "text": "see", "cache_control": {"type": "ephemeral"}},
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA"}},
                    {"type": "document", "source": {"type": "text", "data": "d"}}]},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "earlier", "signature": signature("earlier")},
                    {"type": "text", "text": "ok"}]},
                {"role": "user", "content": "go"}]}
    status, events = await post(server, "/v1/messages", body)
    assert status == 200
    text = prompt(engine)
    assert ("see\n[image omitted: this model reads text only]\n[document omitted: this model reads text only]"
            in text)
    assert "<think>\nearlier\n</think>\n\nok" in text and '"name": "Read"' in text and "web_search" not in text
    assert engine.requests[-1].sampling.stop == tuple(f"STOP{i}" for i in range(6))
    assert events[0][1]["message"]["memra"]["notes"] == [
        "image parts were replaced by the text '[image omitted: this model reads text only]'",
        "document parts were replaced by the text '[document omitted: this model reads text only]'",
        "server tools this model cannot run were left out: web_search_20250305"]
    # The thinking block closes with a stable signature, just before its content_block_stop.
    kinds = [(e, d.get("delta", {}).get("type")) for e, d in events]
    at = kinds.index(("content_block_delta", "signature_delta"))
    assert kinds[at + 1] == ("content_block_stop", None)
    assert events[at][1]["delta"]["signature"] == signature("plan")


def test_a_system_turn_folds_into_the_user_turn_before_it_where_the_template_has_none():
    assert fold_systems([{"role": "system", "content": "a"}, {"role": "system", "content": "b"},
                         {"role": "user", "content": "q"}, {"role": "system", "content": "s"},
                         {"role": "assistant", "content": "r"}, {"role": "user", "content": "q2"}]) == [
        {"role": "system", "content": "a\n\nb"}, {"role": "user", "content": "q\n\ns"},
        {"role": "assistant", "content": "r"}, {"role": "user", "content": "q2"}]
    # No user turn before it: it opens the next one (and a lone one becomes one).
    assert fold_systems([{"role": "assistant", "content": "r"}, {"role": "system", "content": "s"},
                         {"role": "user", "content": "q"}]) == [
        {"role": "assistant", "content": "r"}, {"role": "user", "content": "s\n\nq"}]


def test_a_template_that_writes_system_only_first_renders_claude_codes_last_system_turn_folded():
    tokenizer = build_tokenizer()
    tokenizer.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'system' and not loop.first %}"
        "{{ raise_exception('system only first') }}{% endif %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
        "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    chat = Chat(tokenizer)
    assert chat.format.system_anywhere is False
    text, _ = chat.render([{"role": "user", "content": "list files"}, {"role": "system", "content": "skills"}], None)
    assert text == "<|im_start|>user\nlist files\n\nskills<|im_end|>\n<|im_start|>assistant\n"
    assert Chat(build_tokenizer()).format.system_anywhere is True


# --- Chat Completions: Qwen Code, opencode -------------------------------------------------

async def test_qwen_tool_result_as_text_parts_after_a_null_content_call(server, engine):
    status, events = await replay(server, "qwen_tool_002")
    assert status == 200
    assert ('<tool_call>\n{"name": "list_directory", "arguments": {"path": "/work/capture/sandbox"}}\n</tool_call>'
            '<|im_end|>\n<|im_start|>user\n<tool_response>\nListed 2 item(s) in /work/capture/sandbox:'
            ) in prompt(engine)
    assert events[-1] == (None, "[DONE]")


async def test_qwen_compression_request_max_tokens_is_lowered_not_refused(chat):
    engine = ScriptedChatEngine(chat, context_len=4_000)
    async with serving(engine) as server:
        status, whole = await replay(server, "qwen_too_long_002")
    assert status == 200 and whole["object"] == "chat.completion"
    num_prompt = len(engine.requests[-1].prompt_ids)
    assert engine.requests[-1].sampling.max_tokens == 4_000 - num_prompt
    assert whole["memra"]["notes"] == [f"max_tokens 8000 lowered to {4_000 - num_prompt}: the prompt's "
                                       f"{num_prompt} tokens leave {4_000 - num_prompt} of this model's 4000"]


async def test_opencode_title_request_with_two_user_turns_is_served(server, engine):
    status, _ = await replay(server, "opencode_tool_001")
    assert status == 200
    assert prompt(engine).count("<|im_start|>user\n") == 2
    assert engine.requests[-1].identity.source == "x-session-id"


async def test_opencode_schemas_with_dollar_schema_and_huge_bounds_and_empty_call_content(server, engine):
    status, _ = await replay(server, "opencode_tool_003")
    assert status == 200
    text = prompt(engine)
    assert '"$schema": "https://json-schema.org/draft/2020-12/schema"' in text and "9007199254740991" in text
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "bash", "arguments": {"command": "ls -la"' in text


async def test_chat_tool_results_without_ids_pair_by_order_and_odd_arguments_render_as_sent(server, engine):
    body = {"model": "default", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "look"},
                                     {"type": "image_url", "image_url": {"url": "x"}}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "sh", "arguments": "ls -la"}},
            {"id": "b", "type": "function", "function": {"name": "sh", "arguments": "[1, 2]"}}]},
        {"role": "tool", "content": "first"}, {"role": "tool", "content": [{"type": "text", "text": "second"}]}],
        "tools": [{"type": "function", "function": {"name": "sh", "parameters": {"type": "object"}}}]}
    status, whole = await post(server, "/v1/chat/completions", body)
    assert status == 200
    text = prompt(engine)
    assert '{"name": "sh", "arguments": "ls -la"}' in text and '{"name": "sh", "arguments": [1, 2]}' in text
    assert "<tool_response>\nfirst\n</tool_response>\n<tool_response>\nsecond\n</tool_response>" in text
    assert "look\n[image omitted: this model reads text only]" in text
    assert whole["memra"]["notes"] == [
        "image parts were replaced by the text '[image omitted: this model reads text only]'",
        "tool messages without tool_call_id were paired with the calls in order"]
    body["messages"].append({"role": "tool", "content": "third"})
    status, error = await post(server, "/v1/chat/completions", body)
    assert (status, error["error"]["param"]) == (400, "messages[4].tool_call_id")


# --- Any API -------------------------------------------------------------------------------

async def test_unknown_model_names_are_served_by_the_loaded_model_logged_once(server, engine, caplog):
    caplog.set_level(logging.INFO, "memrad.server")
    body = {"model": "claude-haiku-4-5", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    for _ in range(2):
        status, message = await post(server, "/v1/messages", body)
        assert (status, message["model"]) == (200, "tiny-chatml")
    lines = [r.getMessage() for r in caplog.records if "claude-haiku-4-5" in r.getMessage()]
    assert lines == ['model "claude-haiku-4-5" is not served here; \'tiny-chatml\' answers it (and every later '
                     "request naming it)"]


async def test_strict_model_names_restores_the_404(engine):
    async with serving(engine, Settings(server=ServerSettings(strict_model_names=True))) as server:
        status, error = await post(server, "/v1/chat/completions",
                                   {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]})
    assert (status, error["error"]["code"], error["error"]["param"]) == (404, "model_not_found", "model")


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"model": "default", "messages": [{"role": "user", "content": "word " * 300}]},
     "messages"),
    ("/v1/responses", {"model": "default", "input": "word " * 300}, "input"),
])
async def test_a_prompt_that_alone_overflows_is_context_length_exceeded_naming_the_prompt(chat, path, body, param):
    engine = ScriptedChatEngine(chat, context_len=200)
    async with serving(engine) as server:
        status, error = await post(server, path, body)
    assert status == 400 and (error["error"]["code"], error["error"]["param"]) == ("context_length_exceeded", param)
    assert error["error"]["message"].startswith("This model's maximum context length is 200 tokens. However, your "
                                                "messages resulted in ")


async def test_a_messages_prompt_that_overflows_is_worded_as_anthropic_words_it(chat):
    engine = ScriptedChatEngine(chat, context_len=200)
    body = {"model": "default", "max_tokens": 10, "messages": [{"role": "user", "content": "word " * 300}]}
    async with serving(engine) as server:
        status, error = await post(server, "/v1/messages", body)
        _, count = await post(server, "/v1/messages/count_tokens", body)
    assert status == 400 and error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert error["error"]["message"] == f"prompt is too long: {count['input_tokens']} tokens > 199 maximum"


async def test_a_refusal_is_one_warning_line_and_counted_by_route_and_status(server, caplog):
    caplog.set_level(logging.WARNING, "memrad.server")
    async with aiohttp.ClientSession() as session:
        async with session.post(server.make_url("/v1/responses"), json={"input": []},
                                headers={"x-request-id": "req_test1"}) as resp:
            assert resp.status == 400 and resp.headers["x-request-id"] == "req_test1"
        async with session.get(server.make_url("/metrics")) as resp:
            samples = parse_samples(await resp.text())
    [line] = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert line.getMessage() == ("req_test1 refused POST /v1/responses: 400 input is required: a string or a "
                                 "non-empty array of input items")
    key = ("memra_http_requests_total", (("method", "POST"), ("route", "/v1/responses"), ("status", "400")))
    assert samples[key] == 1.0
