"""Large requests are prepared off the event loop (memrad.server.prepare): /health and running
streams stay responsive while big bodies parse, render and tokenize; preparation is admitted
by bytes before any work (429 past the cap); a body that does not arrive in time is a 408."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import aiohttp

from memrad.config import LimitSettings, ServerSettings, Settings
from tests.unit.fake_engine import FakeEngine
from tests.unit.listening import listening


class HeavyChat:
    """FakeChat's rendering, made CPU-heavy the way a real template and tokenizer are."""

    def __init__(self, chat, gate: threading.Event | None = None, gated_from: int = 0):
        self.chat, self.gate, self.gated_from = chat, gate, gated_from

    def __getattr__(self, name):
        return getattr(self.chat, name)

    def render(self, messages, tools, require_call=False, call_name=None):
        if self.gate is not None and len(messages[0]["content"]) >= self.gated_from:
            self.gate.wait(10)
        text, ids = self.chat.render(messages, tools)
        for _ in range(8):  # ~a real tokenizer's cost per character: ~1 s a request here
            ids = [i ^ 0 for i in ids]
        return text, ids


def health_latencies(url: str, stop: threading.Event) -> list[float]:
    """/health from another thread, as a monitoring client sees it (its clock runs while the
    server's loop is blocked)."""
    import urllib.request

    latencies = []
    while not stop.is_set():
        started = time.perf_counter()
        with urllib.request.urlopen(url + "/health", timeout=30) as resp:
            assert resp.status == 200
        latencies.append(time.perf_counter() - started)
        time.sleep(0.01)
    return latencies


async def test_health_stays_responsive_while_four_big_requests_are_prepared():
    engine = FakeEngine()
    engine.chat = HeavyChat(engine.chat)
    body = json.dumps({"model": "default", "max_tokens": 1,
                       "messages": [{"role": "user", "content": "w " * 1_500_000}]})  # 3 MB each
    async with listening(engine) as (url, _):
        stop = threading.Event()
        prober = asyncio.ensure_future(asyncio.to_thread(health_latencies, url, stop))
        await asyncio.sleep(0.1)
        started = time.perf_counter()
        async with aiohttp.ClientSession() as http:
            async def count() -> int:
                async with http.post(url + "/v1/messages/count_tokens", data=body,
                                     headers={"Content-Type": "application/json"}) as resp:
                    return (await resp.json())["input_tokens"]
            counts = await asyncio.gather(*(count() for _ in range(4)))
        busy_s = time.perf_counter() - started
        stop.set()
        latencies = await prober
    assert counts == [3_000_000 + len("<user>\n<assistant>")] * 4
    # On the loop, each render held it for its whole length: /health waited ~busy_s.
    assert busy_s > 1.0 and max(latencies) < min(0.5, busy_s / 2), (busy_s, sorted(latencies)[-5:])


async def test_preparation_is_admitted_by_bytes_before_any_work():
    gate = threading.Event()
    engine = FakeEngine()
    engine.chat = HeavyChat(engine.chat, gate)
    settings = Settings(limits=LimitSettings(max_preparing_bytes=150_000))
    body = {"model": "default", "max_tokens": 1, "messages": [{"role": "user", "content": "w" * 100_000}]}
    async with listening(engine, settings) as (url, _), aiohttp.ClientSession() as http:
        first = asyncio.ensure_future(http.post(url + "/v1/messages/count_tokens", json=body))
        await asyncio.sleep(0.3)  # the first is on the worker, held by the gate
        async with http.post(url + "/v1/messages/count_tokens", json=body) as resp:
            refused = await resp.json()
            assert resp.status == 429 and resp.headers["Retry-After"] == "2"
        gate.set()
        async with await first as resp:
            assert resp.status == 200
        async with http.post(url + "/v1/messages/count_tokens", json=body) as resp:
            assert resp.status == 200  # released once done
    assert refused["error"]["type"] == "rate_limit_error"
    assert "limits.max_preparing_bytes = 150000" in refused["error"]["message"]


async def test_an_ordinary_request_is_not_queued_behind_a_huge_one():
    from memrad.server.prepare import LARGE_BYTES

    gate = threading.Event()
    engine = FakeEngine()
    engine.chat = HeavyChat(engine.chat, gate, gated_from=LARGE_BYTES)
    huge = {"model": "default", "max_tokens": 1, "messages": [{"role": "user", "content": "w" * LARGE_BYTES}]}
    small = {"model": "default", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    async with listening(engine) as (url, _), aiohttp.ClientSession() as http:
        held = asyncio.ensure_future(http.post(url + "/v1/messages/count_tokens", json=huge))
        await asyncio.sleep(0.3)  # the huge one is on the large lane, held by the gate
        started = time.monotonic()
        async with http.post(url + "/v1/messages", json=small) as resp:
            assert resp.status == 200
        assert time.monotonic() - started < 1.0 and not held.done()
        gate.set()
        async with await held as resp:
            assert resp.status == 200


def slow_upload(port: int) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
                     "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"messages\"".encode())
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.endswith(b"}}"):  # the error body ends it
            answer += sock.recv(65536)
    return answer


async def test_a_body_that_does_not_arrive_in_time_is_a_408():
    settings = Settings(server=ServerSettings(body_timeout_s=0.3))
    async with listening(FakeEngine(), settings) as (url, listener):
        started = time.monotonic()
        answer = await asyncio.to_thread(slow_upload, listener.port)
    assert answer.startswith(b"HTTP/1.1 408 "), answer[:100]
    assert b"server.body_timeout_s" in answer and time.monotonic() - started < 2
