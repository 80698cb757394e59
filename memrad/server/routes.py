"""HTTP routes: OpenAI Chat Completions, Completions, Responses, Anthropic Messages, models, health.

Each API's route validates its body into the one internal request (ParsedRequest), renders
it through the model's chat template, and answers through its own Shape; serving, reply
parsing and client-disconnect handling are shared (memrad.server.serving).
"""

from __future__ import annotations

import logging
import os
import time

from aiohttp import web

from memrad import __version__
from memrad.chat.reply import Reply
from memrad.loglines import quoted
from memrad.request import Completion
from memrad.server.chat_api import Envelope, OpenAIShape, new_request_id, parse_chat, parse_completion
from memrad.server.context import CONTEXT, ServerContext
from memrad.server.errors import APIError, error_style, invalid
from memrad.server.prepare import prepared, read_json
from memrad.server.messages_api import MessagesShape, new_message_id, parse_messages
from memrad.server.overflow import fit
from memrad.server.responses_api import ResponsesShape, new_response_id, parse_responses, remembered
from memrad.server.serving import serve
from memrad.server.validate import ParsedRequest

log = logging.getLogger("memrad.server")
# Model names already answered by the loaded model, so each is logged once (per app).
SERVED_ALIASES = web.AppKey("served_aliases", set)


async def json_body(request: web.Request) -> object:
    """Read within the body timeout, parsed and limit-checked off the event loop (memrad.server.prepare)."""
    return await read_json(request)


def check_model(request: web.Request, requested: str | None) -> None:
    """A name memrad does not serve is served by the loaded model (Claude Code asks for
    claude-haiku-… side queries; the reply names the real model), unless
    server.strict_model_names restores the 404."""
    ctx = request.app[CONTEXT]
    if requested is None or requested in (ctx.engine.model_id, "default"):
        return
    if ctx.settings.server.strict_model_names:
        raise APIError(404, f"the model {quoted(requested)} does not exist on this server; it serves "
                       f"{ctx.engine.model_id!r} (GET /v1/models lists it; server.strict_model_names = false "
                       "serves any name with it)", param="model", code="model_not_found")
    seen = request.app[SERVED_ALIASES]
    if requested not in seen:
        seen.add(requested)
        log.info("model %s is not served here; %r answers it (and every later request naming it)",
                 quoted(requested), ctx.engine.model_id)


def reply_cap(ctx) -> int | None:
    """The most tokens one reply runs to (limits.max_reply_tokens; 0: the context bounds it)."""
    return ctx.settings.limits.max_reply_tokens or None


async def fitted(request: web.Request, parsed: ParsedRequest, param: str) -> tuple[ParsedRequest, str, list[int]]:
    """Render a chat-shaped request off the event loop and fit it to the context:
    (request, prompt text, ids)."""
    ctx = request.app[CONTEXT]
    check_model(request, parsed.model)
    text, ids = await prepared(request, render, ctx, parsed)
    parsed = fit(parsed, len(ids), ctx.engine.context_len, error_style(request.path), param, reply_cap(ctx))
    for note in parsed.notes:
        log.info("%s %s: %s", request.method, request.path, note)
    return parsed, text, ids


async def chat_completions(request: web.Request) -> web.StreamResponse:
    ctx = request.app[CONTEXT]
    parsed, text, ids = await fitted(request, parse_chat(await json_body(request), request.headers.get("x-session-id")),
                                     "messages")
    request_id = new_request_id("chat")
    shape = OpenAIShape(Envelope.new("chat", request_id, ctx.engine.model_id), parsed.include_usage, parsed.notes)
    return await serve(request, ctx, parsed, text, ids, shape, request_id)


async def completions(request: web.Request) -> web.StreamResponse:
    ctx = request.app[CONTEXT]
    parsed = parse_completion(await json_body(request), request.headers.get("x-session-id"))
    check_model(request, parsed.model)
    if isinstance(parsed.prompt, str):
        text, ids = parsed.prompt, await prepared(request, ctx.engine.chat.encode, parsed.prompt)
    else:
        ids = list(parsed.prompt or ())
        vocab_size = ctx.engine.chat.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise invalid(f"prompt token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})", "prompt")
        text = ctx.engine.chat.decode(ids)
    parsed = fit(parsed, len(ids), ctx.engine.context_len, "openai", "prompt", reply_cap(ctx))
    request_id = new_request_id("completion")
    shape = OpenAIShape(Envelope.new("completion", request_id, ctx.engine.model_id), parsed.include_usage,
                        parsed.notes)
    return await serve(request, ctx, parsed, text, ids, shape, request_id, parse=False)


