"""The control socket: snapshot, many subscribers, a stalled one, bad requests, who may
connect, and what a killed daemon left at its path."""

import asyncio
import errno
import json
import os
import socket
import stat
import time

import pytest

from memrad.protocol import Dropped, EvictEvent, ProtocolError, StateSnapshot, from_line
from memrad.server.control import ControlServer, ControlSocketError, EventBus, remove_stale_socket

SNAPSHOT = StateSnapshot("m", "cpu", 1.0, 0, None, (("reuse.mode", "exact"),), ())


async def start(tmp_path, queue_size=1024):
    bus = EventBus(asyncio.get_running_loop(), tmp_path / "events.jsonl", queue_size=queue_size)
    server = ControlServer(tmp_path / "memrad.sock", bus, lambda: SNAPSHOT)
    await server.start()
    return server, bus


async def until(predicate, tries=100):
    for _ in range(tries):
        if predicate():
            return True
        await asyncio.sleep(0.01)
    return predicate()


async def connect(server):
    return await asyncio.open_unix_connection(str(server.path))


async def ask(reader, writer, payload: bytes):
    writer.write(payload)
    await writer.drain()
    return from_line(await reader.readline())


async def test_the_socket_is_owner_only_and_answers_snapshots(tmp_path):
    server, _ = await start(tmp_path)
    try:
        assert stat.S_IMODE(os.stat(server.path).st_mode) == 0o600
        reader, writer = await connect(server)
        assert await ask(reader, writer, b'{"op": "snapshot"}\n') == SNAPSHOT
        writer.close()
    finally:
        await server.close()
    assert not server.path.exists()


async def test_bad_requests_get_an_error_line_and_the_connection_stays_usable(tmp_path):
    server, _ = await start(tmp_path)
    try:
        reader, writer = await connect(server)
        bad = await ask(reader, writer, b"{nope\n")
        assert isinstance(bad, ProtocolError) and bad.message.startswith("malformed request (not JSON)")
        unknown = await ask(reader, writer, b'{"op": "reset"}\n')
        assert unknown.message.startswith("unknown op 'reset'; send {\"op\": \"snapshot\"}")
        deep = await ask(reader, writer, b"[" * 15_000 + b"]" * 15_000 + b"\n")  # was a dropped connection
        assert deep.message.startswith("the request nests too deeply")
        huge_op = await ask(reader, writer, b'{"op": "' + b"x" * 60_000 + b'"}\n')
        assert isinstance(huge_op, ProtocolError) and len(huge_op.message) < 400  # the op is not echoed whole
        assert await ask(reader, writer, b'{"op": "snapshot"}\n') == SNAPSHOT
        writer.close()
    finally:
        await server.close()


async def test_an_oversize_line_gets_an_error_and_a_clean_close(tmp_path):
    server, _ = await start(tmp_path)
    try:
        reader, writer = await connect(server)
        writer.write(b'{"op": "snapshot", "pad": "' + b"x" * 100_000 + b'"}\n')
        await writer.drain()
        error = from_line(await reader.readline())
        assert isinstance(error, ProtocolError) and error.message.startswith("request line longer than 65536 bytes")
        assert await reader.read() == b""  # closed cleanly, nothing else said
        writer.close()
        reader, writer = await connect(server)  # the server itself is unaffected
        assert await ask(reader, writer, b'{"op": "snapshot"}\n') == SNAPSHOT
        writer.close()
    finally:
        await server.close()


