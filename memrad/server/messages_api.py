"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`). Pure.

Content blocks map onto the internal chat messages:

    system (string or text blocks)          -> the leading system message
    {"role": "system"} inside messages      -> a system message in place (Claude Code's
                                               mid-conversation system turn; memrad.chat.render
                                               folds it where the template has no such turn)
    user: tool_result blocks, then text     -> tool messages (one per result), then a user message
    assistant: thinking, text, tool_use     -> one assistant message with reasoning_content,
                                               content and tool_calls
    image / document blocks                 -> placeholder text, with a note

`cache_control` is never read: Claude Code moves it to the newest turn every request, and
the rendered bytes must not change with it. Server tools (web_search_2025…, code execution)
are left out with a note: a local model cannot run them.

Usage follows Anthropic's accounting: `input_tokens` are the tokens primed for this request,
`cache_read_input_tokens` the ones memrad reused (their sum is the prompt). The decision
reason rides in the message's `memra` field and the `x-memra-decision` header; errors use
Anthropic's envelope (memrad.server.errors, style "anthropic").
"""

from __future__ import annotations

import hashlib
import json
import secrets
from dataclasses import dataclass, field
from typing import Any

from memrad.protocol import Decision
from memrad.chat.reply import Reply, ReplyDelta
from memrad.request import Completion, SamplingParams, TokenLogprob
from memrad.server.decoding import messages_output_format, top_k_of
from memrad.server.errors import invalid, shown
from memrad.server.serving import Event, decision_field
from memrad.server.tools import (ToolChoice, ToolMode, ToolParts, assistant_message, function_tool, function_tools,
                                 tool_call, tool_choice_of, tool_result)
from memrad.server.validate import (MAX_STOP_SEQUENCES, MEDIA_PARTS, Notes, ParsedRequest, identity_of, joined_text,
                                    name_field, number, object_body, stops)


def new_message_id() -> str:
    return "msg_" + secrets.token_hex(12)


def parse_messages(body: Any, header_session_id: str | None, count_only: bool = False) -> ParsedRequest:
    body = object_body(body)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("model is required: a non-empty string", "model")
    max_tokens = body.get("max_tokens")
    if not count_only and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1):
        raise invalid("max_tokens is required: an integer of at least 1", "max_tokens")
    notes = Notes()
    messages = _system(body.get("system")) + _messages(body.get("messages"), notes)
    tools, left_out = messages_tools(body.get("tools"))
    if left_out:
        notes.add(f"server tools this model cannot run were left out: {', '.join(left_out)}")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise invalid("stream must be true or false", "stream")
    temperature = number(body, "temperature", 0.0, 1.0, quote_value=False)
    top_p = number(body, "top_p", 0.0, 1.0, quote_value=False)
    sampling = SamplingParams(temperature=1.0 if temperature is None else float(temperature),
                              top_p=float(top_p) if top_p else 1.0,
                              max_tokens=max_tokens if not count_only else None,
                              stop=stops(body.get("stop_sequences"), "stop_sequences", one_string=False,
                                         limit=MAX_STOP_SEQUENCES),
                              top_k=top_k_of(body), constraint=messages_output_format(body))
    metadata = body.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise invalid("metadata must be an object like {\"user_id\": ...}", "metadata")
    choice = messages_tool_choice(body.get("tool_choice"), tools)  # a dict from here on, if given
    return ParsedRequest(model=model, sampling=sampling, stream=stream, include_usage=False,
                         identity=identity_of(body, header_session_id, keys=("session_id", "metadata.user_id")),
                         cache_salt=name_field(body.get("cache_salt"), "cache_salt"), messages=messages,
                         tools=tools, tool_choice=choice, notes=notes.items(),
                         parallel_tool_calls=not (body.get("tool_choice") or {}).get("disable_parallel_tool_use"))


def _system(value: Any) -> tuple[dict, ...]:
    if value is None or value == "" or value == []:
        return ()
    return ({"role": "system", "content": joined_text(value, "system", "block")},)


def _messages(value: Any, notes: Notes) -> tuple[dict, ...]:
    if not isinstance(value, list) or not value:
        raise invalid("messages is required: a non-empty array of {role, content} objects", "messages")
    out: list[dict] = []
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant", "system"):
            raise invalid(f"{where} must be an object with role \"user\", \"assistant\" or \"system\"",
                          f"{where}.role")
        content = message.get("content")
        if message["role"] == "system":
            out.append({"role": "system", "content": joined_text(content, f"{where}.content", "block", notes)})
            continue
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list):
            raise invalid(f"{where}.content must be a string or an array of content blocks", f"{where}.content")
        out.extend(_user(blocks, where, notes) if message["role"] == "user" else [_assistant(blocks, where)])
    return tuple(out)


def _user(blocks: list, where: str, notes: Notes) -> list[dict]:
    out, texts = [], []
    for j, block in enumerate(blocks):
        here = f"{where}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "tool_result":
            result = block.get("content", "")
            out.append(tool_result(block.get("tool_use_id"), joined_text(result, f"{here}.content", "block", notes),
                                   here))
        elif kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind in MEDIA_PARTS:
            texts.append(notes.placeholder(MEDIA_PARTS[kind]))
        else:
            raise invalid(f"{here} has type {shown(kind)}; user messages accept text and tool_result blocks "
                          "(this model accepts text only)", here)
    if texts:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _assistant(blocks: list, where: str) -> dict:
    texts, thinking, calls = [], [], []
    for j, block in enumerate(blocks):
        here = f"{where}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "thinking" and isinstance(block.get("thinking"), str):
            thinking.append(block["thinking"])
        elif kind == "redacted_thinking":
            continue  # opaque to memrad: nothing to render
        elif kind == "tool_use":
            calls.append(tool_call(block.get("id"), block.get("name"), block.get("input", {}), here))
        else:
            raise invalid(f"{here} has type {shown(kind)}; assistant messages accept text, thinking and tool_use "
                          "blocks", here)
    return assistant_message("\n".join(texts), calls, "\n".join(thinking) or None)


def messages_tools(value: Any) -> tuple[tuple[dict, ...] | None, tuple[str, ...]]:
    """Custom tools, as Anthropic sends them ({"name", "description", "input_schema"}), and the
    types of the server tools left out ({"type": "web_search_20250305", …}), in the order sent."""
    if not isinstance(value, list):
        return function_tools(value, "{name, description, input_schema} objects", _tool), ()
    left_out = tuple(t["type"] for t in value if isinstance(t, dict) and _server_tool(t))
    tools = tuple(function_tool(*_tool(t, f"tools[{i}]"), f"tools[{i}]") for i, t in enumerate(value)
                  if not (isinstance(t, dict) and _server_tool(t)))
    return tools or None, left_out


def _server_tool(tool: dict) -> bool:
    return isinstance(tool.get("type"), str) and tool["type"] not in ("custom", "")


def _tool(tool: Any, where: str) -> ToolParts:
    if not isinstance(tool, dict):
        raise invalid(f"{where} must be a custom tool {{name, description, input_schema}}", where)
    return tool.get("name"), tool.get("description"), tool.get("input_schema")


CHOICE_MODES: dict[str, ToolMode] = {"auto": "auto", "any": "required", "none": "none", "tool": "function"}


def messages_tool_choice(value: Any, tools: tuple[dict, ...] | None) -> ToolChoice:
    """auto | any (a call is required) | tool (named) | none."""
    return tool_choice_of(value, tools, _named_choice, '{"type": "auto" | "any" | "tool" | "none"}')


def _named_choice(value: dict) -> tuple[ToolMode, Any] | None:
    kind = value.get("type")
    return (CHOICE_MODES[kind], value.get("name")) if kind in CHOICE_MODES else None


def stop_reason(reply: Reply, c: Completion) -> str:
    if c.finish_reason == "length":
        return "max_tokens"
    if c.stop_sequence is not None:
        return "stop_sequence"
    return "tool_use" if reply.tool_calls else "end_turn"


def usage(c: Completion) -> dict:
    return {"input_tokens": c.prompt_tokens - c.cached_tokens, "output_tokens": c.completion_tokens,
            "cache_read_input_tokens": c.cached_tokens, "cache_creation_input_tokens": 0}


def signature(thinking: str) -> str:
    """A thinking block's signature: Claude Code keeps a thinking block only with one. memrad
    verifies nothing (the client sends the block back, it is rendered as text), so it is a
    digest of the text: the same thinking always carries the same signature."""
    return "memra-" + hashlib.sha256(thinking.encode()).hexdigest()[:32]


def _block(delta: ReplyDelta) -> dict:
    if delta.kind == "reasoning":
        return {"type": "thinking", "thinking": "", "signature": ""}
    if delta.kind == "content":
        return {"type": "text", "text": ""}
    call = delta.call
    assert call is not None
    return {"type": "tool_use", "id": call.id, "name": call.name, "input": {}}


@dataclass
class MessagesShape:
    """The message object and its event stream. Mutable: tracks the open content block."""

    message_id: str
    model: str
    num_prompt_tokens: int
    notes: tuple[str, ...] = ()  # for the `memra` field (validate.Notes)
    blocks: list[dict] = field(default_factory=list)
    _open: str | None = None  # kind of the block being streamed

    def _message(self, decision: Decision | None) -> dict:
        return {"id": self.message_id, "type": "message", "role": "assistant", "model": self.model,
                "content": [], "stop_reason": None, "stop_sequence": None, **decision_field(decision, self.notes)}

    def opening(self, decision: Decision | None) -> list[Event]:
        reused = decision.reused_tokens if decision is not None else 0
        message = {**self._message(decision),
                   "usage": {"input_tokens": self.num_prompt_tokens - reused, "output_tokens": 0,
                             "cache_read_input_tokens": reused, "cache_creation_input_tokens": 0}}
        return [("message_start", {"type": "message_start", "message": message})]

    def _stop(self) -> list[Event]:
        if self._open is None:
            return []
        events: list[Event] = []
        index, block = len(self.blocks) - 1, self.blocks[-1]
        if self._open == "reasoning":
            block["signature"] = signature(block["thinking"])
            events.append(("content_block_delta", {"type": "content_block_delta", "index": index,
                                                   "delta": {"type": "signature_delta",
                                                             "signature": block["signature"]}}))
        self._open = None
        return events + [("content_block_stop", {"type": "content_block_stop", "index": index})]

    def deltas(self, delta: ReplyDelta, logprobs: tuple[TokenLogprob, ...] = ()) -> list[Event]:
        # Anthropic's API has no logprobs (a Messages request never asks for them).
        events: list[Event] = []
        if delta.kind == "tool_call" or self._open != delta.kind:
            events += self._stop()
            self.blocks.append(_block(delta))
            self._open = delta.kind
            events.append(("content_block_start", {"type": "content_block_start", "index": len(self.blocks) - 1,
                                                   "content_block": dict(self.blocks[-1])}))
        index, block = len(self.blocks) - 1, self.blocks[-1]
        if delta.kind == "reasoning":
            block["thinking"] += delta.text
            body = {"type": "thinking_delta", "thinking": delta.text}
        elif delta.kind == "content":
            block["text"] += delta.text
            body = {"type": "text_delta", "text": delta.text}
        else:
            assert delta.call is not None
            self.blocks[-1] = {**block, "input": json.loads(delta.call.arguments)}
            body = {"type": "input_json_delta", "partial_json": delta.call.arguments}
        return events + [("content_block_delta", {"type": "content_block_delta", "index": index, "delta": body})]

    def closing(self, reply: Reply, c: Completion, logprobs: tuple[TokenLogprob, ...] = ()) -> list[Event]:
        return self._stop() + [
            ("message_delta", {"type": "message_delta",
                               "delta": {"stop_reason": stop_reason(reply, c), "stop_sequence": c.stop_sequence},
                               "usage": usage(c)}),
            ("message_stop", {"type": "message_stop"})]

    def whole(self, reply: Reply, c: Completion, decision: Decision | None) -> dict:
        for kind, text in (("reasoning", reply.reasoning), ("content", reply.content)):
            if text:
                self.deltas(ReplyDelta(kind, text))  # type: ignore[arg-type]
        for index, call in enumerate(reply.tool_calls):
            self.deltas(ReplyDelta("tool_call", call=call, index=index))
        self._stop()
        return {**self._message(decision), **decision_field(decision, self.notes, c.speculation),
                "content": self.blocks, "stop_reason": stop_reason(reply, c), "stop_sequence": c.stop_sequence,
                "usage": usage(c)}

    def stream_error(self, body: dict) -> list[Event]:
        return [("error", body)]

    def keepalive(self) -> list[Event]:
        # Anthropic's own keepalive: an event, so event-counting idle timers see it too.
        return [("ping", {"type": "ping"})]