async def responses(request: web.Request) -> web.StreamResponse:
    """OpenAI Responses API; a stored response can be continued by previous_response_id."""
    ctx = request.app[CONTEXT]
    req = parse_responses(await json_body(request), request.headers.get("x-session-id"), ctx.responses.get)
    parsed, text, ids = await fitted(request, req.parsed, "input")
    response_id = new_response_id()
    shape = ResponsesShape(req, response_id, ctx.engine.model_id, notes=parsed.notes)

    def remember(reply: Reply, c: Completion) -> None:
        if req.store:
            ctx.responses.put(remembered(req, response_id, reply))

    return await serve(request, ctx, parsed, text, ids, shape, response_id, on_finished=remember)


async def messages(request: web.Request) -> web.StreamResponse:
    """Anthropic Messages API (x-api-key and anthropic-version are accepted and not checked)."""
    ctx = request.app[CONTEXT]
    parsed, text, ids = await fitted(request, parse_messages(await json_body(request), session_header(request)),
                                     "messages")
    message_id = new_message_id()
    shape = MessagesShape(message_id, ctx.engine.model_id, len(ids), parsed.notes)
    return await serve(request, ctx, parsed, text, ids, shape, message_id)


def session_header(request: web.Request) -> str | None:
    """`x-session-id`, else Claude Code's own X-Claude-Code-Session-Id (the body's
    metadata.user_id names the same session and beats both)."""
    return request.headers.get("x-session-id") or request.headers.get("x-claude-code-session-id")


async def count_tokens(request: web.Request) -> web.Response:
    """The prompt's length as /v1/messages would render it."""
    ctx = request.app[CONTEXT]
    parsed = parse_messages(await json_body(request), session_header(request), count_only=True)
    check_model(request, parsed.model)
    _, ids = await prepared(request, render, ctx, parsed)
    return web.json_response({"input_tokens": len(ids)})


def render(ctx: ServerContext, parsed: ParsedRequest) -> tuple[str, list[int]]:
    """The one rendering path of every chat-shaped API: internal messages + tools -> ids."""
    messages = [dict(m) for m in parsed.messages or ()]
    tools = [dict(t) for t in parsed.tools] if parsed.tools else None
    choice = parsed.tool_choice
    return ctx.engine.chat.render(messages, tools, require_call=choice.mode in ("required", "function"),
                                  call_name=choice.name if choice.mode == "function" else None)


async def models(request: web.Request) -> web.Response:
    ctx = request.app[CONTEXT]
    context = ctx.engine.runtime_choices["context"]
    return web.json_response({"object": "list", "data": [{
        "id": ctx.engine.model_id, "object": "model", "created": int(ctx.started_at), "owned_by": "memra",
        # One number under each name a client reads it from: context_length (OpenRouter, LM
        # Studio), max_model_len (vLLM), context_window (opencode, LiteLLM-style catalogs).
        "context_length": ctx.engine.context_len, "max_model_len": ctx.engine.context_len,
        "context_window": ctx.engine.context_len,
        # Both lengths and the rule: native RoPE where prompt + max_tokens fits the native length,
        # the scaling ("yarn x4") past it (memrad.engine.model.rope); "native" when served within it.
        "native_context_length": context.get("native_context_length", ctx.engine.context_len),
        "context_scaling": context.get("context_scaling", context["value"]),
        "context_rule": context["reason"],
    }]})


async def hello(request: web.Request) -> web.Response:
    """`HEAD /` and `HEAD /api/hello`: the preflight Claude Code sends before its first request."""
    return web.Response(status=200)


async def health(request: web.Request) -> web.Response:
    ctx = request.app[CONTEXT]
    running = ctx.scheduler.running
    return web.json_response({
        "status": "ok",
        "version": __version__,
        "pid": os.getpid(),
        "model": ctx.engine.model_id,
        "device": ctx.device,
        "dtype": ctx.dtype,
        "choices": ctx.engine.runtime_choices,  # dtype / weights picked, and why
        "threads": ctx.settings.model.threads,
        "prefill_chunk": ctx.settings.engine.prefill_chunk,
        "context_len": ctx.engine.context_len,
        "started_at": ctx.started_at,
        "uptime_s": round(time.time() - ctx.started_at, 3),
        "requests_served": ctx.scheduler.requests_served,
        "running": running[0].request.request_id if running else None,  # the oldest in flight
        "in_flight": [job.request.request_id for job in running],
        "max_batch": ctx.scheduler.max_batch,
        "waiting": ctx.scheduler.waiting,
    })


def add_routes(app: web.Application) -> None:
    app[SERVED_ALIASES] = set()
    app.router.add_route("HEAD", "/", hello)
    app.router.add_route("HEAD", "/api/hello", hello)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/responses", responses)
    app.router.add_post("/v1/messages", messages)
    app.router.add_post("/v1/messages/count_tokens", count_tokens)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
