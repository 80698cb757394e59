"""OpenAI's Chat Completions (`POST /v1/chat/completions`) and legacy Completions
(`POST /v1/completions`): body -> internal request, reply -> completion object. Pure.

Chat bodies are already in the internal shape (memrad.server.tools); parsing checks them
and normalises roles (developer -> system). A completion's prompt is a string or token
ids and skips the chat template. Both answer through one Shape, OpenAIShape, whose
`envelope.kind` says which object it writes; the decision reason rides in the object's
`memra` field and the `x-memra-decision` header.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass
from typing import Any, Literal

from memrad.protocol import Decision
from memrad.chat.reply import Reply, ReplyDelta
from memrad.request import Completion, TokenLogprob
from memrad.server.decoding import logprob_entries
from memrad.server.errors import invalid, shown
from memrad.server.serving import Event, decision_field
from memrad.server.tools import (OPENAI_MODES, ToolChoice, ToolMode, ToolParts, function_tools, tool_call,
                                 tool_choice_of)
from memrad.server.validate import Notes, ParsedRequest, boolean, common, joined_text, object_body, unsupported

Kind = Literal["chat", "completion"]
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def new_request_id(kind: Kind) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + secrets.token_hex(12)


def parse_chat(body: Any, header_session_id: str | None) -> ParsedRequest:
    body = object_body(body)
    tools = chat_tools(body.get("tools"))
    parallel = boolean(body, "parallel_tool_calls")
    notes = Notes()
    return ParsedRequest(
        messages=_messages(body.get("messages"), notes),
        tools=tools,
        tool_choice=chat_tool_choice(body.get("tool_choice"), tools),
        parallel_tool_calls=True if parallel is None else parallel,
        notes=notes.items(),
        **common(body, header_session_id, max_tokens_keys=("max_completion_tokens", "max_tokens")),
    )


def parse_completion(body: Any, header_session_id: str | None) -> ParsedRequest:
    body = object_body(body)
    unsupported(body, "echo", (None, False), "echo is not supported")
    unsupported(body, "suffix", (None, ""), "suffix (fill-in-the-middle) is not supported")
    unsupported(body, "best_of", (None, 1), "best_of must be 1")
    unsupported(body, "logprobs", (None, False, 0), "logprobs are not supported on /v1/completions")
    return ParsedRequest(prompt=_prompt(body.get("prompt")),
                         **common(body, header_session_id, max_tokens_keys=("max_tokens",)))


def _messages(value: Any, notes: Notes) -> tuple[dict, ...]:
    if value is None:
        raise invalid("messages is required: a non-empty array of {role, content} objects", "messages")
    if not isinstance(value, list) or not value:
        raise invalid("messages must be a non-empty array of {role, content} objects", "messages")
    out = []
    unanswered: list[str] = []  # the latest assistant turn's call ids no tool message answered yet
    for i, m in enumerate(value):
        message = _message(m, i, notes)
        if message["role"] == "assistant":
            unanswered = [call["id"] for call in message.get("tool_calls", ())]
        elif message["role"] == "tool":
            if "tool_call_id" not in message:
                # Some clients leave the id out: results answer the calls in order.
                if not unanswered:
                    raise invalid(f"messages[{i}].tool_call_id is required: no earlier tool call is left "
                                  "unanswered to pair this result with", f"messages[{i}].tool_call_id")
                message["tool_call_id"] = unanswered[0]
                notes.add("tool messages without tool_call_id were paired with the calls in order")
            if message["tool_call_id"] in unanswered:
                unanswered.remove(message["tool_call_id"])
        out.append(message)
    return tuple(out)


def _message(message: Any, i: int, notes: Notes) -> dict:
    where = f"messages[{i}]"
    if not isinstance(message, dict):
        raise invalid(f"{where} must be an object with role and content", where)
    role = message.get("role")
    if role not in CHAT_ROLES:
        raise invalid(f"{where}.role must be one of {', '.join(CHAT_ROLES)}; got {shown(role)}", f"{where}.role")
    out: dict = {"role": "system" if role == "developer" else role}
    content = message.get("content")
    tool_calls = message.get("tool_calls")
    if tool_calls is not None:
        if role != "assistant":
            raise invalid(f"{where}.tool_calls must be an array on an assistant message", f"{where}.tool_calls")
    if content is None and role != "assistant":
        raise invalid(f"{where}.content is required", f"{where}.content")
    out["content"] = joined_text(content, f"{where}.content", notes=notes) if content is not None else ""
    if tool_calls:
        out["tool_calls"] = chat_tool_calls(tool_calls, f"{where}.tool_calls")
    keys = {"assistant": ("reasoning_content",), "tool": ("tool_call_id",)}.get(role, ("name",))
    for key in keys:
        if message.get(key) is not None:
            if not isinstance(message[key], str):
                raise invalid(f"{where}.{key} must be a string", f"{where}.{key}")
            out[key] = message[key]
    return out


def chat_tool_calls(value: Any, where: str) -> list[dict]:
    if not isinstance(value, list):
        raise invalid(f"{where} must be an array of tool calls", where)
    out = []
    for j, call in enumerate(value):
        here = f"{where}[{j}]"
        if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
            raise invalid(f"{here} must be {{\"id\", \"type\": \"function\", \"function\": {{\"name\", "
                          "\"arguments\"}}}}", here)
        fn = call["function"]
        out.append(tool_call(call.get("id"), fn.get("name"), fn.get("arguments", "{}"), here))
    return out


def _prompt(value: Any) -> str | tuple[int, ...]:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]
    if isinstance(value, str):
        if not value:
            raise invalid("prompt must not be empty", "prompt")
        return value
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return tuple(value)
    if isinstance(value, list) and len(value) > 1:
        raise invalid("prompt must be one string (batches of prompts are not supported)", "prompt")
    raise invalid("prompt is required: a non-empty string or an array of token ids", "prompt")


def chat_tools(value: Any) -> tuple[dict, ...] | None:
    """Chat Completions `tools`: function tools only."""
    return function_tools(value, '{"type": "function", "function": {...}} objects', _tool)


def _tool(tool: Any, where: str) -> ToolParts:
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise invalid(f"{where} must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}: "
                      "memrad serves function tools only", where)
    fn = tool["function"]
    return fn.get("name"), fn.get("description"), fn.get("parameters")


def chat_tool_choice(value: Any, tools: tuple[dict, ...] | None) -> ToolChoice:
    """Chat `tool_choice`: "auto" | "none" | "required" | {"type": "function", "function": {"name"}}."""
    return tool_choice_of(value, tools, _named_choice, '"auto", "none", "required" or {"type": "function", "function": '
                          '{"name": ...}}', OPENAI_MODES)


def _named_choice(value: dict) -> tuple[ToolMode, Any] | None:
    function = value.get("function")
    if value.get("type") != "function" or not isinstance(function, dict):
        return None
    return "function", function.get("name")


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
            choice = {"index": 0, "message": chat_message(reply), "finish_reason": finish_reason(c, reply),
                      "logprobs": None if c.logprobs is None else {"content": logprob_entries(c.logprobs),
                                                                   "refusal": None}}
            return {**self._head("chat.completion"), "choices": [choice], "usage": usage(c)}
        choice = {"index": 0, "text": c.text, "logprobs": None, "finish_reason": finish_reason(c)}
        return {**self._head("text_completion"), "choices": [choice], "usage": usage(c)}

    def chunk(self, text: str | None = None, finish: str | None = None, *, first: bool = False,
              with_usage_field: bool = False, delta: dict | None = None,
              logprobs: tuple[TokenLogprob, ...] = ()) -> dict:
        if self.kind == "chat":
            body: dict = {"role": "assistant", "content": ""} if first else {}
            if text is not None:
                body["content"] = text
            body.update(delta or {})
            # OpenAI's chunk shape: the tokens this chunk carries (None on a chunk that has none).
            choice = {"index": 0, "delta": body, "finish_reason": finish,
                      "logprobs": {"content": logprob_entries(logprobs), "refusal": None} if logprobs else None}
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
    notes: tuple[str, ...] = ()

    def opening(self, decision: Decision | None) -> list[Event]:
        if self.envelope.kind != "chat":
            return []
        return [(None, {**self.envelope.chunk(first=True, with_usage_field=self.include_usage),
                        **decision_field(decision, self.notes)})]

    def deltas(self, delta: ReplyDelta, logprobs: tuple[TokenLogprob, ...] = ()) -> list[Event]:
        chunk = lambda **kw: (None, self.envelope.chunk(with_usage_field=self.include_usage, **kw))  # noqa: E731
        if delta.kind == "content":
            return [chunk(text=delta.text, logprobs=logprobs)]
        if delta.kind == "reasoning":
            return [chunk(delta={"reasoning_content": delta.text}, logprobs=logprobs)]
        call = delta.call
        assert call is not None
        # OpenAI's incremental form: id and name first, then the arguments' chunks.
        return [chunk(delta={"tool_calls": [{"index": delta.index, "id": call.id, "type": "function",
                                             "function": {"name": call.name, "arguments": ""}}]}, logprobs=logprobs),
                chunk(delta={"tool_calls": [{"index": delta.index, "function": {"arguments": call.arguments}}]})]

    def closing(self, reply: Reply, c: Completion, logprobs: tuple[TokenLogprob, ...] = ()) -> list[Event]:
        # Tokens whose text never left as a delta (a stop string's, held-back markup) ride on the last chunk.
        events: list[Event] = [(None, self.envelope.chunk(finish=finish_reason(c, reply), logprobs=logprobs,
                                                          with_usage_field=self.include_usage))]
        if self.include_usage:
            events.append((None, self.envelope.usage_chunk(c)))
        return events + [(None, "[DONE]")]

    def whole(self, reply: Reply, c: Completion, decision: Decision | None) -> dict:
        return {**self.envelope.whole(c, reply if self.envelope.kind == "chat" else None),
                **decision_field(decision, self.notes, c.speculation)}

    def stream_error(self, body: dict) -> list[Event]:
        return [(None, body)]

    def keepalive(self) -> list[Event]:
        # A chunk of its own would be a choice without content to every parser; the comment
        # reaches the clients that time bytes (the SDKs' read timeouts), which is all of them
        # we pin (docs/SERVING.md, Keepalives).
        return []
