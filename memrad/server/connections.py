"""Open connections: who is still there, how long one may idle, how many there may be.

Each accepted socket gets a `Connection`, a thin asyncio protocol in front of aiohttp's
own. It exists for four things aiohttp does not do:

  - **Half-close is not hang-up.** aiohttp closes a connection on the peer's EOF, so a
    client that sends its whole request and then `shutdown(SHUT_WR)` got nothing. Here an
    EOF that arrives after a complete request keeps the socket open for the answer; an EOF
    with no request, or in the middle of a body, closes it as before.
  - **A gone client is an event, not a guess.** `on_gone` callbacks run the moment the
    transport is lost, so serving cancels the job before the next prefill chunk or decode
    step. A peer that closed fully also sends EOF first; only a write tells the two apart
    (the peer's kernel answers it with a reset), so `on_eof` lets serving send a probe.
  - **Idle connections end.** A connection must present a complete request head within
    `header_timeout_s` of opening (slowloris, idle floods), and within `idle_timeout_s` of
    its last answer (keep-alive).
  - **At most `max_connections`.** At the cap the longest-idle connection (one with no
    request in flight) is closed to make room, so a flood of idle sockets cannot lock out a
    real client; then the one that has been sending its body longest. Only a connection
    whose request is whole (head and body) is busy: when every connection is busy the new
    one gets a 503 and is closed.
  - **At most `max_body_connections` bodies arriving at once.** A request head whose body
    has not arrived holds no serving slot: bodies have their own, smaller budget, and past
    it the connection that has been sending its body longest is closed (a flood of heads
    that never finish their bodies cannot take every slot for `body_timeout_s`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from aiohttp import web

from memrad.loglines import RateLimitedLog

log = logging.getLogger("memrad.server")


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    max_connections: int
    header_timeout_s: float  # from accept (or the last answer) to a complete request head
    idle_timeout_s: float  # keep-alive: from the last answer to the next request head
    body_timeout_s: float  # from the request head to the whole body (memrad.server.limits)
    max_body_connections: int = 32  # connections whose request body is still arriving


def _refusal(max_connections: int) -> bytes:
    body = json.dumps({"error": {
        "message": f"memrad already serves {max_connections} open connections, all busy "
                   "(server.max_connections, MEMRA_MAX_CONNECTIONS); retry shortly",
        "type": "server_error", "param": None, "code": "too_many_connections"}}).encode()
    head = ("HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\n"
            f"Retry-After: 1\r\nContent-Length: {len(body)}\r\n\r\n")
    return head.encode() + body


# After an EOF with no request in flight: how long a request parsed from the same read has
# to reach the middleware before the connection is closed.
EOF_GRACE_S = 0.5


class Connections:
    """Every open Connection of one listener, oldest activity first when choosing whom to close."""

    def __init__(self, limits: ConnectionLimits) -> None:
        self.limits = limits
        self.open: set[Connection] = set()
        self.refused = 0
        self.closed_idle = 0
        self.closed_reading = 0  # connections closed mid-body to make room
        self._log = RateLimitedLog(log, every_s=10.0)

    def admit(self, new: "Connection") -> bool:
        """Make room for `new` at the cap (closing the longest-idle connection, else the one
        sending its body longest) or refuse it: only whole requests hold their slots."""
        if len(self.open) >= self.limits.max_connections:
            live = [c for c in self.open if not c.closing]
            idle = [c for c in live if c.request is None]
            if idle:
                self.closed_idle += 1
                self._log.info("closed an idle connection to make room: %d open (server.max_connections)",
                               len(self.open))
                min(idle, key=lambda c: c.last_active).close()
            elif not self._close_oldest_reading(live, "server.max_connections"):
                self.refused += 1
                self._log.warning("refused a connection: %d open, all with a request in flight "
                                  "(server.max_connections)", len(self.open))
                return False
        self.open.add(new)
        return True

    def reading(self, new: "Connection") -> None:
        """`new` has a request head and its body is on the way: keep the bodies arriving at
        once within `max_body_connections` (closing the one arriving longest)."""
        live = [c for c in self.open if not c.closing and c.reading]
        if len(live) > self.limits.max_body_connections:
            self._close_oldest_reading([c for c in live if c is not new], "server.max_body_connections")

    def _close_oldest_reading(self, live: list["Connection"], setting: str) -> bool:
        reading = [c for c in live if c.reading]
        if not reading:
            return False
        self.closed_reading += 1
        self._log.info("closed a connection whose request body was still arriving after %.1f s, to make room "
                       "(%s)", time.monotonic() - min(c.last_active for c in reading), setting)
        min(reading, key=lambda c: c.last_active).close()
        return True


class Connection(asyncio.Protocol):
    """aiohttp's protocol for one socket, plus half-close, gone/EOF events, timeouts and the cap."""

    def __init__(self, inner: asyncio.Protocol, connections: Connections) -> None:
        self.inner = inner
        self.connections = connections
        self.transport: asyncio.Transport | None = None
        self.request: web.BaseRequest | None = None  # the request in flight
        self.peer_eof = False
        self.gone = False
        self.closing = False
        self.admitted = False
        self.last_active = time.monotonic()
        self._timer: asyncio.TimerHandle | None = None
        self._on_gone: list[Callable[[], None]] = []
        self._on_eof: list[Callable[[], None]] = []

    @property
    def busy(self) -> bool:
        """A whole request (head and body) is in flight: its slot is never taken away."""
        return self.request is not None and self.request.content.is_eof()

    @property
    def reading(self) -> bool:
        """A request head arrived and its body is still on the way."""
        return self.request is not None and not self.request.content.is_eof()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        if not self.connections.admit(self):
            self.closing = True
            transport.write(_refusal(self.connections.limits.max_connections))  # type: ignore[attr-defined]
            transport.close()
            return
        self.admitted = True
        self.inner.connection_made(transport)
        self._arm(self.connections.limits.header_timeout_s)

    def data_received(self, data: bytes) -> None:
        if self.admitted:
            self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        request = self.request
        if request is not None and not request.content.is_eof():
            return None  # a body cut short: nothing to answer, close as aiohttp would
        self.peer_eof = True
        if request is None:
            # A request that arrived with the EOF is still on its way to the middleware;
            # none arriving (a keep-alive client leaving) closes after the grace.
            self._arm(EOF_GRACE_S)
            return True
        for callback in list(self._on_eof):
            callback()
        return True  # keep the socket open for writing: the answer is still wanted

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self.gone = True
        self._disarm()
        self.connections.open.discard(self)
        callbacks, self._on_gone = self._on_gone, []
        for callback in callbacks:
            callback()
        if self.admitted:
            self.inner.connection_lost(exc)

    # -- what the request middleware and serving call --------------------------------------

    def begin(self, request: web.BaseRequest) -> None:
        self._disarm()
        self.request = request
        self.last_active = time.monotonic()
        if self.reading:
            self.connections.reading(self)

    def end(self) -> None:
        self.request = None
        self._on_gone.clear()
        self._on_eof.clear()
        self.last_active = time.monotonic()
        if not self.gone:
            self._arm(self.connections.limits.idle_timeout_s)

    def on_gone(self, callback: Callable[[], None]) -> None:
        """Run `callback` once when the client is gone (at once if it already is)."""
        if self.gone:
            callback()
        else:
            self._on_gone.append(callback)

    def on_eof(self, callback: Callable[[], None]) -> None:
        """Run `callback` when the peer stops sending after its request (at once if it has)."""
        if self.peer_eof:
            callback()
        else:
            self._on_eof.append(callback)

    def close(self) -> None:
        self.closing = True
        if self.transport is not None:
            self.transport.close()

    def _arm(self, seconds: float) -> None:
        self._disarm()
        self._timer = asyncio.get_running_loop().call_later(seconds, self._expire)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expire(self) -> None:
        self._timer = None
        if self.request is None and not self.gone:
            self.close()


