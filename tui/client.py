"""Where records come from: the daemon's control socket (live) or a recorded JSONL file."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from memrad.protocol import from_line

RETRY_S = 1.0


@dataclass(frozen=True, slots=True)
class Status:
    """The connection as the user should read it."""

    connected: bool
    text: str


async def socket_records(path: str) -> AsyncIterator[object]:
    """Snapshot, then every event; reconnects forever (daemon restarts, late starts)."""
    announced_down = False
    while True:
        try:
            events_reader, events_writer = await asyncio.open_unix_connection(path)
            events_writer.write(b'{"op": "subscribe"}\n')
            await events_writer.drain()
            snap_reader, snap_writer = await asyncio.open_unix_connection(path)
            snap_writer.write(b'{"op": "snapshot"}\n')
            await snap_writer.drain()
            snapshot = from_line(await snap_reader.readline())
            snap_writer.close()
        except (OSError, ValueError):
            if not announced_down:
                yield Status(False, f"no daemon at {path}: start one with `memrad start` (waiting for it)")
                announced_down = True
            await asyncio.sleep(RETRY_S)
            continue
        announced_down = False
        yield Status(True, f"connected to {path}")
        yield snapshot
        while line := await events_reader.readline():
            try:
                yield from_line(line)
            except ValueError:
                continue
        events_writer.close()
        yield Status(False, f"the daemon at {path} went away: reconnecting")
        announced_down = True


async def replay_records(path: Path) -> AsyncIterator[object]:
    """Every record of a file written by `memrad start --record FILE`."""
    count = 0
    with open(path, "rb") as handle:
        for line in handle:
            if line.strip():
                try:
                    record = from_line(line)
                except ValueError:
                    continue
                count += 1
                yield record
    yield Status(False, f"replay of {path}: {count} events")


def read_records(path: Path) -> list[object]:
    """A recorded file as a list (for tests and for sizing a replay)."""
    return [from_line(line) for line in path.read_bytes().splitlines() if line.strip()
            and json.loads(line).get("type")]
