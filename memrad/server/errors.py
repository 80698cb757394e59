"""Errors a client can hit, in the error shape of the API it called.

One APIError, rendered per API style:

    openai     {"error": {"message", "type", "param", "code"}}        (Chat, Completions, Responses)
    anthropic  {"type": "error", "error": {"type", "message"}}        (/v1/messages…)

`error_style(path)` picks the style by route, so middleware (auth, host checks, the catch-all)
answers every route in its own API's shape.
"""

from __future__ import annotations

import json
import reprlib
from typing import Literal

from aiohttp import web

ErrorStyle = Literal["openai", "anthropic"]

# Anthropic names errors by status, not by cause.
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                   503: "overloaded_error"}


def error_style(path: str) -> ErrorStyle:
    return "anthropic" if path.startswith("/v1/messages") else "openai"


class APIError(Exception):
    """An error a client can hit; the message says what to change."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self, style: ErrorStyle = "openai") -> dict:
        if style == "anthropic":
            kind = ANTHROPIC_TYPES.get(self.status, "api_error" if self.status >= 500 else "invalid_request_error")
            return {"type": "error", "error": {"type": kind, "message": self.message}}
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self, style: ErrorStyle = "openai") -> web.Response:
        return web.Response(status=self.status, text=json.dumps(self.body(style)),
                            content_type="application/json", headers=self.headers)


ECHO_CHARS = 80
_REPR = reprlib.Repr()  # bounded work and text for a long list, a deep object, a huge number
_REPR.maxstring, _REPR.maxlong, _REPR.maxother, _REPR.maxlevel = ECHO_CHARS, 40, ECHO_CHARS, 3


def shown(value: object, max_chars: int = ECHO_CHARS) -> str:
    """A client's value quoted back in an error or a note: its repr, cut to `max_chars` with
    its full length said (a 5 MB `role` must not make a 5 MB error body and log line)."""
    if isinstance(value, str):
        return repr(value) if len(value) <= max_chars else f"{value[:max_chars]!r}...({len(value)} chars)"
    text = _REPR.repr(value)
    return text if len(text) <= max_chars else f"{text[:max_chars]}..."


def invalid(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def server_error(message: str) -> APIError:
    return APIError(500, message, type="server_error", code="internal_error")


def unavailable(message: str) -> APIError:
    return APIError(503, message, type="server_error", code="service_unavailable")
