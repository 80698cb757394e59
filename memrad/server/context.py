"""What every handler needs, stored once on the app under a typed key."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from aiohttp import web

from memrad.config import Settings
from memrad.protocol import PoolStats, StateSnapshot
from memrad.scheduler import EngineLike, Scheduler
from memrad.server.response_store import ResponseStore


class ServingEngine(EngineLike, Protocol):
    """The engine as the server sees it: tokenization and metadata, no torch types."""

    model_id: str
    context_len: int
    vocab_size: int

    def render_chat(self, messages: list[dict], tools: list[dict] | None) -> tuple[str, list[int]]: ...
    def encode_prompt(self, text: str) -> list[int]: ...
    def decode_prompt(self, ids: list[int]) -> str: ...
    def reply_parser(self, prompt_text: str, parse_tools: bool) -> Any: ...  # -> serving.ReplyParserLike


@dataclass
class ServerContext:
    settings: Settings
    engine: ServingEngine
    scheduler: Scheduler
    device: str
    dtype: str
    started_at: float = field(default_factory=time.time)
    # Where the engine's control events go (metrics, the control socket's bus); called on
    # the engine thread, so each sink must be thread-safe.
    event_sinks: list[Callable[[object], None]] = field(default_factory=list)

    def publish(self, event: object) -> None:
        for sink in self.event_sinks:
            try:
                sink(event)
            except Exception:  # a sink must never break serving
                logging.getLogger("memrad.server").exception("event sink failed on %s", type(event).__name__)
    responses: ResponseStore = field(default_factory=ResponseStore)  # for previous_response_id


CONTEXT = web.AppKey("context", ServerContext)


def state_snapshot(ctx: ServerContext) -> StateSnapshot:
    """The control socket's `snapshot`: parked sessions, pool stats, the flags in force."""
    engine, settings = ctx.engine, ctx.settings
    pool = getattr(engine, "pool", None)
    disk = getattr(engine, "disk", None)
    on_disk = (len(disk.pool.sessions()), disk.pool.bytes_parked) if disk is not None else (0, 0)
    stats = None if pool is None else PoolStats(len(pool.sessions()), pool.bytes_parked, pool.max_sessions,
                                                pool.max_bytes, *on_disk)
    flags = (("reuse.mode", settings.reuse.mode), ("affinity", str(settings.affinity.enabled).lower()),
             ("longest_prefix", str(settings.affinity.longest_prefix).lower()),
             ("pool", str(settings.pool.enabled).lower()),
             ("prefill_chunk", str(settings.engine.prefill_chunk)), ("dtype", ctx.dtype))
    sessions = tuple(engine.session_infos()) if hasattr(engine, "session_infos") else ()
    return StateSnapshot(model=engine.model_id, device=ctx.device, uptime_s=round(time.time() - ctx.started_at, 3),
                         requests_served=ctx.scheduler.requests_served, pool=stats, flags=flags,
                         sessions=sessions)
