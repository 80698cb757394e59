"""OpenAI response objects, streamed and whole, for chat and text completions."""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass
from typing import Literal

from memrad.request import Completion

Kind = Literal["chat", "completion"]


def new_request_id(kind: Kind) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + secrets.token_hex(12)


def usage(c: Completion) -> dict:
    return {
        "prompt_tokens": c.prompt_tokens,
        "completion_tokens": c.completion_tokens,
        "total_tokens": c.total_tokens,
        "prompt_tokens_details": {"cached_tokens": c.cached_tokens},
    }


def finish_reason(c: Completion) -> str:
    """OpenAI's finish_reason; cancelled requests never reach this (they end in an error)."""
    return "length" if c.finish_reason == "length" else "stop"


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

    def whole(self, c: Completion) -> dict:
        if self.kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": c.text},
                      "logprobs": None, "finish_reason": finish_reason(c)}
            return {**self._head("chat.completion"), "choices": [choice], "usage": usage(c)}
        choice = {"index": 0, "text": c.text, "logprobs": None, "finish_reason": finish_reason(c)}
        return {**self._head("text_completion"), "choices": [choice], "usage": usage(c)}

    def chunk(self, text: str | None = None, finish: str | None = None, *, first: bool = False,
              with_usage_field: bool = False) -> dict:
        if self.kind == "chat":
            delta: dict = {"role": "assistant", "content": ""} if first else {}
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
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


def sse(payload: dict | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n".encode()
