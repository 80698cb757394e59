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
        # The probe's reset plus one 10 ms step (slack for a loaded machine); before, never.
        assert engine.cancel_seen_at - closed_at < 0.5
        assert engine.tokens < 80
        await asyncio.sleep(0.05)
        samples = await metrics(url)
        assert status_count(samples, path, "499") == 1
        assert status_count(samples, path, "503") == 0


async def test_a_client_that_hangs_up_during_prefill_stops_it_after_the_chunk_in_progress():
    engine = SlowEngine(step_s=0.01, prefill_chunks=20, chunk_s=0.3)
    async with listening(engine) as (url, listener):
        reader, writer = await asyncio.open_connection("127.0.0.1", listener.port)
        writer.write(raw_request(listener.port, "/v1/chat/completions", BODIES["/v1/chat/completions"]))
        await writer.drain()
        await asyncio.to_thread(engine.started.wait, 5)
        await asyncio.sleep(0.45)  # inside the second chunk
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


def raw_socket(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    return sock


def closed_within(sock: socket.socket, seconds: float) -> bool:
    """True if the server closes `sock` within `seconds` (reads until EOF, dropping data)."""
    sock.settimeout(seconds)
    try:
        while sock.recv(65536):
            pass
        return True
    except (TimeoutError, socket.timeout):
        return False
    except ConnectionResetError:
        return True


def limited(**server) -> Settings:
    return Settings(server=ServerSettings(**{"shutdown_grace_s": 1.0, **server}))


async def test_idle_and_half_sent_connections_are_closed_after_the_header_timeout():
    async with listening(SlowEngine(), limited(header_timeout_s=0.3)) as (url, listener):
        idle, slow = raw_socket(listener.port), raw_socket(listener.port)
        slow.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: a")  # slowloris
        started = time.monotonic()
        assert await asyncio.to_thread(closed_within, idle, 2) and await asyncio.to_thread(closed_within, slow, 2)
        assert 0.25 < time.monotonic() - started < 1.5
        idle.close(), slow.close()


async def test_a_keep_alive_connection_idle_past_the_idle_timeout_is_closed():
    async with listening(SlowEngine(), limited(idle_timeout_s=0.3)) as (url, listener):
        sock = raw_socket(listener.port)
        sock.sendall(f"GET /health HTTP/1.1\r\nHost: 127.0.0.1:{listener.port}\r\n\r\n".encode())
        assert (await asyncio.to_thread(sock.recv, 65536)).startswith(b"HTTP/1.1 200 OK")
        assert not await asyncio.to_thread(closed_within, sock, 0.1)  # kept alive at first
        assert await asyncio.to_thread(closed_within, sock, 1.0)
        sock.close()


async def test_an_idle_flood_cannot_lock_a_client_out():
    async with listening(SlowEngine(), limited(max_connections=8)) as (url, listener):
        flood = [raw_socket(listener.port) for _ in range(20)]
        await asyncio.sleep(0.1)
        assert len(listener.connections.open) == 8
        started = time.monotonic()
        async with aiohttp.ClientSession() as http, http.get(url + "/health") as resp:
            assert resp.status == 200
        assert time.monotonic() - started < 0.5
        assert listener.connections.closed_idle >= 13 and listener.connections.refused == 0
        for sock in flood:
            sock.close()


async def test_when_every_connection_is_busy_a_new_one_gets_a_clear_503():
    engine = SlowEngine(step_s=0.05)
    async with listening(engine, limited(max_connections=3)) as (url, listener):
        async with aiohttp.ClientSession() as http:
            body = {"prompt": "x", "max_tokens": 40}
            busy = [asyncio.ensure_future(http.post(url + "/v1/completions", json=body)) for _ in range(3)]
            await asyncio.sleep(0.3)
            refused = raw_socket(listener.port)
            answer = await asyncio.to_thread(refused.recv, 65536)  # answered before anything is sent
            refused.close()
            for task in busy:
                (await task).close()
    head, _, payload = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503 Service Unavailable") and b"Retry-After: 1" in head
    assert json.loads(payload)["error"]["code"] == "too_many_connections"
    assert listener.connections.refused == 1


def test_accept_errors_are_logged_once_per_interval(caplog):
    from memrad.server.connections import limit_accept_errors

    loop = asyncio.new_event_loop()
    try:
        limit_accept_errors(loop, every_s=60)
        with caplog.at_level("WARNING"):
            for _ in range(500):
                loop.call_exception_handler({"message": "socket.accept() out of system resource",
                                             "exception": OSError(24, "Too many open files")})
        assert len(caplog.records) == 1
        assert "the open-file limit (ulimit -n) is reached" in caplog.records[0].getMessage()
    finally:
        loop.close()
