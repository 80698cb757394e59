"""What every handler needs, stored once on the app under a typed key."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from aiohttp import web

from memrad.config import Settings
from memrad.chat.reply import ReplyDelta
from memrad.protocol import FlightInfo, PoolStats, SessionInfo, StateSnapshot
from memrad.request import Constraint
from memrad.scheduler import EngineLike, Scheduler
from memrad.server.response_store import ResponseStore


class ReplyParserLike(Protocol):
    """memrad.chat.parse.ReplyParser as the server sees it (each call mutates its state)."""

    def feed(self, text: str) -> list[ReplyDelta]: ...
    def finish(self) -> list[ReplyDelta]: ...


class ChatLike(Protocol):
    """The model's chat text (memrad.chat.chat.Chat): render, tokenize, parse replies."""

    vocab_size: int

    def render(self, messages: list[dict], tools: list[dict] | None, require_call: bool = False,
               call_name: str | None = None) -> tuple[str, list[int]]: ...
    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...
    def parser(self, prompt_text: str, parse_tools: bool, tool_names: frozenset[str] | None = None) -> ReplyParserLike: ...
    def tool_constraint(self, tools: list[dict], mode: str, name: str | None,
                        parallel: bool) -> Constraint | None: ...
    def grammar_error(self, constraint: Constraint) -> str | None: ...
    @property
    def compiling(self) -> str | None: ...  # the field whose grammar is being compiled now, if any


class EventsLike(Protocol):
    def subscribe(self, sink: Callable[[object], None]) -> None: ...


class ServingEngine(EngineLike, Protocol):
    """Exactly what the server uses of the engine (memrad.engine.engine.Engine); no torch types."""

    model_id: str
    context_len: int
    chat: ChatLike
    events: EventsLike  # control events, on the engine thread
    runtime_choices: dict[str, dict[str, str]]  # what the hardware choices picked, and why

    def stats(self) -> PoolStats: ...  # zeros for a tier that is off
    def infos(self) -> list[SessionInfo]: ...
    def flight_infos(self) -> list[FlightInfo]: ...  # the requests on the model now
    def close(self) -> list[str]: ...  # one line per parked session not saved to disk


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
    responses: ResponseStore = field(default_factory=ResponseStore)  # for previous_response_id

    def publish(self, event: object) -> None:
        for sink in self.event_sinks:
            try:
                sink(event)
            except Exception:  # a sink must never break serving
                logging.getLogger("memrad.server").exception("event sink failed on %s", type(event).__name__)


CONTEXT = web.AppKey("context", ServerContext)


def state_snapshot(ctx: ServerContext) -> StateSnapshot:
    """The control socket's `snapshot`: parked sessions, pool stats, the flags in force."""
    settings = ctx.settings
    flags = (("reuse.mode", settings.reuse.mode), ("affinity", str(settings.affinity.enabled).lower()),
             ("longest_prefix", str(settings.affinity.longest_prefix).lower()),
             ("pool", str(settings.pool.enabled).lower()),
             ("prefill_chunk", str(settings.engine.prefill_chunk)), ("dtype", ctx.dtype))
    threads = ctx.engine.runtime_choices.get("threads")
    if threads is not None:  # memra-tui keeps it current from ThreadsEvents
        flags += (("threads", threads["value"]),)
    return StateSnapshot(model=ctx.engine.model_id, device=ctx.device, uptime_s=round(time.time() - ctx.started_at, 3),
                         requests_served=ctx.scheduler.requests_served, pool=ctx.engine.stats(), flags=flags,
                         sessions=tuple(ctx.engine.infos()), flights=tuple(ctx.engine.flight_infos()))
