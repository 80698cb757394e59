"""The one internal request (ParsedRequest) and the field validators the three APIs share.

Each API's adapter (chat_api, responses_api, messages_api) parses its body into a
ParsedRequest with these. Pure: no engine, no aiohttp. Every rejection names the field
(`param`) and says what a valid value looks like.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from memrad.request import Identity, SamplingParams
from memrad.server.decoding import chat_logprobs, chat_response_format, sampling_fields
from memrad.server.errors import invalid
from memrad.server.tools import ToolChoice

MAX_NAME_CHARS = 256
MAX_STOPS = 4  # OpenAI's `stop`
# Anthropic's `stop_sequences` has no small limit (Claude Code's SDK sends more than 4);
# memrad bounds it only so the stop matcher's work per token stays small.
MAX_STOP_SEQUENCES = 32
# What a text model sees in place of an image, a file or a document block.
PLACEHOLDERS = {"image": "[image omitted: this model reads text only]",
                "file": "[file omitted: this model reads text only]",
                "document": "[document omitted: this model reads text only]"}


class Notes:
    """What memrad changed or left out of a request, said in the reply's `memra` field.
    Ordered and without repeats, so the same request always carries the same notes."""

    def __init__(self) -> None:
        self._items: dict[str, None] = {}

    def add(self, text: str) -> None:
        self._items.setdefault(text, None)

    def placeholder(self, kind: str) -> str:
        """The placeholder text for a `kind` part ("image", "file", "document"), noting it."""
        self.add(f"{kind} parts were replaced by the text {PLACEHOLDERS[kind]!r}")
        return PLACEHOLDERS[kind]

    def items(self) -> tuple[str, ...]:
        return tuple(self._items)


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    """A validated body, before tokenization: the one internal request of all three APIs.

    Exactly one of messages / prompt is set. Messages and tools are in OpenAI Chat's shape
    (memrad.server.tools), whichever API the request came through.
    """

    model: str | None
    sampling: SamplingParams
    stream: bool
    include_usage: bool
    identity: Identity | None
    cache_salt: str | None
    messages: tuple[dict, ...] | None = None
    tools: tuple[dict, ...] | None = None
    prompt: str | tuple[int, ...] | None = None
    tool_choice: ToolChoice = ToolChoice()
    parallel_tool_calls: bool = True
    notes: tuple[str, ...] = ()  # what memrad left out or changed (Notes), for the `memra` field

    @property
    def parse_tools(self) -> bool:
        """Whether the reply is parsed for tool calls (tools listed and not tool_choice none)."""
        return bool(self.tools) and self.tool_choice.mode != "none"


def object_body(body: Any) -> dict:
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    return body


def common(body: dict, header_session_id: str | None, max_tokens_keys: tuple[str, ...]) -> dict:
    """The fields every OpenAI-shaped body shares (sampling, stream, identity, salt)."""
    n = integer(body, "n", minimum=1)
    if n not in (None, 1):
        raise invalid("n must be 1: memrad generates one choice per request", "n")
    stream = boolean(body, "stream") or False
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise invalid("stream_options must be an object like {\"include_usage\": true}", "stream_options")
    include_usage = boolean(options or {}, "include_usage", "stream_options.include_usage") or False
    model = body.get("model")
    if model is not None and (not isinstance(model, str) or not model):
        raise invalid("model must be a non-empty string", "model")
    max_tokens = None
    for key in max_tokens_keys:
        value = integer(body, key, minimum=1)
        if value is not None:
            max_tokens = value
            break
    temperature = number(body, "temperature", 0.0, 2.0)
    top_p = number(body, "top_p", 0.0, 1.0)
    if top_p == 0.0:
        raise invalid("top_p must be greater than 0 and at most 1", "top_p")
    sampling = SamplingParams(
        temperature=1.0 if temperature is None else float(temperature),
        top_p=1.0 if top_p is None else float(top_p),
        seed=integer(body, "seed"),
        max_tokens=max_tokens,
        stop=stops(body.get("stop")),
        constraint=chat_response_format(body.get("response_format")),
        logprobs=chat_logprobs(body),
        **sampling_fields(body),
    )
    return dict(model=model, sampling=sampling, stream=stream, include_usage=include_usage,
                identity=identity_of(body, header_session_id),
                cache_salt=name_field(body.get("cache_salt"), "cache_salt"))


def identity_of(body: dict, header_session_id: str | None,
                keys: tuple[str, ...] = ("session_id", "prompt_cache_key", "user")) -> Identity | None:
    """The first of `keys` the body sets, else header `x-session-id`: the body beats the header.

    OpenAI bodies: session_id > prompt_cache_key > user (the cache key names a conversation;
    `user` may name a person across many). Dotted keys read nested objects (metadata.user_id).
    """
    for key in keys:
        value: Any = body
        for part in key.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        if key == "metadata.user_id":
            value = claude_session_id(value)
        name = name_field(value, key)
        if name is not None:
            return Identity(name, key)  # type: ignore[arg-type]
    name = name_field(header_session_id, "x-session-id")
    return Identity(name, "x-session-id") if name is not None else None


def claude_session_id(user_id: Any) -> Any:
    """Claude Code's `metadata.user_id` is a JSON string {"device_id", "account_uuid",
    "session_id"}: its session_id names the conversation (the device id names a machine).
    Any other value is the name as sent."""
    if isinstance(user_id, str) and user_id.startswith("{"):
        try:
            held = json.loads(user_id)
        except json.JSONDecodeError:
            return user_id
        if isinstance(held, dict) and isinstance(held.get("session_id"), str) and held["session_id"]:
            return held["session_id"]
    return user_id


def name_field(value: Any, param: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value or len(value) > MAX_NAME_CHARS:
        raise invalid(f"{param} must be a non-empty string of at most {MAX_NAME_CHARS} characters", param)
    return value


def joined_text(content: Any, where: str, noun: str = "part", notes: Notes | None = None) -> str:
    """A string, or text parts (`noun`: "part" in OpenAI's APIs, "block" in Anthropic's)
    joined by newlines; anything else is a 400 naming `where`. With `notes`, image, file
    and document parts become placeholder text (noted) instead of a 400."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            elif notes is not None and kind in MEDIA_PARTS:
                texts.append(notes.placeholder(MEDIA_PARTS[kind]))
            else:
                raise invalid(f"{where}[{j}] must be a text {noun} {{\"type\": \"text\", \"text\": ...}}: "
                              "this model accepts text only", f"{where}[{j}]")
        return "\n".join(texts)
    raise invalid(f"{where} must be a string or an array of text {noun}s", where)


