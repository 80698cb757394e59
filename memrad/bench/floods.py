"""Hostile-client harnesses for `memrad bench faults floods|big` (loopback only, bounded).

  floods  an idle flood (`--idle` sockets that send nothing) and a slowloris flood
          (`--slow` sockets that send one header byte a second) held for `--hold-s`,
          while a normal client asks /health and a short chat: both must be served within
          their usual time, and the daemon's log must not grow by more than 1 MB.
  big     four `--mb` MB count_tokens requests arrive while a stream decodes: /health p99
          and the stream's longest gap between events, without and with them.

Everything here opens connections to 127.0.0.1 only, a bounded number for a bounded time.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from urllib.parse import urlsplit

import aiohttp

from memrad.server.security import is_loopback

CHAT = {"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 8, "temperature": 0}


def _loopback(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    if not is_loopback(parts.hostname or ""):
        raise SystemExit(f"these floods run against a loopback daemon only, not {parts.hostname}")
    return parts.hostname, parts.port


async def _normal(session: aiohttp.ClientSession, url: str) -> tuple[float, float]:
    """(/health seconds, short chat seconds) as a normal client sees them."""
    t0 = time.perf_counter()
    async with session.get(url + "/health") as resp:
        assert resp.status == 200, resp.status
    t1 = time.perf_counter()
    async with session.post(url + "/v1/chat/completions", json=CHAT) as resp:
        assert resp.status == 200, await resp.text()
        await resp.read()
    return t1 - t0, time.perf_counter() - t1


async def _open(host: str, port: int, count: int) -> list[asyncio.StreamWriter]:
    writers = []
    for _ in range(count):
        try:
            _, writer = await asyncio.open_connection(host, port)
        except OSError:
            break  # this machine's own limits: stop flooding, measure what was opened
        writers.append(writer)
    return writers


async def _drip(writers: list[asyncio.StreamWriter], hold_s: float) -> None:
    """Slowloris: a request line, then one header byte a second, never the blank line."""
    for w in writers:
        w.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-A: ")
    deadline = time.monotonic() + hold_s
    while time.monotonic() < deadline:
        await asyncio.sleep(1.0)
        for w in writers:
            if not w.is_closing():
                w.write(b"a")


async def floods(url: str, log_size, idle: int = 1100, slow: int = 200, hold_s: float = 30.0) -> bool:
    host, port = _loopback(url)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        await _normal(session, url)  # warm
        before = [await _normal(session, url) for _ in range(3)]
        log_before = log_size()
        idle_w = await _open(host, port, idle)
        slow_w = await _open(host, port, slow)
        drip = asyncio.ensure_future(_drip(slow_w, hold_s))
        during = []
        started = time.monotonic()
        while time.monotonic() - started < hold_s:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as fresh:  # a new connection
                during.append(await _normal(fresh, url))
            await asyncio.sleep(1.0)
        await drip
        for w in idle_w + slow_w:
            w.close()
        log_growth = log_size() - log_before
    worst_before = max(h + c for h, c in before)
    worst_during = max(h + c for h, c in during)
    print(f"flood: {len(idle_w)} idle + {len(slow_w)} slowloris connections opened and held {hold_s:.0f} s")
    print(f"normal client, /health + short chat: worst {worst_before:.2f} s before, {worst_during:.2f} s during "
          f"({len(during)} tries on fresh connections, all served)")
    print(f"log growth during the flood: {log_growth} bytes")
    return worst_during <= 2 * worst_before + 1.0 and log_growth < 2**20


async def _health_p99(url: str, stop: asyncio.Event) -> list[float]:
    latencies = []
    async with aiohttp.ClientSession() as session:
        while not stop.is_set():
            t0 = time.perf_counter()
            async with session.get(url + "/health") as resp:
                await resp.read()
            latencies.append(time.perf_counter() - t0)
            await asyncio.sleep(0.02)
    return latencies


async def _stream_gaps(session: aiohttp.ClientSession, url: str, max_tokens: int,
                       started: asyncio.Event) -> list[float]:
    """Gaps between a stream's events; `started` is set at its first event (it is live)."""
    # A raw completion of a counting prompt: the small model keeps counting (a chat reply ends early).
    body = {"prompt": "Numbers: 1, 2, 3, 4, 5, 6, 7, 8,", "max_tokens": max_tokens, "temperature": 0, "stream": True}
    gaps, last = [], None
    async with session.post(url + "/v1/completions", json=body) as resp:
        async for line in resp.content:
            if line.startswith(b"data: "):
                now = time.perf_counter()
                if last is not None:
                    gaps.append(now - last)
                last = now
                started.set()
    return gaps


def _p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[98] if len(values) >= 2 else max(values, default=0.0)


async def big(url: str, mb: int = 15, max_tokens: int = 120) -> bool:
    _loopback(url)
    words = " ".join(f"w{i % 5000}" for i in range(mb * 2**20 // 6))[: mb * 2**20]
    payload = json.dumps({"model": "default", "max_tokens": 1, "messages": [{"role": "user", "content": words}]})
    results = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as session:
        for phase in ("before", "during"):
            stop = asyncio.Event()
            prober = asyncio.ensure_future(_health_p99(url, stop))
            live = asyncio.Event()
            stream = asyncio.ensure_future(_stream_gaps(session, url, max_tokens, live))
            await live.wait()  # a live stream, then the big requests arrive
            bigs = []
            if phase == "during":
                bigs = [asyncio.ensure_future(session.post(url + "/v1/messages/count_tokens", data=payload,
                                                           headers={"Content-Type": "application/json"}))
                        for _ in range(4)]
            gaps = await stream
            statuses = []
            for task in bigs:
                async with await task as resp:
                    statuses.append(resp.status)
                    await resp.read()
            stop.set()
            latencies = await prober
            results[phase] = (_p99(latencies), max(latencies), max(gaps, default=0.0), statuses)
    for phase, (p99, worst, gap, statuses) in results.items():
        extra = f"; the four {mb} MB requests answered {statuses}" if statuses else ""
        print(f"{phase}: /health p99 {p99 * 1000:.0f} ms (worst {worst * 1000:.0f} ms), "
              f"longest stream gap {gap * 1000:.0f} ms{extra}")
    p99_during, _, gap_during, statuses = results["during"]
    return p99_during < 1.0 and gap_during < 2.0 and all(s in (200, 429) for s in statuses)
