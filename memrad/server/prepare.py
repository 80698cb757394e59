"""Preparing a request off the event loop: body parsing, rendering, tokenizing, grammars.

A 15 MB body takes seconds to parse, render and tokenize; on the event loop that froze
/health and every running stream for as long (four at once stalled a stream for 11.9 s).
Here the work runs on worker threads, in lanes by body size, each taking the smallest body
waiting first, so an agent's ordinary request never waits behind a big one:

    lane     bodies          worker
    small    < 64 KiB        memrad-prepare-small   (a side query, a title, a short turn)
    medium   < 1 MiB         memrad-prepare         (an agent's turn: 20k tokens is ~100 KB)
    large    the rest        memrad-prepare-large
    grammar  (any)           memrad-grammar         (a schema's grammar, compiled: memrad.chat.grammar)

Work is admitted before it starts: the body bytes in preparation (running or waiting) are
capped at `limits.max_preparing_bytes`, and a request past the cap is a 429 before any work
is done. Work whose client hung up before its turn is skipped. A grammar's compile has
`limits.grammar_compile_s` from when it starts (a 400 naming the schema's field past it);
at most GRAMMARS_WAITING compiles wait for the one worker (then a 429).
The body itself must arrive within `server.body_timeout_s` (a slow upload is a 408).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

from aiohttp import web

from memrad.server.connections import connection_of
from memrad.server.errors import APIError, invalid
from memrad.server.limits import LIMITS, Limits, check_body, parse_body

T = TypeVar("T")

KIB = 1024
LARGE_BYTES = 1024 * KIB  # a body past this is prepared in the large lane
LANES = (("small", 64 * KIB), ("medium", LARGE_BYTES), ("large", None))  # (name, bodies under this many bytes)
GRAMMARS_WAITING = 8


class Gone(APIError):
    """The client hung up before its work's turn: the work was skipped (a 499 nobody reads)."""

    def __init__(self) -> None:
        super().__init__(499, "the client hung up before its request was prepared; its work was skipped",
                         code="client_gone")


@dataclass(order=True)
class _Work:
    num_bytes: int
    seq: int
    fn: Callable[..., Any] = field(compare=False)
    args: tuple = field(compare=False)
    gone: Callable[[], bool] = field(compare=False)
    on_start: Callable[[], None] | None = field(compare=False)
    future: Future = field(compare=False, default_factory=Future)


class Lane:
    """One worker thread taking the smallest body waiting first (ties: arrival order); the
    work of a client that hung up is skipped when its turn comes."""

    def __init__(self, name: str) -> None:
        self._heap: list[_Work] = []
        self._wake = threading.Condition()
        self._seq = itertools.count()
        self._closed = False
        self.running: _Work | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def waiting(self) -> int:
        with self._wake:
            return len(self._heap)

    def submit(self, num_bytes: int, fn: Callable[..., Any], args: tuple, gone: Callable[[], bool],
               on_start: Callable[[], None] | None = None) -> Future:
        work = _Work(num_bytes, next(self._seq), fn, args, gone, on_start)
        with self._wake:
            if self._closed:
                raise RuntimeError("the preparation workers are closed")
            heapq.heappush(self._heap, work)
            self._wake.notify()
        return work.future

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._heap and not self._closed:
                    self._wake.wait()
                if self._closed:
                    return
                work = heapq.heappop(self._heap)
            if not work.future.set_running_or_notify_cancel():
                continue
            if work.gone():
                work.future.set_exception(Gone())
                continue
            if work.on_start is not None:
                work.on_start()
            try:
                work.future.set_result(work.fn(*work.args))
            except BaseException as exc:  # the caller re-raises it on the loop
                work.future.set_exception(exc)

    def close(self) -> None:
        with self._wake:
            self._closed = True
            for work in self._heap:
                work.future.cancel()
            self._heap.clear()
            self._wake.notify()


