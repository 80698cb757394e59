"""A model's reply as the APIs see it: content, reasoning and tool calls. Pure records.

The engine's reply parser (memrad.chat.parse) turns generated text into
ReplyDelta records as it streams; ReplyBuilder folds them into the whole Reply, so a
streamed and a whole response are built from the same deltas and cannot disagree.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Literal

DeltaKind = Literal["reasoning", "content", "tool_call"]


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One parsed call. `arguments` is JSON text (an object), exactly as every API sends it."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class ReplyDelta:
    """A piece of the reply: text of `kind` reasoning/content, or one whole tool call."""

    kind: DeltaKind
    text: str = ""
    call: ToolCall | None = None
    index: int | None = None  # the call's position among this reply's calls


@dataclass(frozen=True, slots=True)
class Reply:
    content: str
    reasoning: str | None
    tool_calls: tuple[ToolCall, ...]


@dataclass
class ReplyBuilder:
    """Accumulates deltas (mutates itself only)."""

    content: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    calls: list[ToolCall] = field(default_factory=list)

    def add(self, delta: ReplyDelta) -> None:
        if delta.kind == "tool_call":
            assert delta.call is not None
            self.calls.append(delta.call)
        else:
            (self.content if delta.kind == "content" else self.reasoning).append(delta.text)

    def extend(self, deltas: list[ReplyDelta]) -> None:
        for delta in deltas:
            self.add(delta)

    def reply(self) -> Reply:
        reasoning = "".join(self.reasoning)
        return Reply("".join(self.content), reasoning or None, tuple(self.calls))


def plain_reply_deltas(text: str) -> list[ReplyDelta]:
    """Text of a model without a reply format: all of it is content."""
    return [ReplyDelta("content", text)] if text else []
