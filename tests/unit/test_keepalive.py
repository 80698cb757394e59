"""Slow prefill and queueing never look like a dead server (issue 20, item 3; issue 36, item 3):
a stream's headers and first event leave at once, then a keepalive at least every KEEPALIVE_S
until tokens flow: what each API's clients count (Messages `ping` events, Responses
`response.in_progress` events, since Codex CLI's idle timer counts events and never sees a
comment; SSE comments on Chat Completions, whose clients time bytes)."""

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
KEEPALIVE = {"/v1/chat/completions": ": keepalive", "/v1/responses": "event: response.in_progress",
             "/v1/messages": "event: ping"}


def keepalives(lines, path):
    """When each keepalive arrived (Responses' opening in_progress event is not one)."""
    found = [t for t, line in lines if line == KEEPALIVE[path]]
    return found[1:] if path == "/v1/responses" else found


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
    pings = keepalives(lines, path)
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
    pings = keepalives(lines, path)
    assert len(pings) >= 6, lines  # ~1 s queued + ~1 s of its own prefill
    assert lines[-1][1] in ("data: [DONE]", 'data: {"type": "message_stop"}') or lines[-2][1] == "event: response.incomplete"  # max_output_tokens


@pytest.mark.parametrize("path", ["/v1/responses", "/v1/messages"])
async def test_event_counting_clients_get_events_not_comments_before_the_first_token(path, monkeypatch):
    # Codex CLI: `timeout(stream_idle_timeout, eventsource.next())`: a comment is no event
    monkeypatch.setattr(serving, "KEEPALIVE_S", 0.2)
    engine = SlowEngine(step_s=0.01, prefill_chunks=12, chunk_s=0.1)
    body, _ = FIRST[path]
    async with listening(engine) as (url, _), aiohttp.ClientSession() as http:
        async with http.post(url + path, json={**body, "stream": True}) as resp:
            lines = await timed_lines(resp, time.monotonic())
    assert not any(line.startswith(":") for _, line in lines), lines
    events = [json.loads(line[6:]) for _, line in lines if line.startswith("data: ")]
    first_text = next(i for i, e in enumerate(events) if e["type"] in ("response.output_text.delta", "content_block_delta"))
    waiting = [e for e in events[:first_text] if e["type"] in ("response.in_progress", "ping")]
    assert len(waiting) >= 3, events[:first_text]  # 1.2 s of prefill / 0.2 s (+ the opening in_progress)
    if path == "/v1/responses":
        numbers = [e["sequence_number"] for e in events]
        assert numbers == list(range(len(events)))  # one counter for every event, keepalives too
        assert all(e["response"]["status"] == "in_progress" for e in waiting)
