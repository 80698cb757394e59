"""Limits that keep one request from hurting the others. Pure: body in, APIError out.

Checked on the raw JSON body before validation, for every API at once, so each limit is
written once whatever the field is called there (OpenAI `stop`, Anthropic
`stop_sequences`; `max_tokens`, `max_completion_tokens`, `max_output_tokens`). The body
size is aiohttp's `client_max_size` (413); the prompt-vs-context check needs the tokenizer
and stays with the route; `n` and `logprobs` are refused by validation.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from memrad.chat.schema_cost import costly_part
from memrad.config import LimitSettings
from memrad.server.errors import APIError, invalid
from memrad.server.validate import MAX_STOP_SEQUENCES, MAX_STOPS
# Levels of the body around a tool's schema (body > tools > [i] > function > parameters):
# the body may nest this much deeper than a schema.
ENVELOPE_DEPTH = 8
MAX_TOKENS_KEYS = ("max_tokens", "max_completion_tokens", "max_output_tokens")
STOP_KEYS = {"stop": MAX_STOPS, "stop_sequences": MAX_STOP_SEQUENCES}  # key -> most strings
MESSAGE_KEYS = ("messages", "input")
# Where each API's output format holds its schema (Chat, Responses, Messages, Messages' beta).
FORMAT_KEYS = ("response_format", "text", "output_config", "output_format")
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed accepts
SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # a "\ud83d"-style escape in the raw body


@dataclass(frozen=True, slots=True)
class Limits:
    max_body_bytes: int
    max_messages: int
    max_tokens: int | None  # None: only the context length bounds it (checked by the route)
    max_stop_chars: int
    max_schema_depth: int

    @classmethod
    def from_settings(cls, limits: LimitSettings) -> "Limits":
        return cls(limits.max_body_bytes, limits.max_messages, limits.max_tokens or None,
                   limits.max_stop_chars, limits.max_schema_depth)


def too_large(limits: Limits) -> APIError:
    return APIError(413, f"the request body is larger than {limits.max_body_bytes} bytes "
                    "(limits.max_body_bytes, MEMRA_MAX_BODY_BYTES)", param="body", code="body_too_large")


def parse_body(raw: bytes, limits: Limits) -> Any:
    """JSON, or a 400 that says why. Deep nesting is refused, never a RecursionError (500)."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise invalid(f"the request body is not valid JSON ({exc}); send a JSON object") from None
    except RecursionError:
        raise invalid("the request body nests too deeply to parse", "body", code="too_deep") from None
    if depth(body, limits.max_schema_depth + ENVELOPE_DEPTH) > limits.max_schema_depth + ENVELOPE_DEPTH:
        raise invalid(f"the request body nests more than {limits.max_schema_depth + ENVELOPE_DEPTH} levels "
                      "of objects and arrays", "body", code="too_deep")
    if SURROGATE_ESCAPE.search(raw) and not _is_unicode(body):
        # json accepts "\ud800" alone; tokenizers then fail (found by the fuzzer: a 500).
        raise invalid("the request body holds a lone UTF-16 surrogate escape (\\ud800-\\udfff without its "
                      "pair): strings must be valid Unicode text", "body", code="invalid_unicode")
    return body


def _is_unicode(body: Any) -> bool:
    """False if any string holds a lone surrogate (pairs in escapes decode to one character)."""
    try:
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def depth(value: Any, stop_after: int) -> int:
    """Levels of dict/list nesting (a scalar is 0); stops counting past `stop_after`. Iterative."""
    deepest, frontier, level = 0, [value], 0
    while frontier and level <= stop_after:
        children = []
        for item in frontier:
            if isinstance(item, dict):
                children.extend(item.values())
            elif isinstance(item, list):
                children.extend(item)
            else:
                continue
            deepest = level + 1
        frontier, level = children, level + 1
    return deepest


def check_body(body: Any, limits: Limits) -> None:
    """Raise a 400 naming the first field over a limit. Malformed fields are validation's job."""
    if not isinstance(body, dict):
        return
    for key in MESSAGE_KEYS:
        items = body.get(key)
        if isinstance(items, list) and len(items) > limits.max_messages:
            raise invalid(f"{key} has {len(items)} items; at most {limits.max_messages} are accepted "
                          "(limits.max_messages)", key, code="too_many_messages")
    for key in MAX_TOKENS_KEYS:
        value = body.get(key)
        if (limits.max_tokens is not None and isinstance(value, int) and not isinstance(value, bool)
                and value > limits.max_tokens):
            raise invalid(f"{key} is {value}; this server generates at most {limits.max_tokens} tokens per "
                          "request (limits.max_tokens)", key, code="max_tokens_too_large")
    for key, most in STOP_KEYS.items():
        _check_stops(body.get(key), key, most, limits)
    seed = body.get("seed")
    if isinstance(seed, int) and not isinstance(seed, bool) and not SEED_RANGE[0] <= seed <= SEED_RANGE[1]:
        raise invalid(f"seed must be between {SEED_RANGE[0]} and {SEED_RANGE[1]}; got {seed}", "seed")
    tools = body.get("tools")
    if isinstance(tools, list):
        for i, tool in enumerate(tools):
            if depth(tool, limits.max_schema_depth) > limits.max_schema_depth:
                raise invalid(f"tools[{i}] nests more than {limits.max_schema_depth} levels of objects and "
                              "arrays (limits.max_schema_depth)", f"tools[{i}]", code="schema_too_deep")
            _check_cost(tool, f"tools[{i}]")
    for key in FORMAT_KEYS:
        if isinstance(body.get(key), dict):
            _check_cost(body[key], key)


def _check_cost(value: Any, param: str) -> None:
    """A schema whose grammar would cost too much to compile or to run is a 400 naming its
    part (memrad.chat.schema_cost), before anything is compiled."""
    problem = costly_part(value, param)
    if problem is not None:
        raise invalid(f"{problem}: its grammar would cost too much to compile (limits on JSON schemas: "
                      "docs/SERVING.md, Structured outputs)", param, code="schema_too_costly")


def _check_stops(value: Any, key: str, most: int, limits: Limits) -> None:
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list):
        return
    if len(stops) > most:
        raise invalid(f"{key} has {len(stops)} strings; at most {most} are accepted", key, code="too_many_stops")
    for i, stop in enumerate(stops):
        if isinstance(stop, str) and len(stop) > limits.max_stop_chars:
            raise invalid(f"{key} string {i} is {len(stop)} characters; at most {limits.max_stop_chars} are accepted "
                          "(limits.max_stop_chars)", key if isinstance(value, str) else f"{key}[{i}]",
                          code="stop_too_long")


LIMITS = web.AppKey("limits", Limits)