# Non-text parts of every API, by the placeholder they get.
MEDIA_PARTS = {"image_url": "image", "input_image": "image", "image": "image", "input_audio": "file",
               "file": "file", "input_file": "file", "document": "document"}


# Field validators, shared by the three APIs: each returns None (or ()) for an absent field
# and raises a 400 naming the field, saying what a valid value looks like.

def unsupported(body: dict, key: str, allowed: tuple, message: str) -> None:
    if body.get(key) not in allowed:
        raise invalid(message, key)


def boolean(body: dict, key: str, param: str | None = None) -> bool | None:
    value = body.get(key)
    if value is not None and not isinstance(value, bool):
        raise invalid(f"{param or key} must be true or false", param or key)
    return value


def integer(body: dict, key: str, minimum: int | None = None) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise invalid(f"{key} must be an integer", key)
    if minimum is not None and value < minimum:
        raise invalid(f"{key} must be at least {minimum}; got {value}", key)
    return value


def number(body: dict, key: str, lo: float, hi: float, *, quote_value: bool = True) -> float | None:
    """A number in [lo, hi]. `quote_value`: an out-of-range value is quoted back (the OpenAI
    APIs); Anthropic's Messages answers a wrong type and a wrong range alike."""
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise invalid(f"{key} must be a number between {lo:g} and {hi:g}", key)
    if not lo <= value <= hi:
        raise invalid(f"{key} must be between {lo:g} and {hi:g}; got {value}" if quote_value
                      else f"{key} must be a number between {lo:g} and {hi:g}", key)
    return value


def stops(value: Any, param: str = "stop", *, one_string: bool = True, limit: int = MAX_STOPS) -> tuple[str, ...]:
    """At most `limit` non-empty stop strings. `one_string`: a bare string is one stop
    (OpenAI's `stop`); Anthropic's `stop_sequences` takes an array only."""
    if value is None:
        return ()
    if one_string and isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or len(value) > limit or not all(isinstance(s, str) and s for s in value):
        shape = (f"a non-empty string or an array of at most {limit} of them" if one_string
                 else f"an array of at most {limit} non-empty strings")
        raise invalid(f"{param} must be {shape}", param)
    return tuple(value)
