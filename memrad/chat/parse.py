"""Generated text -> reasoning, content and tool-call deltas, as the text streams.

transformers' ResponseParser (5.24, driven by a `response_template`) does the region work:
it finds `<think>`, `<tool_call>`, … holding back bytes that could still become a delimiter,
and emits region open / chunk / close events. Around it memra adds what an API needs:

    text deltas -> [markup holdback] -> ResponseParser -> [per-region trim] -> ReplyDelta
                    a suffix that may       regions        leading / trailing
                    start a tag waits;      and JSON       whitespace of a region
                    at the end it is        bodies         never reaches a client
                    dropped (a cut reply
                    never shows `<tool_`)

Text regions stream as they arrive; a tool call is emitted whole when its region closes
(name and arguments together, arguments as JSON text). A tool body that is not a call
(malformed JSON, no name) becomes content, with a logged warning, never an error.
The whole-reply parse is the same parser fed once, so streamed and whole always agree.
"""

from __future__ import annotations

import copy
import json
import logging
from typing import Any

from memrad.chat.format import ChatFormat
from memrad.chat.stops import longest_partial_suffix
from memrad.chat.reply import Reply, ReplyBuilder, ReplyDelta, ToolCall, new_call_id, plain_reply_deltas

log = logging.getLogger("memrad.chat.reply")

# Region names -> delta kinds; "thinking" is what some shipped response templates call reasoning.
TEXT_FIELDS = {"content": "content", "reasoning_content": "reasoning", "thinking": "reasoning"}


class _Trim:
    """Strips each region's leading and trailing whitespace as it streams; regions of one
    kind after the first are joined by a newline."""

    def __init__(self) -> None:
        self.started = False
        self.pending = ""
        self.any = False  # some earlier region of this kind had text

    def open(self) -> None:
        self.started, self.pending = False, ""

    def chunk(self, text: str) -> str:
        if not self.started:
            text = text.lstrip()
            if not text:
                return ""
            self.started = True
            if self.any:
                text = "\n" + text
            self.any = True
        text = self.pending + text
        body = text.rstrip()
        self.pending = text[len(body):]
        return body


class ReplyParser:
    """Feed generated text; get ReplyDeltas. Mutates its own state only."""

    def __init__(self, fmt: ChatFormat, prompt_text: str, parse_tools: bool,
                 tool_names: frozenset[str] | None = None) -> None:
        from transformers.utils.chat_parsing import ResponseParser

        self._tool_names = tool_names  # None: any name; else a call naming another tool is content

        self._parser = None  # no reply format known: every byte is content
        self._held = ""
        if fmt.response_template is None:
            return
        template = copy.deepcopy(fmt.response_template)
        if not parse_tools:
            template["fields"].pop("tool_calls", None)
        for spec in template["fields"].values():
            if spec.get("content") == "json":  # a malformed body comes back as text, never raises
                spec["content_args"] = {**spec.get("content_args", {}), "allow_non_json": True}
        self._markup = fmt.markup if parse_tools else tuple(m for m in fmt.markup if "think" in m)
        self._parser = ResponseParser(template, prefix=prompt_text)
        self._trims = {kind: _Trim() for kind in TEXT_FIELDS.values()}
        self._tool_body: list[str] = []
        self._num_calls = 0

    def feed(self, text: str) -> list[ReplyDelta]:
        if self._parser is None:
            return plain_reply_deltas(text)
        text = self._held + text
        keep = longest_partial_suffix(text, self._markup)
        self._held = text[len(text) - keep:] if keep else ""
        try:
            return self._events(self._parser.feed(text[: len(text) - keep]))
        except (ValueError, KeyError) as exc:  # a shipped template's transform that does not fit
            return self._give_up(exc, text[: len(text) - keep])

    def finish(self) -> list[ReplyDelta]:
        """End of the reply (eos, max_tokens, stop string): a held partial tag is dropped."""
        if self._parser is None:
            return []
        self._held = ""
        try:
            _, events = self._parser.finalize()
            return self._events(events)
        except (ValueError, KeyError) as exc:
            return self._give_up(exc, "")

    def _give_up(self, exc: Exception, text: str) -> list[ReplyDelta]:
        """The reply format broke mid-reply: the rest of the reply, as written, is content."""
        log.warning("reply parsing failed (%s); the rest of the reply is returned as content", exc)
        self._parser = None
        raw = "".join(self._tool_body) + text
        for tag in self._markup:
            raw = raw.replace(tag, "")
        return plain_reply_deltas(raw)

    def _events(self, events: list[dict]) -> list[ReplyDelta]:
        out: list[ReplyDelta] = []
        for event in events:
            field, kind = event["field"], event["type"]
            text_kind = TEXT_FIELDS.get(field)
            if text_kind is not None:
                if kind == "region_open":
                    self._trims[text_kind].open()
                elif kind == "region_chunk":
                    text = self._trims[text_kind].chunk(event["text"])
                    if text:
                        out.append(ReplyDelta(text_kind, text))
            elif field == "tool_calls":
                if kind == "region_open":
                    self._tool_body = []
                elif kind == "region_chunk":
                    self._tool_body.append(event["text"])
                else:
                    out.extend(self._calls(event["value"]))
        return out

    def _calls(self, value: Any) -> list[ReplyDelta]:
        items = value if isinstance(value, list) else [value]
        calls = [_call(item) for item in items]
        unknown = self._tool_names is not None and any(c is not None and c[0] not in self._tool_names for c in calls)
        if not items or unknown or any(c is None for c in calls):
            # A body that is no JSON comes back as the string it is, from the region's opening on,
            # so a forced call cut short keeps the opening memrad wrote into the prompt.
            raw = ("\n".join(json.dumps(item, ensure_ascii=False) for item in items) if unknown and None not in calls
                   else value.strip() if isinstance(value, str) else "".join(self._tool_body).strip())
            log.warning("the model wrote a tool call that does not parse or names a tool it was not given (%r); "
                        "returned as content", raw[:200])
            trim = self._trims["content"]
            trim.open()
            text = trim.chunk(raw)
            return [ReplyDelta("content", text)] if text else []
        out = []
        for name, arguments in calls:
            out.append(ReplyDelta("tool_call", call=ToolCall(new_call_id(), name, arguments), index=self._num_calls))
            self._num_calls += 1
        return out


def _call(item: Any) -> tuple[str, str] | None:
    """(name, arguments JSON text) of one parsed call, or None if it is not a call. Accepts
    {"name", "arguments" | "parameters"} and the wrapped {"type": "function", "function": {…}}
    that shipped response templates produce."""
    if isinstance(item, dict) and isinstance(item.get("function"), dict):
        item = item["function"]
    if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not item["name"]:
        return None
    arguments = item.get("arguments", item.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return item["name"], json.dumps(arguments, ensure_ascii=False)


def parse_reply(fmt: ChatFormat, prompt_text: str, text: str, parse_tools: bool = True,
                tool_names: frozenset[str] | None = None) -> Reply:
    """The whole reply at once: the streaming parser fed one chunk."""
    parser = ReplyParser(fmt, prompt_text, parse_tools, tool_names)
    builder = ReplyBuilder()
    builder.extend(parser.feed(text))
    builder.extend(parser.finish())
    return builder.reply()
