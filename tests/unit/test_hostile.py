"""Hostile input, round three (issue 35): each finding of the held-out pass, reproduced as a
client (or a local process) would send it, and what memrad does now."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import aiohttp
import pytest

from memrad.chat.grammar import Grammars, json_constraint
from memrad.chat.schema_cost import MAX_PATTERN_PROPERTIES, costly_part, pattern_repeats
from memrad.config import LimitSettings, ServerSettings, Settings
from memrad.request import GenerationRequest, SamplingParams
from memrad.scheduler import Scheduler
from memrad.server.prepare import Gone, Lane, Preparer
from tests.unit.fake_engine import FakeEngine, SlowEngine
from tests.unit.listening import listening

PATTERN_FLOOD = {"type": "object", "patternProperties": {f"^p{i}_[a-z]+$": {"type": "string"} for i in range(500)}}
NESTED_REPEATS = {"type": "object", "properties": {"a": {"type": "string", "pattern": "^(a{1000}){1000}$"}},
                  "required": ["a"]}
ASK = [{"role": "user", "content": "hi"}]


async def post(url: str, path: str, body: dict) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as http, http.post(url + path, json=body) as resp:
        return resp.status, await resp.json()


# -- 1. a schema's grammar: a cost bound before any compile, then a worker with a time limit --

def test_the_cost_bound_names_the_costly_part_of_a_schema():
    assert costly_part(PATTERN_FLOOD, "response_format") == (
        f"response_format: 500 patternProperties in one object (at most {MAX_PATTERN_PROPERTIES}); "
        "simplify this part of the schema")
    assert costly_part(NESTED_REPEATS, "tools[0]") == (
        "tools[0].properties.a: the pattern '^(a{1000}){1000}$' spells out 1,000,002 characters once its counted "
        "repetitions are expanded (at most 20,000); simplify this part of the schema")
    assert [pattern_repeats(p) for p in ("^[a-z]{1,64}$", "(a|b){5}", r"\{3\}", "((a{10}){10}){10}")] == [
        66, 10, 3, 1000]
    ordinary = {"type": "object", "properties": {"path": {"type": "string", "pattern": "^[^\\0]{1,4096}$"}},
                "required": ["path"]}
    assert costly_part(ordinary, "tools[0]") is None


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", {"messages": ASK, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": PATTERN_FLOOD}}}, "response_format"),
    ("/v1/responses", {"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": NESTED_REPEATS}}},
     "text"),
    # through a tool definition, no forced choice: the Messages case of the finding
    ("/v1/messages", {"model": "default", "max_tokens": 8, "messages": ASK,
                      "tools": [{"name": "t", "input_schema": PATTERN_FLOOD}]}, "tools[0]"),
])
async def test_a_costly_schema_is_a_400_before_anything_is_compiled(path, body, param):
    engine = FakeEngine()
    async with listening(engine) as (url, _):
        started = time.monotonic()
        status, answer = await post(url, path, body)
    assert status == 400 and time.monotonic() - started < 1.0
    message = answer["error"]["message"]
    assert "would cost too much to compile" in message and message.startswith(param)
    if path != "/v1/messages":
        assert answer["error"]["code"] == "schema_too_costly" and answer["error"]["param"] == param


def nested_patterns(objects: int = 20) -> dict:
    """Under the cost bound, yet ~0.7 s to compile on this machine: the time limit's case."""
    return {"type": "object", "properties": {f"o{j}": {"type": "object", "patternProperties": {
        f"^p{i}_{j}[a-z]+$": {"type": "string"} for i in range(MAX_PATTERN_PROPERTIES)}} for j in range(objects)}}


