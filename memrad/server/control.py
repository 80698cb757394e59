"""The control socket: newline-delimited JSON over a Unix socket, for memra-tui.

    -> {"op": "snapshot"}    <- one StateSnapshot line
    -> {"op": "subscribe"}   <- DecisionEvent / TurnEvent / ParkEvent / EvictEvent lines, forever
    -> anything else         <- one ProtocolError line; the connection stays usable

Events are published from the engine thread; the bus hands them to the event loop, where
each subscriber has a bounded queue. A full queue drops the event for that subscriber only
(counted, and reported as a Dropped line before its next event): a slow or dead inspector
never blocks the engine.

The socket is owner-only: born 0600 (umask), in a directory only its owner can enter
(0700; a group- or world-accessible one is refused, so other local users cannot even reach
the socket's name). A leftover at the path is replaced only if it is a socket nobody
answers on (a killed daemon's); a live socket, a file or a directory there is refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import stat
from collections.abc import Callable
from pathlib import Path

from memrad.loglines import clean
from memrad.private import open_private
from memrad.protocol import Dropped, ProtocolError, StateSnapshot, to_line

log = logging.getLogger("memrad.control")

QUEUE_EVENTS = 1024


class _Subscriber:
    def __init__(self, size: int) -> None:
        self.queue: asyncio.Queue = asyncio.Queue(maxsize=size)
        self.dropped = 0


class EventBus:
    """Fan-out of protocol records to subscribers and, optionally, a JSONL recording."""

    def __init__(self, loop: asyncio.AbstractEventLoop, record_path: Path | None = None,
                 queue_size: int = QUEUE_EVENTS) -> None:
        self._loop = loop
        self._queue_size = queue_size
        self._subscribers: set[_Subscriber] = set()
        # A recording holds prompt text: 0600, in a folder created 0700 (memrad.private).
        self._record = open_private(record_path, "ab") if record_path is not None else None
        self.published = 0

    def publish_threadsafe(self, event: object) -> None:
        """Callable from any thread (the engine's); never blocks."""
        self._loop.call_soon_threadsafe(self.publish, event)

    def publish(self, event: object) -> None:
        """On the loop: offer `event` to every subscriber; drop (and count) where full."""
        self.published += 1
        line = to_line(event)
        if self._record is not None:
            self._record.write(line)
            self._record.flush()
        for sub in self._subscribers:
            try:
                sub.queue.put_nowait(line)
            except asyncio.QueueFull:
                sub.dropped += 1

    def subscribe(self) -> _Subscriber:
        sub = _Subscriber(self._queue_size)
        self._subscribers.add(sub)
        return sub

    def unsubscribe(self, sub: _Subscriber) -> None:
        self._subscribers.discard(sub)

    @property
    def subscribers(self) -> int:
        return len(self._subscribers)

    def close(self) -> None:
        if self._record is not None:
            self._record.close()
            self._record = None


class ControlServer:
    def __init__(self, path: Path, bus: EventBus, snapshot: Callable[[], StateSnapshot]) -> None:
        self.path = path
        self.bus = bus
        self._snapshot = snapshot
        self._server: asyncio.base_events.Server | None = None
        self._clients: set[asyncio.StreamWriter] = set()

    async def start(self) -> None:
        """Raises ControlSocketError (unsafe directory, live or foreign leftover) or OSError."""
        check_private_dir(self.path.parent)
        remove_stale_socket(self.path)
        old_umask = os.umask(0o177)  # the socket is born 0600: no window where others can connect
        try:
            self._server = await asyncio.start_unix_server(self._handle, path=str(self.path), limit=LINE_LIMIT)
        finally:
            os.umask(old_umask)
        os.chmod(self.path, 0o600)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            for writer in list(self._clients):  # subscribers see EOF and can reattach later
                writer.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2.0)
        self.path.unlink(missing_ok=True)
        self.bus.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._clients.add(writer)
        try:
            while True:
                try:
                    line = await reader.readline()
                except ValueError:  # over the reader's limit: the rest of the line cannot be told apart
                    writer.write(to_line(ProtocolError(f"request line longer than {LINE_LIMIT} bytes; the "
                                                       f"connection is closed. {USAGE}")))
                    await writer.drain()
                    return
                if not line:
                    return
                op, error = parse_op(line)
                if op == "snapshot":
                    writer.write(to_line(self._snapshot()))
                elif op == "subscribe":
                    await self._stream(reader, writer)
                    return
                else:
                    writer.write(to_line(ProtocolError(error)))
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self._clients.discard(writer)
            writer.close()

    async def _stream(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sub = self.bus.subscribe()
        closed = asyncio.ensure_future(reader.read())  # EOF (b"") when the client goes away
        try:
            while True:
                getter = asyncio.ensure_future(sub.queue.get())
                done, _ = await asyncio.wait({getter, closed}, return_when=asyncio.FIRST_COMPLETED)
                if closed in done:
                    getter.cancel()
                    return
                if sub.dropped:
                    writer.write(to_line(Dropped(sub.dropped)))
                    sub.dropped = 0
                writer.write(getter.result())
                await writer.drain()
        finally:
            closed.cancel()
            self.bus.unsubscribe(sub)


class ControlSocketError(RuntimeError):
    """The socket path is not safe to use; the message says what to change."""


def check_private_dir(directory: Path) -> None:
    """The socket's directory must be ours and closed to group and others (0700)."""
    st = os.stat(directory)
    if st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) & 0o077:
        raise ControlSocketError(
            f"the control socket's directory {directory} is mode {stat.S_IMODE(st.st_mode):o} owned by uid "
            f"{st.st_uid}: it must be 700 and yours, or other users could reach the socket. Point MEMRA_SOCKET "
            "into an owner-only directory")


def remove_stale_socket(path: Path) -> bool:
    """Unlink a dead socket at `path` (True if one was removed); refuse anything else there."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    if not stat.S_ISSOCK(st.st_mode):
        raise ControlSocketError(f"{path} exists and is not a socket; memrad will not replace it. Remove it "
                                 "or set another path with MEMRA_SOCKET")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(str(path))
    except OSError:  # ECONNREFUSED: nobody listens, a killed daemon's leftover
        path.unlink()
        return True
    finally:
        probe.close()
    raise ControlSocketError(f"another process is serving on {path}; stop it first (`memrad stop`) or set "
                             "another path with MEMRA_SOCKET")


OPS = ("snapshot", "subscribe")
LINE_LIMIT = 64 * 1024  # a request line is a few bytes; anything past this is refused
USAGE = 'send {"op": "snapshot"} or {"op": "subscribe"}, one JSON object per line'


def parse_op(line: bytes) -> tuple[str | None, str]:
    """(op, "") for a valid request line, else (None, what is wrong and what to send)."""
    try:
        request = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None, f"malformed request (not JSON); {USAGE}"
    except RecursionError:
        return None, f"the request nests too deeply to parse; {USAGE}"
    op = request.get("op") if isinstance(request, dict) else None
    if op in OPS:
        return op, ""
    return None, f"unknown op {clean(repr(op), 80)}; {USAGE}"
