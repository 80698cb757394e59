"""Slow prefill and queueing never look like a dead server (issue 20, item 3): a stream's
headers and first event leave at once, then a keepalive at least every KEEPALIVE_S until
tokens flow (Messages `ping` events, SSE comments on Chat and Responses)."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest

from memrad.server import serving
from tests.unit.fake_engine import SlowEngine
from tests.unit.listening import listening

USER = [{"role": "user", "content": "hi"}]
FIRST = {  # path -> (body, the first event's check)
    "/v1/chat/completions": ({"messages": USER, "max_tokens": 2},
                             lambda e: e["data"]["choices"][0]["delta"] == {"role": "assistant", "content": ""}),
    "/v1/responses": ({"input": "hi", "max_output_tokens": 2}, lambda e: e["event"] == "response.created"),
    "/v1/messages": ({"model": "default", "max_tokens": 2, "messages": USER},
                     lambda e: e["event"] == "message_start" and e["data"]["message"]["usage"]["input_tokens"] > 0),
}
KEEPALIVE = {"/v1/chat/completions": ": keepalive", "/v1/responses": ": keepalive", "/v1/messages": "event: ping"}


async def timed_lines(resp, started: float) -> list[tuple[float, str]]:
    lines = []
    async for raw in resp.content:
        line = raw.decode().rstrip("\n")
        if line:
            lines.append((time.monotonic() - started, line))
    return lines


def first_event(lines: list[tuple[float, str]]) -> tuple[float, dict]:
    event, at = None, None
    for t, line in lines:
        if line.startswith("event: "):
            event, at = line[7:], t
        elif line.startswith("data: "):
            return (at if event else t), {"event": event, "data": json.loads(line[6:])}
    raise AssertionError(lines)


@pytest.mark.parametrize("path", list(FIRST))
async def test_a_slow_prefill_streams_its_first_event_at_once_then_keepalives(path, monkeypatch):
    monkeypatch.setattr(serving, "KEEPALIVE_S", 0.2)
    engine = SlowEngine(step_s=0.01, prefill_chunks=8, chunk_s=0.1)  # 0.8 s before the first token
    body, is_first = FIRST[path]
    async with listening(engine) as (url, _), aiohttp.ClientSession() as http:
        started = time.monotonic()
        async with http.post(url + path, json={**body, "stream": True}) as resp:
            headers_at = time.monotonic() - started
            lines = await timed_lines(resp, started)
    at, event = first_event(lines)
    assert headers_at < 0.5 and at < 0.5 and is_first(event), (headers_at, lines[:3])
    pings = [t for t, line in lines if line == KEEPALIVE[path]]
    assert 3 <= len(pings) <= 5, lines  # 0.8 s of prefill / 0.2 s
    assert all(b - a < 0.35 for a, b in zip([0.0, *pings], pings)), pings


@pytest.mark.parametrize("path", list(FIRST))
async def test_a_queued_stream_gets_headers_and_its_first_event_while_it_waits(path, monkeypatch):
    monkeypatch.setattr(serving, "KEEPALIVE_S", 0.2)
    engine = SlowEngine(step_s=0.01, prefill_chunks=10, chunk_s=0.1)
    body, is_first = FIRST[path]
    async with listening(engine) as (url, _), aiohttp.ClientSession() as http:
        ahead = asyncio.ensure_future(http.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}))
        await asyncio.to_thread(engine.started.wait, 5)
        started = time.monotonic()
        async with http.post(url + path, json={**body, "stream": True}) as resp:
            headers_at = time.monotonic() - started
            assert "x-memra-decision" not in resp.headers  # not decided yet: it is queued
            lines = await timed_lines(resp, started)
        (await ahead).close()
    at, event = first_event(lines)
    # The decision waits DECISION_WAIT_S for a running job; a queued one goes without it.
    assert headers_at < serving.DECISION_WAIT_S + 0.3 and at < serving.DECISION_WAIT_S + 0.3 and is_first(event)
    pings = [t for t, line in lines if line == KEEPALIVE[path]]
    assert len(pings) >= 6, lines  # ~1 s queued + ~1 s of its own prefill
    assert lines[-1][1] in ("data: [DONE]", 'data: {"type": "message_stop"}') or lines[-2][1] == "event: response.incomplete"  # max_output_tokens
