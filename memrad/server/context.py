"""What every handler needs, stored once on the app under a typed key."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

from aiohttp import web

from memrad.config import Settings
from memrad.scheduler import EngineLike, Scheduler


class ServingEngine(EngineLike, Protocol):
    """The engine as the server sees it: tokenization and metadata, no torch types."""

    model_id: str
    context_len: int
    vocab_size: int

    def render_chat(self, messages: list[dict], tools: list[dict] | None) -> tuple[str, list[int]]: ...
    def encode_prompt(self, text: str) -> list[int]: ...
    def decode_prompt(self, ids: list[int]) -> str: ...


@dataclass
class ServerContext:
    settings: Settings
    engine: ServingEngine
    scheduler: Scheduler
    device: str
    dtype: str
    started_at: float = field(default_factory=time.time)


CONTEXT = web.AppKey("context", ServerContext)
