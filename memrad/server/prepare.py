"""Preparing a request off the event loop: body parsing, rendering and tokenizing.

A 15 MB body takes seconds to parse, render and tokenize; on the event loop that froze
/health and every running stream for as long (four at once stalled a stream for 11.9 s).
Here the work runs on worker threads, in two lanes so that an agent's ordinary request
never waits behind a huge one: bodies under LARGE_BYTES on one worker, larger ones on
another. Work is admitted before it starts: the body bytes in preparation (running or
waiting) are capped at `limits.max_preparing_bytes`, and a request past the cap is a 429
before any work is done.
The body itself must arrive within `server.body_timeout_s` (a slow upload is a 408).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from aiohttp import web

from memrad.server.errors import APIError
from memrad.server.limits import LIMITS, Limits, check_body, parse_body

T = TypeVar("T")


# A 20k-token agent prompt is ~100 KB; a body past this is prepared in the large lane.
LARGE_BYTES = 1024 * 1024


class Preparer:
    """Worker threads for request preparation (a small and a large lane), with byte-counted admission."""

    def __init__(self, max_pending_bytes: int, body_timeout_s: float) -> None:
        self.max_pending_bytes = max_pending_bytes
        self.body_timeout_s = body_timeout_s
        self.pending_bytes = 0
        self._small = ThreadPoolExecutor(max_workers=1, thread_name_prefix="memrad-prepare")
        self._large = ThreadPoolExecutor(max_workers=1, thread_name_prefix="memrad-prepare-large")

    def admit(self, num_bytes: int) -> None:
        """Count `num_bytes` in, or raise a 429 (one request alone is always admitted)."""
        if self.pending_bytes and self.pending_bytes + num_bytes > self.max_pending_bytes:
            raise APIError(429, f"the server is busy preparing {self.pending_bytes} bytes of other requests "
                           f"(limits.max_preparing_bytes = {self.max_pending_bytes}); retry in a few seconds",
                           type="rate_limit_error", code="preparing_full", headers={"Retry-After": "2"})
        self.pending_bytes += num_bytes

    async def run(self, num_bytes: int, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn(*args)` on the worker once `num_bytes` are admitted."""
        self.admit(num_bytes)
        try:
            lane = self._large if num_bytes >= LARGE_BYTES else self._small
            return await asyncio.get_running_loop().run_in_executor(lane, fn, *args)
        finally:
            self.pending_bytes -= num_bytes

    def close(self) -> None:
        for lane in (self._small, self._large):
            lane.shutdown(wait=False, cancel_futures=True)


PREPARER = web.AppKey("preparer", Preparer)
BODY_BYTES = web.RequestKey("memra_body_bytes", int) if hasattr(web, "RequestKey") else "memra_body_bytes"


def _parse(raw: bytes, limits: Limits) -> Any:
    body = parse_body(raw, limits)
    check_body(body, limits)
    return body


async def read_json(request: web.Request) -> Any:
    """The body as JSON, checked against the limits: read within the body timeout, parsed
    on the worker."""
    preparer = request.app[PREPARER]
    try:
        async with asyncio.timeout(preparer.body_timeout_s):
            raw = await request.read()
    except TimeoutError:
        raise APIError(408, f"the request body did not arrive within {preparer.body_timeout_s:g} s "
                       "(server.body_timeout_s, MEMRA_BODY_TIMEOUT_S)", param="body", code="body_timeout") from None
    request[BODY_BYTES] = len(raw)
    return await preparer.run(len(raw), _parse, raw, request.app[LIMITS])


async def prepared(request: web.Request, fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` (rendering, tokenizing) on the worker, admitted by the request's body size."""
    return await request.app[PREPARER].run(request.get(BODY_BYTES, 0), fn, *args)
