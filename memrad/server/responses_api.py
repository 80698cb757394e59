"""OpenAI's Responses API (`POST /v1/responses`): body -> internal request, reply -> response.

Pure (no I/O, no engine). Input items map onto the internal chat messages:

    message (user/system/developer)   -> that role's message
    reasoning + message(assistant)    -> one assistant message with reasoning_content,
      + function_call / custom_tool_call  content and tool_calls (in that order)
    function_call_output,             -> a tool message answering call_id
      custom_tool_call_output
    any other kind (web_search_call…) -> skipped, with a note (it holds nothing to render)

Tools: memrad.server.responses_tools. Output items are in one order, streamed or whole:
reasoning, message, then the calls (as OpenAI orders them), so a client that re-sends
`output` re-sends the same history either way.

`instructions` becomes the leading system message of this request only (as OpenAI does, it
is not carried over by previous_response_id). The decision reason rides in the response
object's `memra` field and the `x-memra-decision` header.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from memrad.protocol import Decision
from memrad.chat.reply import Reply, ReplyDelta
from memrad.request import Completion, Identity, TokenLogprob
from memrad.server.decoding import logprob_entries, responses_logprobs, responses_text_format
from memrad.server.errors import invalid, shown
from memrad.server.response_store import StoredResponse
from memrad.server.serving import Event, decision_field
from memrad.chat.reply import ToolCall
from memrad.server.responses_tools import CUSTOM_INPUT, ResponsesTools, call_item, responses_tools
from memrad.server.tools import (OPENAI_MODES, ToolChoice, ToolMode, assistant_message, tool_call, tool_choice_of,
                                 tool_result)
from memrad.server.validate import MEDIA_PARTS, Notes, ParsedRequest, boolean, common, name_field, object_body

INPUT_ROLES = ("user", "system", "developer", "assistant")


def new_response_id() -> str:
    return "resp_" + secrets.token_hex(12)


@dataclass(frozen=True, slots=True)
class ResponsesRequest:
    """A validated Responses body: the internal request plus what the response echoes."""

    parsed: ParsedRequest
    history: tuple[dict, ...]  # the conversation without this request's instructions
    instructions: str | None
    previous_response_id: str | None
    store: bool
    echo: dict  # tools, tool_choice, … as the client sent them, for the response object
    tools: ResponsesTools = ResponsesTools(None)  # what the reply's calls map back to


def parse_responses(body: Any, header_session_id: str | None,
                    lookup: Callable[[str], StoredResponse | None]) -> ResponsesRequest:
    body = object_body(body)
    for key in ("background", "conversation", "prompt"):
        if body.get(key) not in (None, False):
            raise invalid(f"{key} is not supported by memrad's Responses API", key)
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise invalid("instructions must be a string", "instructions")
    previous = name_field(body.get("previous_response_id"), "previous_response_id")
    stored = None
    if previous is not None:
        stored = lookup(previous)
        if stored is None:
            raise invalid(f"previous_response_id {shown(previous)} is unknown: memrad keeps its recent responses in "
                          "memory only (lost on restart, oldest dropped first); send the whole conversation "
                          "as input instead", "previous_response_id")
    notes = Notes()
    history = (stored.messages if stored else ()) + tuple(input_messages(body.get("input"), notes))
    messages = ((({"role": "system", "content": instructions},) if instructions else ()) + history)
    kinds = responses_tools(body.get("tools"))
    tools = kinds.tools
    if kinds.left_out:
        notes.add(f"built-in tools this model cannot run were left out: {', '.join(kinds.left_out)}")
    for key in ("text", "metadata"):
        if body.get(key) is not None and not isinstance(body[key], dict):
            raise invalid(f"{key} must be an object", key)
    text_format = (body.get("text") or {}).get("format")
    fields = common({**body, "stream_options": None}, header_session_id, max_tokens_keys=("max_output_tokens",))
    fields["sampling"] = replace(fields["sampling"], constraint=responses_text_format(text_format),
                                 logprobs=responses_logprobs(body))
    if fields["identity"] is None or fields["identity"].source == "x-session-id":
        # The conversation a previous response ran under names this one, unless the body names one.
        if stored is not None and stored.identity is not None:
            fields["identity"] = Identity(stored.identity.name, "previous_response_id")
    parallel = boolean(body, "parallel_tool_calls")
    store = boolean(body, "store")
    parsed = ParsedRequest(messages=messages, tools=tools, tool_choice=responses_tool_choice(body.get("tool_choice"),
                                                                                               tools),
                           parallel_tool_calls=parallel is not False, notes=notes.items(), **fields)
    echo = {"instructions": instructions, "tools": body.get("tools") or [],
            "tool_choice": body.get("tool_choice") or "auto", "parallel_tool_calls": parallel is not False,
            "temperature": body.get("temperature", 1.0), "top_p": body.get("top_p", 1.0),
            "max_output_tokens": body.get("max_output_tokens"), "previous_response_id": previous,
            "metadata": body.get("metadata") or {}, "store": store is not False,
            "text": {"format": text_format or {"type": "text"}}, "truncation": "disabled"}
    return ResponsesRequest(parsed, history, instructions, previous, store is not False, echo, kinds)


def input_messages(value: Any, notes: Notes) -> list[dict]:
    """`input` (a string or an array of items) -> internal messages."""
    if isinstance(value, str):
        if not value:
            raise invalid("input must not be empty", "input")
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise invalid("input is required: a string or a non-empty array of input items", "input")
    out: list[dict] = []
    turn: dict | None = None  # the assistant turn being assembled from consecutive items

    def assistant() -> dict:
        nonlocal turn
        if turn is None:
            turn = assistant_message("")
            out.append(turn)
        return turn

    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise invalid(f"{where} must be an input item object", where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in INPUT_ROLES:
                raise invalid(f"{where}.role must be one of {', '.join(INPUT_ROLES)}; got {shown(role)}", f"{where}.role")
            text = _text(item.get("content"), f"{where}.content", notes)
            if role == "assistant":
                current = assistant()
                current["content"] = current["content"] + text
                if current.get("tool_calls"):
                    turn = None  # text after a call starts a new turn
                continue
            turn = None
            out.append({"role": "system" if role == "developer" else role, "content": text})
        elif kind == "reasoning":
            current = assistant()
            if current["content"] or current.get("tool_calls"):
                turn = None
                current = assistant()
            text = _reasoning_text(item, where)
            if text:
                current["reasoning_content"] = current.get("reasoning_content", "") + text
        elif kind in ("function_call", "custom_tool_call"):
            # A custom call renders as the one-string function it was offered as (responses_tools).
            arguments = item.get("arguments", "{}") if kind == "function_call" else {CUSTOM_INPUT: _input(item, where)}
            calls = assistant().setdefault("tool_calls", [])
            calls.append(tool_call(item.get("call_id"), item.get("name"), arguments, where))
        elif kind in ("function_call_output", "custom_tool_call_output"):
            turn = None
            out.append(tool_result(item.get("call_id"), _text(item.get("output"), f"{where}.output", notes), where))
        elif isinstance(kind, str):
            # Built-in tool calls (web_search_call, …), item references, compaction items: nothing
            # a local model's template can write. Skipped the same way every time.
            notes.add(f"input items of type {shown(kind)} were skipped: memrad renders message, reasoning, "
                      "function_call, custom_tool_call and their outputs")
        else:
            raise invalid(f"{where}.type must be a string", f"{where}.type")
    return out


def _input(item: dict, where: str) -> str:
    value = item.get("input")
    if not isinstance(value, str):
        raise invalid(f"{where}.input must be a string: a custom tool call's whole input", f"{where}.input")
    return value


def _text(content: Any, where: str, notes: Notes) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in MEDIA_PARTS:
                texts.append(notes.placeholder(MEDIA_PARTS[kind]))
                continue
            if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
                raise invalid(f"{where}[{j}] must be a text part ({{\"type\": \"input_text\", \"text\": ...}}): "
                              "this model accepts text only", f"{where}[{j}]")
            texts.append(part["text"])
        return "\n".join(texts)
    raise invalid(f"{where} must be a string or an array of text parts", where)


def _reasoning_text(item: dict, where: str) -> str:
    """A reasoning item's text: its reasoning_text content, else its summary."""
    for key in ("content", "summary"):
        parts = item.get(key)
        if parts:
            if not isinstance(parts, list) or not all(isinstance(p, dict) and isinstance(p.get("text"), str)
                                                      for p in parts):
                raise invalid(f"{where}.{key} must be an array of text parts", f"{where}.{key}")
            return "\n".join(p["text"] for p in parts)
    return ""