def connection_of(request: web.BaseRequest) -> Connection | None:
    """The request's Connection, or None when it came through another listener (aiohttp's own)."""
    transport = request.transport
    protocol = transport.get_protocol() if transport is not None else None
    return protocol if isinstance(protocol, Connection) else None


@web.middleware
async def track(request: web.Request, handler) -> web.StreamResponse:
    """Outermost middleware: the connection knows a request is in flight (no idle timeout, not
    evictable). After a half-close, or an answer given before the body was read whole (a
    408), the connection ends once the answer is written."""
    conn = connection_of(request)
    if conn is None:
        return await handler(request)
    conn.begin(request)
    try:
        response = await handler(request)
        if conn.peer_eof or not request.content.is_eof():
            response.force_close()
        return response
    finally:
        conn.end()


class Listener:
    """A TCP listener whose connections are `Connection`s around aiohttp's protocol."""

    def __init__(self, runner: web.BaseRunner, limits: ConnectionLimits) -> None:
        self.runner = runner
        self.connections = Connections(limits)
        self.server: asyncio.Server | None = None

    async def start(self, host: str, port: int) -> None:
        server = self.runner.server
        assert server is not None, "runner.setup() first"
        loop = asyncio.get_running_loop()
        self.server = await loop.create_server(lambda: Connection(server(), self.connections), host, port,
                                               backlog=128)

    @property
    def port(self) -> int:
        assert self.server is not None
        return self.server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        """Stop accepting; the runner's cleanup then finishes the open connections."""
        if self.server is not None:
            self.server.close()


ACCEPT_ERROR = "socket.accept() out of system resource"


def limit_accept_errors(loop: asyncio.AbstractEventLoop, every_s: float = 10.0) -> None:
    """asyncio logs every failed accept (EMFILE) with a traceback, about once a second per
    listener and forever; keep one line per `every_s` (with the count) and drop the rest."""
    limited = RateLimitedLog(logging.getLogger("memrad.server"), every_s)
    previous = loop.get_exception_handler()

    def handler(loop: asyncio.AbstractEventLoop, context: dict) -> None:
        if str(context.get("message", "")).startswith(ACCEPT_ERROR):
            limited.warning("cannot accept connections: %s (%s); the open-file limit (ulimit -n) is "
                            "reached", context.get("exception"), ACCEPT_ERROR)
            return
        if previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handler)
