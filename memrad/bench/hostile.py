"""Round three's hostile cases for `memrad bench faults grammar|slow-body|abandoned-queue`
(loopback only, bounded), each measured the way `big` is: /health p99 and a live stream's
longest gap between events, while the case runs (memrad.bench.floods).

  grammar          4 schemas past the cost bound (500 patternProperties, `(a{1000}){1000}`) on
                   Chat and through a Messages tool, and 2 under it that compile slowly
  slow-body        `--heads` connections that send a request head and never their bodies
  abandoned-queue  16 requests whose clients hang up while queued, then one live request
"""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp

from memrad.bench.floods import CHAT, _health_p99, _loopback, _p99, _stream_gaps

PATTERN_FLOOD = {"type": "object", "patternProperties": {f"^p{i}_[a-z]+$": {"type": "string"} for i in range(500)}}
NESTED_REPEATS = {"type": "object", "properties": {"a": {"type": "string", "pattern": "^(a{1000}){1000}$"}}}


def _slow_schema(seed: int) -> dict:
    """Under the cost bound (64 patternProperties in each of 20 objects), yet slow to compile."""
    return {"type": "object", "properties": {f"o{j}": {"type": "object", "patternProperties": {
        f"^p{i}_{seed}_{j}[a-z]+$": {"type": "string"} for i in range(64)}} for j in range(20)}}


def _chat_format(schema: dict) -> dict:
    return {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}


async def _grammar(session: aiohttp.ClientSession, url: str, port: int) -> list[int]:
    bodies = [("/v1/chat/completions", _chat_format(PATTERN_FLOOD)), ("/v1/chat/completions", _chat_format(NESTED_REPEATS)),
              ("/v1/messages", {"model": "default", "max_tokens": 8, "messages": CHAT["messages"],
                                "tools": [{"name": "t", "input_schema": PATTERN_FLOOD}]}),
              ("/v1/responses", {"input": "hi", "max_output_tokens": 8, "text": {"format": {
                  "type": "json_schema", "name": "x", "schema": NESTED_REPEATS}}}),
              ("/v1/chat/completions", _chat_format(_slow_schema(1))), ("/v1/chat/completions", _chat_format(_slow_schema(2)))]

    async def one(path: str, body: dict) -> int:
        async with session.post(url + path, json=body) as resp:
            await resp.read()
            return resp.status

    return list(await asyncio.gather(*(one(p, b) for p, b in bodies)))


async def _slow_body(session: aiohttp.ClientSession, url: str, port: int, heads: int = 256,
                     hold_s: float = 5.0) -> list[int]:
    writers = []
    for _ in range(heads):
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            break
        writer.write(f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
                     "Content-Length: 100000\r\n\r\n{".encode())
        writers.append(writer)
    await asyncio.sleep(hold_s / 2)
    async with session.post(url + "/v1/chat/completions", json=CHAT) as resp:  # a normal client meanwhile
        await resp.read()
        status = resp.status
    await asyncio.sleep(hold_s / 2)
    for writer in writers:
        writer.close()
    return [status, len(writers)]


async def _abandoned_queue(session: aiohttp.ClientSession, url: str, port: int) -> list[int]:
    body = json.dumps({**CHAT, "max_tokens": 64}).encode()
    socks = []
    for _ in range(16):
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        socks.append(writer)
    await asyncio.sleep(1.0)
    for writer in socks:  # every one of them hangs up while queued
        writer.close()
    await asyncio.sleep(0.5)
    async with session.post(url + "/v1/chat/completions", json=CHAT) as resp:
        await resp.read()
        return [resp.status]


CASES = {"grammar": _grammar, "slow-body": _slow_body, "abandoned-queue": _abandoned_queue}


async def run(url: str, name: str, max_tokens: int = 120) -> bool:
    """One case while a stream decodes: prints /health p99, the stream's longest gap, statuses."""
    _, port = _loopback(url)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        stop, live = asyncio.Event(), asyncio.Event()
        prober = asyncio.ensure_future(_health_p99(url, stop))
        stream = asyncio.ensure_future(_stream_gaps(session, url, max_tokens, live))
        await live.wait()
        started = time.perf_counter()
        statuses = await CASES[name](session, url, port)
        took_s = time.perf_counter() - started
        gaps = await stream
        stop.set()
        latencies = await prober
    p99, gap = _p99(latencies), max(gaps, default=0.0)
    print(f"{name}: /health p99 {p99 * 1000:.0f} ms (worst {max(latencies) * 1000:.0f} ms, {len(latencies)} probes), "
          f"longest stream gap {gap * 1000:.0f} ms; answered {statuses} in {took_s:.1f} s")
    if name == "grammar":
        ok = statuses[:4] == [400] * 4 and all(s in (200, 400) for s in statuses[4:])
    else:
        ok = statuses[0] == 200
    return ok and p99 < 1.0 and gap < 2.0
