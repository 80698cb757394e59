"""GET /openapi.json: the API memrad serves, as an OpenAPI 3.1 document.

Generated from ROUTES, the one list of API routes (the fuzz tests and the auth tests read
it too, so a new route is one line here). Schemas describe the fields memrad reads; the
validators stay the authority (a body the schema allows may still get a 400).
"""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web

from memrad import __version__

_MESSAGE = {"type": "object", "required": ["role", "content"], "properties": {
    "role": {"enum": ["system", "developer", "user", "assistant", "tool"]},
    "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": {
        "type": "object", "required": ["type", "text"],
        "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}}]},
    "name": {"type": "string"}, "tool_call_id": {"type": "string"}}}
_STOP = {"oneOf": [{"type": "string"}, {"type": "array", "maxItems": 4, "items": {"type": "string"}}]}
_COMMON = {
    "model": {"type": "string"}, "stream": {"type": "boolean"},
    "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"}}},
    "max_tokens": {"type": "integer", "minimum": 1}, "temperature": {"type": "number", "minimum": 0, "maximum": 2},
    "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1}, "seed": {"type": "integer"},
    "stop": _STOP, "n": {"const": 1}, "user": {"type": "string"}, "session_id": {"type": "string"},
    "cache_salt": {"type": "string"},
}
CHAT = {"type": "object", "required": ["messages"], "properties": {
    **_COMMON, "messages": {"type": "array", "minItems": 1, "items": _MESSAGE},
    "max_completion_tokens": {"type": "integer", "minimum": 1},
    "tools": {"type": "array", "items": {"type": "object"}}}}
COMPLETION = {"type": "object", "required": ["prompt"], "properties": {
    **_COMMON, "prompt": {"oneOf": [{"type": "string", "minLength": 1},
                                    {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}]}}}
_TOOLS = {"type": "array", "items": {"type": "object"}}
RESPONSES = {"type": "object", "required": ["input"], "properties": {
    "model": {"type": "string"}, "input": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "object"}}]},
    "instructions": {"type": "string"}, "max_output_tokens": {"type": "integer", "minimum": 1},
    "temperature": {"type": "number"}, "top_p": {"type": "number"}, "stream": {"type": "boolean"},
    "tools": _TOOLS, "tool_choice": {}, "parallel_tool_calls": {"type": "boolean"}, "store": {"type": "boolean"},
    "previous_response_id": {"type": "string"}, "user": {"type": "string"}, "cache_salt": {"type": "string"},
    "metadata": {"type": "object"}}}
_ANTHROPIC_MESSAGE = {"type": "object", "required": ["role", "content"], "properties": {
    "role": {"enum": ["user", "assistant"]},
    "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "object"}}]}}}
MESSAGES = {"type": "object", "required": ["model", "max_tokens", "messages"], "properties": {
    "model": {"type": "string"}, "max_tokens": {"type": "integer", "minimum": 1},
    "messages": {"type": "array", "minItems": 1, "items": _ANTHROPIC_MESSAGE},
    "system": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "object"}}]},
    "stop_sequences": {"type": "array", "items": {"type": "string"}}, "stream": {"type": "boolean"},
    "temperature": {"type": "number"}, "top_p": {"type": "number"}, "tools": _TOOLS, "tool_choice": {"type": "object"},
    "metadata": {"type": "object", "properties": {"user_id": {"type": "string"}}}, "cache_salt": {"type": "string"}}}
COUNT_TOKENS = {**MESSAGES, "required": ["model", "messages"]}


@dataclass(frozen=True, slots=True)
class Route:
    method: str
    path: str
    summary: str
    body: dict | None = None   # the request body's JSON schema (POST routes)
    generates: bool = False    # runs the model (fuzzers keep these short)
    example: dict | None = None  # a small valid body (tests and fuzzers start from it)


ROUTES = (
    Route("POST", "/v1/chat/completions", "OpenAI Chat Completions", CHAT, True,
          {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 2}),
    Route("POST", "/v1/completions", "OpenAI text completions", COMPLETION, True,
          {"prompt": "def add(a, b):", "max_tokens": 2}),
    Route("POST", "/v1/responses", "OpenAI Responses", RESPONSES, True, {"input": "Say hi.", "max_output_tokens": 2}),
    Route("POST", "/v1/messages", "Anthropic Messages (Anthropic error envelope)", MESSAGES, True,
          {"model": "default", "max_tokens": 2, "messages": [{"role": "user", "content": "Say hi."}]}),
    Route("POST", "/v1/messages/count_tokens", "Anthropic token counting", COUNT_TOKENS, False,
          {"model": "default", "messages": [{"role": "user", "content": "Say hi."}]}),
    Route("GET", "/v1/models", "The served model"),
    Route("GET", "/metrics", "Prometheus metrics (text format)"),
    Route("GET", "/openapi.json", "This document"),
    Route("GET", "/health", "Liveness and what is loaded (no API key needed)"),
)
ERROR = {"type": "object", "required": ["error"], "properties": {"error": {"type": "object", "properties": {
    "message": {"type": "string"}, "type": {"type": "string"}, "param": {"type": ["string", "null"]},
    "code": {"type": ["string", "null"]}}}}}


def document() -> dict:
    paths: dict = {}
    for route in ROUTES:
        operation: dict = {"summary": route.summary, "responses": {
            "200": {"description": "OK"},
            "default": {"description": "An error", "content": {"application/json": {"schema": ERROR}}}}}
        if route.body is not None:
            operation["requestBody"] = {"required": True, "content": {"application/json": {
                "schema": route.body, "example": route.example}}}
        if route.path != "/health":
            operation["security"] = [{"bearer": []}, {"apiKey": []}]
        paths.setdefault(route.path, {})[route.method.lower()] = operation
    return {"openapi": "3.1.0", "info": {"title": "memrad", "version": __version__}, "paths": paths,
            "components": {"securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer"},
                "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key"}}}}


async def openapi(request: web.Request) -> web.Response:
    return web.json_response(document())
