"""OpenAI response objects, streamed and whole, for chat and text completions.

Every API's output is a Shape: events to open a stream, events per reply delta, events to
close it, and the whole object. The route drives any Shape the same way (memrad.server.serving).
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass
from typing import Literal, Protocol

from memrad.protocol import Decision
from memrad.chat.reply import Reply, ReplyDelta
from memrad.request import Completion

Kind = Literal["chat", "completion"]
# One server-sent event: (event name or None, data object or a bare string like "[DONE]").
Event = tuple[str | None, dict | str]


class Shape(Protocol):
    """One API's rendering of a generation (pure; mutates only its own counters)."""

    def opening(self, decision: Decision | None) -> list[Event]: ...
    def deltas(self, delta: ReplyDelta) -> list[Event]: ...
    def closing(self, reply: Reply, c: Completion) -> list[Event]: ...
    def whole(self, reply: Reply, c: Completion, decision: Decision | None) -> dict: ...
    def stream_error(self, body: dict) -> list[Event]: ...


def decision_field(decision: Decision | None) -> dict:
    """The `memra` field every API's object carries: the reuse decision's one rendering."""
    return {"memra": {"decision": decision.render()}} if decision is not None else {}


def new_request_id(kind: Kind) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + secrets.token_hex(12)


def usage(c: Completion) -> dict:
    return {
        "prompt_tokens": c.prompt_tokens,
        "completion_tokens": c.completion_tokens,
        "total_tokens": c.total_tokens,
        "prompt_tokens_details": {"cached_tokens": c.cached_tokens},
    }


def finish_reason(c: Completion, reply: Reply | None = None) -> str:
    """OpenAI's finish_reason; cancelled requests never reach this (they end in an error)."""
    if c.finish_reason == "length":
        return "length"
    return "tool_calls" if reply is not None and reply.tool_calls else "stop"


def chat_message(reply: Reply) -> dict:
    message: dict = {"role": "assistant",
                     "content": reply.content if reply.content or not reply.tool_calls else None}
    if reply.reasoning is not None:
        message["reasoning_content"] = reply.reasoning
    if reply.tool_calls:
        message["tool_calls"] = [{"id": call.id, "type": "function",
                                  "function": {"name": call.name, "arguments": call.arguments}}
                                 for call in reply.tool_calls]
    return message


@dataclass(frozen=True, slots=True)
class Envelope:
    """The fields every object of one response shares."""

    kind: Kind
    request_id: str
    model: str
    created: int

    @classmethod
    def new(cls, kind: Kind, request_id: str, model: str) -> "Envelope":
        return cls(kind, request_id, model, int(time.time()))

    def _head(self, object_name: str) -> dict:
        return {"id": self.request_id, "object": object_name, "created": self.created, "model": self.model}

    def whole(self, c: Completion, reply: Reply | None = None) -> dict:
        if self.kind == "chat":
            reply = reply if reply is not None else Reply(c.text, None, ())
            choice = {"index": 0, "message": chat_message(reply), "logprobs": None,
                      "finish_reason": finish_reason(c, reply)}
            return {**self._head("chat.completion"), "choices": [choice], "usage": usage(c)}
        choice = {"index": 0, "text": c.text, "logprobs": None, "finish_reason": finish_reason(c)}
        return {**self._head("text_completion"), "choices": [choice], "usage": usage(c)}

    def chunk(self, text: str | None = None, finish: str | None = None, *, first: bool = False,
              with_usage_field: bool = False, delta: dict | None = None) -> dict:
        if self.kind == "chat":
            body: dict = {"role": "assistant", "content": ""} if first else {}
            if text is not None:
                body["content"] = text
            body.update(delta or {})
            choice = {"index": 0, "delta": body, "logprobs": None, "finish_reason": finish}
            out = {**self._head("chat.completion.chunk"), "choices": [choice]}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
            out = {**self._head("text_completion"), "choices": [choice]}
        if with_usage_field:
            out["usage"] = None
        return out

    def usage_chunk(self, c: Completion) -> dict:
        name = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {**self._head(name), "choices": [], "usage": usage(c)}


@dataclass(frozen=True, slots=True)
class OpenAIShape:
    """Chat Completions and text completions (`envelope.kind`)."""

    envelope: Envelope
    include_usage: bool

    def opening(self, decision: Decision | None) -> list[Event]:
        if self.envelope.kind != "chat":
            return []
        return [(None, self.envelope.chunk(first=True, with_usage_field=self.include_usage))]

    def deltas(self, delta: ReplyDelta) -> list[Event]:
        chunk = lambda **kw: (None, self.envelope.chunk(with_usage_field=self.include_usage, **kw))  # noqa: E731
        if delta.kind == "content":
            return [chunk(text=delta.text)]
        if delta.kind == "reasoning":
            return [chunk(delta={"reasoning_content": delta.text})]
        call = delta.call
        assert call is not None
        # OpenAI's incremental form: id and name first, then the arguments' chunks.
        return [chunk(delta={"tool_calls": [{"index": delta.index, "id": call.id, "type": "function",
                                             "function": {"name": call.name, "arguments": ""}}]}),
                chunk(delta={"tool_calls": [{"index": delta.index, "function": {"arguments": call.arguments}}]})]

    def closing(self, reply: Reply, c: Completion) -> list[Event]:
        events: list[Event] = [(None, self.envelope.chunk(finish=finish_reason(c, reply),
                                                          with_usage_field=self.include_usage))]
        if self.include_usage:
            events.append((None, self.envelope.usage_chunk(c)))
        return events + [(None, "[DONE]")]

    def whole(self, reply: Reply, c: Completion, decision: Decision | None) -> dict:
        return {**self.envelope.whole(c, reply if self.envelope.kind == "chat" else None),
                **decision_field(decision)}

    def stream_error(self, body: dict) -> list[Event]:
        return [(None, body)]


def sse(payload: dict | str, event: str | None = None) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {data}\n\n".encode()