def responses_tool_choice(value: Any, tools: tuple[dict, ...] | None) -> ToolChoice:
    """"auto" | "none" | "required" | {"type": "function", "name"}."""
    return tool_choice_of(value, tools, _named_choice, '"auto", "none", "required" or {"type": "function", '
                          '"name": ...}', OPENAI_MODES)


def _named_choice(value: dict) -> tuple[ToolMode, Any] | None:
    return ("function", value.get("name")) if value.get("type") in ("function", "custom") else None


def usage(c: Completion) -> dict:
    return {"input_tokens": c.prompt_tokens, "input_tokens_details": {"cached_tokens": c.cached_tokens},
            "output_tokens": c.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": c.total_tokens}


def _reasoning_item(item_id: str, text: str, status: str) -> dict:
    # encrypted_content null: Codex re-sends a reasoning item verbatim, content included.
    return {"type": "reasoning", "id": item_id, "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}], "encrypted_content": None}


def _message_item(item_id: str, text: str, status: str) -> dict:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if status == "completed" \
        else []
    return {"type": "message", "id": item_id, "role": "assistant", "status": status, "content": content}


@dataclass
class ResponsesShape:
    """The response object and its event stream. Mutable: it numbers events and tracks the
    output item being streamed."""

    request: ResponsesRequest
    response_id: str
    model: str
    created_at: int = field(default_factory=lambda: int(time.time()))
    notes: tuple[str, ...] = ()  # for the `memra` field (validate.Notes)
    decision: Decision | None = None
    items: list[dict] = field(default_factory=list)  # finished output items
    _open: dict | None = None  # the reasoning or message item being streamed
    _calls: list[ToolCall] = field(default_factory=list)  # calls held back until the text items close
    _text: str = ""
    _seq: int = 0
    # Token records not yet on an output_text.delta (a reasoning item's, a held call's: the
    # whole response puts every generated token's on the message's text part), and those sent
    # on the open message item's deltas (its done events repeat them).
    _logprobs: list[TokenLogprob] = field(default_factory=list)
    _item_logprobs: list[TokenLogprob] = field(default_factory=list)

    def _event(self, kind: str, **data: Any) -> Event:
        self._seq += 1
        return kind, {"type": kind, "sequence_number": self._seq - 1, **data}

    def response(self, status: str, c: Completion | None = None) -> dict:
        incomplete = c is not None and c.finish_reason == "length"
        return {"id": self.response_id, "object": "response", "created_at": self.created_at, "model": self.model,
                "status": "incomplete" if incomplete else status, "output": list(self.items),
                "usage": usage(c) if c is not None else None, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
                **self.request.echo,
                **decision_field(self.decision, self.notes, c.speculation if c is not None else None)}

    def opening(self, decision: Decision | None) -> list[Event]:
        self.decision = decision
        snapshot = self.response("in_progress")
        return [self._event("response.created", response=snapshot),
                self._event("response.in_progress", response=snapshot)]

    def _start(self, kind: str) -> list[Event]:
        events = self._close()
        index = len(self.items)
        if kind == "reasoning":
            self._open = _reasoning_item("rs_" + secrets.token_hex(12), "", "in_progress")
            part = {"type": "reasoning_text", "text": ""}
        else:
            self._open = _message_item("msg_" + secrets.token_hex(12), "", "in_progress")
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        self._text = ""
        self._item_logprobs = []
        return events + [self._event("response.output_item.added", output_index=index, item=self._open),
                         self._event("response.content_part.added", item_id=self._open["id"], output_index=index,
                                     content_index=0, part=part)]

    def _close(self) -> list[Event]:
        if self._open is None:
            return []
        item, text, index = self._open, self._text, len(self.items)
        if item["type"] == "reasoning":
            done = _reasoning_item(item["id"], text, "completed")
            events = [self._event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                  content_index=0, text=text)]
        else:
            done = _message_item(item["id"], text, "completed")
            entries = logprob_entries(tuple(self._item_logprobs))
            done["content"][0]["logprobs"] = entries
            events = [self._event("response.output_text.done", item_id=item["id"], output_index=index,
                                  content_index=0, text=text, logprobs=entries)]
        events += [self._event("response.content_part.done", item_id=item["id"], output_index=index,
                               content_index=0, part=done["content"][0]),
                   self._event("response.output_item.done", output_index=index, item=done)]
        self.items.append(done)
        self._open = None
        return events

    def deltas(self, delta: ReplyDelta, logprobs: tuple[TokenLogprob, ...] = ()) -> list[Event]:
        self._logprobs += logprobs
        if delta.kind == "tool_call":
            # Held back: calls follow the reasoning and message items (OpenAI's order, and the
            # order of a whole response), even where the model writes text after a call.
            assert delta.call is not None
            self._calls.append(delta.call)
            return []
        events = [] if self._open is not None and self._open["type"] == _ITEM[delta.kind] else self._start(
            delta.kind)
        assert self._open is not None
        self._text += delta.text
        kind = "response.reasoning_text.delta" if delta.kind == "reasoning" else "response.output_text.delta"
        extra = {} if delta.kind == "reasoning" else {"logprobs": self._take_logprobs()}
        return events + [self._event(kind, item_id=self._open["id"], output_index=len(self.items), content_index=0,
                                     delta=delta.text, **extra)]

    def _call_events(self) -> list[Event]:
        events: list[Event] = []
        for call in self._calls:
            index, tools = len(self.items), self.request.tools
            item_id = ("ctc_" if call.name in tools.custom else "fc_") + secrets.token_hex(12)
            done = call_item(tools, item_id, call, "completed", done=True)
            events.append(self._event("response.output_item.added", output_index=index,
                                      item=call_item(tools, item_id, call, "in_progress", done=False)))
            if done["type"] == "custom_tool_call":
                events += [self._event("response.custom_tool_call_input.delta", item_id=item_id, output_index=index,
                                       delta=done["input"]),
                           self._event("response.custom_tool_call_input.done", item_id=item_id, output_index=index,
                                       input=done["input"])]
            else:
                events += [self._event("response.function_call_arguments.delta", item_id=item_id, output_index=index,
                                       delta=call.arguments),
                           self._event("response.function_call_arguments.done", item_id=item_id, output_index=index,
                                       name=call.name, arguments=call.arguments)]
            events.append(self._event("response.output_item.done", output_index=index, item=done))
            self.items.append(done)
        self._calls = []
        return events

    def _take_logprobs(self) -> list[dict]:
        taken, self._logprobs = self._logprobs, []
        self._item_logprobs += taken
        return logprob_entries(tuple(taken))

    def closing(self, reply: Reply, c: Completion, logprobs: tuple[TokenLogprob, ...] = ()) -> list[Event]:
        self._logprobs += logprobs
        events: list[Event] = []
        if self._logprobs and self._open is not None and self._open["type"] == "message":
            # Tokens after the last text (a stop string's, a call's) on one last, empty delta.
            events.append(self._event("response.output_text.delta", item_id=self._open["id"],
                                      output_index=len(self.items), content_index=0, delta="",
                                      logprobs=self._take_logprobs()))
        events += self._close() + self._call_events()
        final = self.response("completed", c)
        kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        return events + [self._event(kind, response=final)]

    def whole(self, reply: Reply, c: Completion, decision: Decision | None) -> dict:
        self.decision = decision
        for kind, text in (("reasoning", reply.reasoning), ("content", reply.content)):
            if text:
                self.deltas(ReplyDelta(kind, text))  # type: ignore[arg-type]
        self._close()
        self._calls = list(reply.tool_calls)
        self._call_events()
        response = self.response("completed", c)
        if c.logprobs is not None:  # every generated token's, on the reply's text part
            for part in (p for item in response["output"] if item["type"] == "message" for p in item["content"]):
                part["logprobs"] = logprob_entries(c.logprobs)
        return response

    def keepalive(self) -> list[Event]:
        """`response.in_progress` again: Codex CLI's stream_idle_timeout waits for the next
        SSE *event* (comments never reach it), and skips event types it does not act on."""
        return [self._event("response.in_progress", response=self.response("in_progress"))]

    def stream_error(self, body: dict) -> list[Event]:
        """An `error` event, then `response.failed`: Codex acts on the latter's error.code
        (context_length_exceeded is final; anything else is retried)."""
        error = body.get("error", {})
        failed = {**self.response("failed"), "error": {"code": error.get("code"), "message": error.get("message")}}
        return [self._event("error", code=error.get("code"), message=error.get("message"), param=error.get("param")),
                self._event("response.failed", response=failed)]


_ITEM = {"reasoning": "reasoning", "content": "message"}


def remembered(request: ResponsesRequest, response_id: str, reply: Reply) -> StoredResponse:
    """What a follow-up naming this response resolves to: its conversation and its identity."""
    calls = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
             for c in reply.tool_calls]
    turn = assistant_message(reply.content, calls, reply.reasoning)
    return StoredResponse(response_id, request.history + (turn,), request.parsed.identity)
