"""Connections as the daemon serves them: a gone client cancels its work within one engine
step on every API (streamed or not, 499 in /metrics), a half-closed request is answered,
and idle, slow and surplus connections end (memrad.server.connections)."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import aiohttp
import pytest

from memrad.config import ServerSettings, Settings
from memrad.server.metrics import parse_samples
from tests.unit.fake_engine import SlowEngine
from tests.unit.listening import listening

BODIES = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1000},
    "/v1/completions": {"prompt": "hi", "max_tokens": 1000},
    "/v1/responses": {"input": "hi", "max_output_tokens": 1000},
    "/v1/messages": {"model": "default", "max_tokens": 1000, "messages": [{"role": "user", "content": "hi"}]},
}


def raw_request(port: int, path: str, body: dict) -> bytes:
    data = json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n").encode() + data


async def metrics(url: str) -> dict:
    async with aiohttp.ClientSession() as http, http.get(url + "/metrics") as resp:
        return parse_samples(await resp.text())


def status_count(samples: dict, route: str, status: str) -> float:
    return samples.get(("memra_http_requests_total", (("method", "POST"), ("route", route), ("status", status))), 0)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", list(BODIES))
async def test_a_client_that_hangs_up_is_noticed_within_one_decode_step(path, stream):
    # Tokens every 10 ms: the old watch only looked for a gone client after 50 ms without a
    # token, so a non-streaming request decoded to max_tokens for nobody.
    engine = SlowEngine(step_s=0.01)
    async with listening(engine) as (url, listener):
        port = listener.port
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(raw_request(port, path, {**BODIES[path], "stream": stream}))
        await writer.drain()
        await asyncio.to_thread(engine.started.wait, 5)
        await asyncio.sleep(0.2)
        writer.close()
        closed_at = time.monotonic()
        for _ in range(100):
            if engine.cancel_seen_at is not None:
                break
            await asyncio.sleep(0.01)
        assert engine.cancel_seen_at is not None, f"still decoding: {engine.tokens} tokens"
        assert engine.cancel_seen_at - closed_at < 0.1  # the probe's reset plus one 10 ms step
        assert engine.tokens < 40
        await asyncio.sleep(0.05)
        samples = await metrics(url)
        assert status_count(samples, path, "499") == 1
        assert status_count(samples, path, "503") == 0


async def test_a_client_that_hangs_up_during_prefill_stops_it_after_the_chunk_in_progress():
    engine = SlowEngine(step_s=0.01, prefill_chunks=20, chunk_s=0.1)
    async with listening(engine) as (url, listener):
        reader, writer = await asyncio.open_connection("127.0.0.1", listener.port)
        writer.write(raw_request(listener.port, "/v1/chat/completions", BODIES["/v1/chat/completions"]))
        await writer.drain()
        await asyncio.to_thread(engine.started.wait, 5)
        await asyncio.sleep(0.25)
        writer.close()
        for _ in range(100):
            if engine.cancel_seen_at is not None:
                break
            await asyncio.sleep(0.01)
        assert engine.chunks_run in (2, 3) and engine.tokens == 0


def half_closed_exchange(port: int, path: str, body: dict) -> bytes:
    """Send the whole request, shutdown(SHUT_WR) as some clients do, read to the end."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(raw_request(port, path, body))
        sock.shutdown(socket.SHUT_WR)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


@pytest.mark.parametrize("stream", [False, True])
async def test_a_half_closed_request_is_answered(stream):
    engine = SlowEngine(step_s=0.01)
    async with listening(engine) as (url, listener):
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": stream}
        answer = await asyncio.to_thread(half_closed_exchange, listener.port, "/v1/chat/completions", body)
    # The probes that tell a half-close from a hang-up are interim responses, which every
    # HTTP/1.1 client skips (RFC 9110 15.2); then the answer.
    interim = b"HTTP/1.1 100 Continue\r\n\r\n"
    probes = 0
    while answer.startswith(interim):
        answer, probes = answer[len(interim):], probes + 1
    assert 1 <= probes <= 5 and answer.startswith(b"HTTP/1.1 200 OK\r\n"), answer[:80]
    assert engine.tokens == 5
    if stream:
        assert answer.count(b'"content": "ok "') == 5 and answer.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")
    else:
        assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["choices"][0]["message"]["content"] == "ok " * 5