async def test_many_subscribers_and_a_stalled_one_never_blocks_publishing(tmp_path):
    server, bus = await start(tmp_path, queue_size=8)
    try:
        live = [await connect(server) for _ in range(3)]
        stalled = await connect(server)
        for reader, writer in live + [stalled]:
            writer.write(b'{"op": "subscribe"}\n')
            await writer.drain()
        assert await until(lambda: bus.subscribers == 4)

        started = time.perf_counter()
        for i in range(5):
            bus.publish(EvictEvent(float(i), f"s{i}", i, i))
        for reader, _ in live:  # the live ones read everything so far
            got = [from_line(await reader.readline()) for _ in range(5)]
            assert [e.session_id for e in got] == ["s0", "s1", "s2", "s3", "s4"]
        # The stalled client never reads: its queue (8) and its socket buffer fill up, then
        # events are dropped for it alone, counted, while publishing stays instant.
        for i in range(5, 20000):
            bus.publish(EvictEvent(float(i), f"s{i}", i, i))
        assert time.perf_counter() - started < 10
        reader, _ = live[0]
        seen = [from_line(await asyncio.wait_for(reader.readline(), 5)) for _ in range(3)]
        assert all(isinstance(e, (EvictEvent, Dropped)) for e in seen)

        stalled_reader, _ = stalled
        lines = []
        while True:
            try:
                lines.append(from_line(await asyncio.wait_for(stalled_reader.readline(), 0.5)))
            except asyncio.TimeoutError:
                break
        drops = [e for e in lines if isinstance(e, Dropped)]
        assert drops and sum(d.count for d in drops) + sum(isinstance(e, EvictEvent) for e in lines) == 20000
        for _, writer in live + [stalled]:
            writer.close()
    finally:
        await server.close()
    recorded = (tmp_path / "events.jsonl").read_text().splitlines()
    assert len(recorded) == 20000 and json.loads(recorded[0])["type"] == "EvictEvent"


async def test_a_subscriber_that_disconnects_is_forgotten(tmp_path):
    server, bus = await start(tmp_path)
    try:
        reader, writer = await connect(server)
        writer.write(b'{"op": "subscribe"}\n')
        await writer.drain()
        assert await until(lambda: bus.subscribers == 1)
        writer.close()
        assert await until(lambda: bus.subscribers == 0)
        bus.publish(EvictEvent(0.0, "s0", 0, 0))  # nobody listening: fine
    finally:
        await server.close()


# --- owner-only, stale sockets -------------------------------------------------------------




def connect_as(uid: int, path) -> str:
    """Fork, become `uid`, try to connect: "connected", or the error's errno name."""
    pid = os.fork()
    if pid == 0:  # the child: no Python cleanup, just an exit code
        code = 0
        try:
            os.setgid(uid)
            os.setuid(uid)
            with socket.socket(socket.AF_UNIX) as s:
                s.connect(str(path))
        except OSError as exc:
            code = exc.errno or 1
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    return "connected" if code == 0 else errno.errorcode.get(code, str(code))


@pytest.mark.skipif(os.geteuid() != 0, reason="creating another user's process needs root")
async def test_another_users_connect_is_refused(tmp_path):
    private = tmp_path / "run"
    private.mkdir(mode=0o700)
    server, _ = await start(private)
    try:
        assert connect_as(65534, server.path) == "EACCES"   # nobody
        assert connect_as(0, server.path) == "connected"     # the owner
        private.chmod(0o755)  # even with the directory open, the socket itself is 0600
        assert connect_as(65534, server.path) == "EACCES"
    finally:
        await server.close()


async def test_a_stale_socket_from_a_killed_daemon_is_replaced(tmp_path):
    path = tmp_path / "memrad.sock"
    dead = socket.socket(socket.AF_UNIX)
    dead.bind(str(path))  # bound, never listening, then gone: what SIGKILL leaves
    dead.close()
    assert path.exists()
    server, _ = await start(tmp_path)
    try:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        reader, writer = await connect(server)
        assert await ask(reader, writer, b'{"op": "snapshot"}\n') == SNAPSHOT
        writer.close()
    finally:
        await server.close()


async def test_a_live_socket_a_file_or_an_open_directory_is_never_taken_over(tmp_path):
    server, _ = await start(tmp_path)
    try:
        with pytest.raises(ControlSocketError, match="another process is serving on"):
            await asyncio.to_thread(remove_stale_socket, server.path)
        assert server.path.exists()
    finally:
        await server.close()
    (tmp_path / "memrad.sock").write_text("my notes")
    with pytest.raises(ControlSocketError, match="is not a socket; memrad will not replace it"):
        await start(tmp_path)
    assert (tmp_path / "memrad.sock").read_text() == "my notes"
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o755)
    bus = EventBus(asyncio.get_running_loop())
    with pytest.raises(ControlSocketError, match="must be 700 and yours"):
        await ControlServer(shared / "memrad.sock", bus, lambda: SNAPSHOT).start()