class Preparer:
    """The preparation lanes and the grammar worker, with byte-counted admission."""

    def __init__(self, max_pending_bytes: int, body_timeout_s: float, grammar_compile_s: float) -> None:
        self.max_pending_bytes = max_pending_bytes
        self.body_timeout_s = body_timeout_s
        self.grammar_compile_s = grammar_compile_s
        self.pending_bytes = 0
        self.skipped_gone = 0  # works skipped because the client had hung up
        self.lanes = [(limit, Lane(f"memrad-prepare-{name}")) for name, limit in LANES]
        self.grammar = Lane("memrad-grammar")

    def admit(self, num_bytes: int) -> None:
        """Count `num_bytes` in, or raise a 429 (one request alone is always admitted)."""
        if self.pending_bytes and self.pending_bytes + num_bytes > self.max_pending_bytes:
            raise APIError(429, f"the server is busy preparing {self.pending_bytes} bytes of other requests "
                           f"(limits.max_preparing_bytes = {self.max_pending_bytes}); retry in a few seconds",
                           type="rate_limit_error", code="preparing_full", headers={"Retry-After": "2"})
        self.pending_bytes += num_bytes

    def lane(self, num_bytes: int) -> Lane:
        return next(lane for limit, lane in self.lanes if limit is None or num_bytes < limit)

    async def run(self, num_bytes: int, fn: Callable[..., T], *args: Any,
                  gone: Callable[[], bool] = lambda: False) -> T:
        """Run `fn(*args)` in its lane once `num_bytes` are admitted (raises Gone if the
        client hung up before its turn)."""
        self.admit(num_bytes)
        try:
            return await self._await(self.lane(num_bytes).submit(num_bytes, fn, args, gone))
        finally:
            self.pending_bytes -= num_bytes

    async def _await(self, future: Future) -> Any:
        try:
            return await asyncio.wrap_future(future)
        except Gone:
            self.skipped_gone += 1
            raise

    async def compile(self, fn: Callable[..., T], *args: Any, gone: Callable[[], bool] = lambda: False,
                      compiling: Callable[[], str | None] = lambda: None) -> T:
        """`fn(*args)` (a grammar's check) on the grammar worker, within `grammar_compile_s`
        of its start; past it a 400 naming what `compiling()` says was being compiled."""
        if self.grammar.waiting >= GRAMMARS_WAITING:
            raise APIError(429, f"the server is compiling the grammars of {GRAMMARS_WAITING} other requests' "
                           "schemas; retry in a few seconds", type="rate_limit_error", code="grammars_busy",
                           headers={"Retry-After": "2"})
        loop = asyncio.get_running_loop()
        started = asyncio.Event()
        future = asyncio.wrap_future(self.grammar.submit(0, fn, args, gone,
                                                         lambda: loop.call_soon_threadsafe(started.set)))
        starting = asyncio.ensure_future(started.wait())
        try:
            await asyncio.wait({future, starting}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            starting.cancel()
        try:
            return await asyncio.wait_for(asyncio.shield(future), self.grammar_compile_s)
        except Gone:
            self.skipped_gone += 1
            raise
        except TimeoutError:
            future.add_done_callback(lambda f: f.cancelled() or f.exception())  # its verdict is cached; nobody awaits it
            param = compiling() or "the schema"
            raise invalid(f"{param} cannot be used to constrain the reply: compiling its grammar took more than "
                          f"limits.grammar_compile_s ({self.grammar_compile_s:g} s); simplify the schema",
                          param.split(" ")[0], code="grammar_too_slow") from None

    def close(self) -> None:
        for _, lane in self.lanes:
            lane.close()
        self.grammar.close()


PREPARER = web.AppKey("preparer", Preparer)
BODY_BYTES = web.RequestKey("memra_body_bytes", int) if hasattr(web, "RequestKey") else "memra_body_bytes"


def client_gone(request: web.Request) -> Callable[[], bool]:
    """Whether the request's client has hung up (thread-safe: reads a flag or the transport)."""
    conn = connection_of(request)
    if conn is not None:
        return lambda: conn.gone
    transport = request.transport
    return lambda: transport is None or transport.is_closing()


def _parse(raw: bytes, limits: Limits) -> Any:
    body = parse_body(raw, limits)
    check_body(body, limits)
    return body


async def read_json(request: web.Request) -> Any:
    """The body as JSON, checked against the limits: read within the body timeout, parsed
    on a worker."""
    preparer = request.app[PREPARER]
    try:
        async with asyncio.timeout(preparer.body_timeout_s):
            raw = await request.read()
    except TimeoutError:
        raise APIError(408, f"the request body did not arrive within {preparer.body_timeout_s:g} s "
                       "(server.body_timeout_s, MEMRA_BODY_TIMEOUT_S)", param="body", code="body_timeout") from None
    request[BODY_BYTES] = len(raw)
    return await preparer.run(len(raw), _parse, raw, request.app[LIMITS], gone=client_gone(request))


async def compiled(request: web.Request, compiling: Callable[[], str | None], fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` (a reply's grammar, checked) on the grammar worker, within
    `limits.grammar_compile_s`; `compiling()` names the field being compiled, for the 400."""
    return await request.app[PREPARER].compile(fn, *args, gone=client_gone(request), compiling=compiling)


async def prepared(request: web.Request, fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` (rendering, tokenizing) on a worker, admitted by the request's body size."""
    return await request.app[PREPARER].run(request.get(BODY_BYTES, 0), fn, *args, gone=client_gone(request))