async def test_a_slow_compile_runs_off_the_loop_and_past_its_limit_is_a_400_then_refused_at_once(tiny_engine):
    from test_server import serve as started

    from memrad.server.prepare import PREPARER

    tiny_engine.chat.grammars.compile_limit_s = 0.05  # limits.grammar_compile_s, as the daemon sets both
    server = await started(tiny_engine)
    server.app[PREPARER].grammar_compile_s = 0.05
    url = str(server.make_url(""))
    body = {"messages": ASK, "max_tokens": 4, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": nested_patterns()}}}
    try:
        async with aiohttp.ClientSession() as http:
            slow = asyncio.ensure_future(http.post(url + "/v1/chat/completions", json=body))
            await asyncio.sleep(0.05)
            health = []
            while not slow.done():  # the loop answers while the grammar compiles on its worker
                t0 = time.perf_counter()
                async with http.get(url + "/health") as resp:
                    assert resp.status == 200
                health.append(time.perf_counter() - t0)
                await asyncio.sleep(0.02)
            async with await slow as resp:
                first = resp.status, await resp.json()
            for _ in range(400):  # the compile finishes in the background; its verdict is cached
                if tiny_engine.chat.grammars._compiled:
                    break
                await asyncio.sleep(0.05)
            t0 = time.perf_counter()
            async with http.post(url + "/v1/chat/completions", json=body) as resp:
                again = resp.status, await resp.json(), time.perf_counter() - t0
    finally:
        await server.close()
    assert first[0] == 400 and first[1]["error"]["code"] == "grammar_too_slow"
    assert first[1]["error"]["param"] == "response_format.json_schema.schema"
    assert "limits.grammar_compile_s (0.05 s)" in first[1]["error"]["message"]
    assert health and max(health) < 0.25  # /health was blocked for the whole compile before
    assert again[0] == 400 and again[1]["error"]["code"] == "grammar_too_slow"
    took_s = float(again[1]["error"]["message"].split("compiling took ")[1].split(" s")[0])
    assert again[2] < took_s / 2  # the cached verdict, not a second compile


# -- 2. a grammar that cannot continue ends as an error the client sees ----------------------

class FailingMatcher:
    """An llguidance matcher whose lexer gives up after `ok` tokens, as `(a{1000}){1000}` did."""

    def __init__(self, inner, ok: int):
        self.inner, self.ok, self.failed = inner, ok, False

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def consume_token(self, token):
        if self.ok == 0:
            self.failed = True
            return False
        self.ok -= 1
        return self.inner.consume_token(token)

    def is_error(self):
        return self.failed or self.inner.is_error()

    def get_error(self):
        return "lexer error: too many expressions constructed" if self.failed else self.inner.get_error()


@pytest.mark.parametrize("stream", [False, True])
async def test_a_grammar_that_cannot_continue_is_an_error_never_a_stop(tiny_engine, monkeypatch, stream):
    from test_server import serve as started

    grammars = tiny_engine.chat.grammars
    real = grammars.matcher
    monkeypatch.setattr(grammars, "matcher", lambda constraint: FailingMatcher(real(constraint), ok=2))
    server = await started(tiny_engine)
    schema = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
    body = {"messages": ASK, "max_tokens": 20, "temperature": 0, "stream": stream,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(str(server.make_url("/v1/chat/completions")), json=body) as resp:
                status, raw = resp.status, await resp.text()
    finally:
        await server.close()
    param = "response_format.json_schema.schema"
    want = (f"the reply's grammar (from {param}) could not continue after 3 tokens: lexer error: too many "
            "expressions constructed; simplify the schema")
    if not stream:
        assert status == 400
        assert json.loads(raw)["error"] == {"message": want, "type": "invalid_request_error",
                                            "param": param, "code": "grammar_failed"}
    else:
        events = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: {")]
        assert status == 200 and events[-1] == {"error": {"message": want, "type": "invalid_request_error",
                                                          "param": param, "code": "grammar_failed"}}
        assert not any(e.get("choices") and e["choices"][0].get("finish_reason") for e in events[:-1])


# -- 3. request heads without bodies hold no serving slot -------------------------------------

def head_only(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
                 "Content-Length: 1000\r\n\r\n{".encode())
    return sock


async def test_request_heads_without_bodies_hold_no_serving_slot():
    settings = Settings(server=ServerSettings(max_connections=4, max_body_connections=2))
    async with listening(FakeEngine(), settings) as (url, listener):
        heads = [head_only(listener.port) for _ in range(6)]
        await asyncio.sleep(0.3)
        reading = [c for c in listener.connections.open if c.reading]
        closed = listener.connections.closed_reading + listener.connections.closed_idle  # idle: not yet a head
        assert len(reading) == 2 and listener.connections.closed_reading >= 2 and closed == 4  # bodies' own budget
        started = time.monotonic()
        async with aiohttp.ClientSession() as http:
            async with http.get(url + "/health") as resp:  # used to be a 503: every slot "busy"
                assert resp.status == 200
            for _ in range(3):  # at the cap, the oldest body still arriving makes room
                async with http.post(url + "/v1/chat/completions", json={"messages": ASK, "max_tokens": 2}) as resp:
                    assert resp.status == 200
        assert time.monotonic() - started < 2.0 and listener.connections.refused == 0
        for sock in heads:
            sock.close()


# -- 4. a hung-up client's queue entry leaves the queue --------------------------------------

async def test_a_hung_up_clients_queue_entry_holds_no_place_and_leaves_within_one_step():
    engine = SlowEngine(step_s=0.05)
    scheduler = Scheduler(engine, max_queue=2)
    request = lambda i: GenerationRequest(f"r{i}", "m", (1, 2), "ab", SamplingParams(max_tokens=40))  # noqa: E731
    running = scheduler.submit(request(0))
    await asyncio.sleep(0.1)
    abandoned = [scheduler.submit(request(i)) for i in (1, 2)]
    for job in abandoned:
        job.cancel()  # their clients hung up (serving's _ClientWatch.mark_gone)
    assert scheduler.waiting == 0 and scheduler.can_admit()  # at once, not when the model frees up
    live = scheduler.submit(request(3))  # used to be QueueFull: "retry in N s" with nobody waiting
    assert scheduler.waiting == 1
    running.cancel()  # this fake's one step is its whole request: the next iteration drops the abandoned
    results = await asyncio.wait_for(asyncio.gather(*(j.result for j in abandoned)), 5)
    assert results == [None, None] and engine.requests[-1].request_id == "r3"  # never run, and the live one was
    await asyncio.wait_for(live.result, 10)
    await scheduler.close(1.0)


# -- 6. preparation lanes by size, smallest first; gone clients skipped ------------------------

async def test_the_smallest_body_waiting_is_prepared_first_and_a_gone_clients_is_skipped():
    lane, order, gate = Lane("test-lane"), [], threading.Event()
    blocker = lane.submit(900_000, gate.wait, (5,), lambda: False)
    bigs = [lane.submit(900_000 + i, order.append, (f"big{i}",), lambda: False) for i in range(12)]
    small = lane.submit(1_000, order.append, ("small",), lambda: False)
    ran = []
    gone = lane.submit(500, ran.append, ("gone",), lambda: True)
    gate.set()
    small.result(5), gone.exception(5), [b.result(5) for b in bigs], blocker.result(5)
    assert order[0] == "small" and order[1:] == [f"big{i}" for i in range(12)]
    assert isinstance(gone.exception(), Gone) and ran == []
    lane.close()
    preparer = Preparer(2**30, 60.0, 5.0)
    assert [name for name in (preparer.lane(n)._thread.name for n in (1_000, 65_535, 65_536, 2**20 - 1, 2**20))] == [
        "memrad-prepare-small", "memrad-prepare-small", "memrad-prepare-medium", "memrad-prepare-medium",
        "memrad-prepare-large"]
    preparer.close()


# -- 8. echoed client values are cut, with their length --------------------------------------

async def test_an_echoed_client_value_is_cut_with_its_length_in_the_error_and_the_log(caplog):
    role = "r" * 5_000_000
    kind = "k" * 1_000_000
    caplog.set_level("INFO", logger="memrad.server")
    async with listening(FakeEngine()) as (url, _):
        status, answer = await post(url, "/v1/chat/completions", {"messages": [{"role": role, "content": "x"}]})
        ok, reply = await post(url, "/v1/responses", {"input": [{"type": kind}, {"role": "user", "content": "hi"}],
                                                      "max_output_tokens": 2})
    message = answer["error"]["message"]
    assert status == 400 and len(message) < 300 and f"...({len(role)} chars)" in message
    assert ok == 200 and any(f"...({len(kind)} chars)" in note and len(note) < 300 for note in reply["memra"]["notes"])
    assert max(len(r.getMessage()) for r in caplog.records) < 2000


# -- 10. tool names and parameter types ------------------------------------------------------

@pytest.mark.parametrize("tool,code", [
    ({"type": "function", "function": {"name": "x</tool_call>", "parameters": {"type": "object"}}}, "invalid_tool_name"),
    ({"type": "function", "function": {"name": "has space"}}, "invalid_tool_name"),
    ({"type": "function", "function": {"name": "echo", "parameters": {"type": "string"}}}, "invalid_tool_parameters"),
])
async def test_a_tool_whose_calls_could_never_parse_is_a_400(tool, code):
    async with listening(FakeEngine()) as (url, _):
        status, answer = await post(url, "/v1/chat/completions", {"messages": ASK, "tools": [tool],
                                                                   "tool_choice": "required"})
    assert status == 400 and answer["error"]["code"] == code and answer["error"]["param"] == "tools[0]"
    # the names agent CLIs send pass: Claude Code's, Codex's, MCP's
    from memrad.server.tools import TOOL_NAME
    assert all(TOOL_NAME.fullmatch(n) for n in ("Bash", "apply_patch", "mcp__github__create_issue", "fs.read", "a:b-c"))


# -- 11. an oversized max_tokens, per API ----------------------------------------------------

@pytest.mark.parametrize("path,body,field", [
    ("/v1/chat/completions", {"messages": ASK, "max_tokens": 10**30}, "max_tokens"),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 10**30}, "max_output_tokens"),
    ("/v1/messages", {"model": "default", "messages": ASK, "max_tokens": 10**30}, "max_tokens"),
])
async def test_an_oversized_max_tokens_is_lowered_with_a_note_unless_a_limit_is_set(path, body, field):
    async with listening(FakeEngine()) as (url, _):
        status, answer = await post(url, path, body)
    assert status == 200 and any(n.startswith(f"max_tokens {10**30} lowered to") for n in answer["memra"]["notes"])
    limited = Settings(limits=LimitSettings(max_tokens=1000))
    async with listening(FakeEngine(), limited) as (url, _):
        status, answer = await post(url, path, body)
    assert status == 400 and "limits.max_tokens" in json.dumps(answer)


def test_servings_limits_table_says_what_the_code_does_with_an_oversized_max_tokens():
    from pathlib import Path

    table = (Path(__file__).parents[2] / "docs" / "SERVING.md").read_text()
    row = next(line for line in table.splitlines() if line.startswith("| `max_tokens` / `max_completion_tokens`"))
    assert "lowered" in row and "`limits.max_tokens`" in row and "0: none refused" in row


# -- the bench cases (memrad bench faults grammar|slow-body|abandoned-queue), on a fake engine --

@pytest.mark.parametrize("case", ["slow-body", "abandoned-queue"])
async def test_the_hostile_bench_cases_run_and_pass_against_a_fake_engine(case, capsys):
    from memrad.bench import hostile

    engine = SlowEngine(step_s=0.02)
    async with listening(engine, Settings(server=ServerSettings(max_queue=12))) as (url, _):
        assert await hostile.run(url, case, max_tokens=60)
    out = capsys.readouterr().out
    assert out.startswith(f"{case}: /health p99 ") and "longest stream gap" in out and "answered [200" in out
