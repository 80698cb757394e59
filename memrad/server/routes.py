"""HTTP routes: OpenAI Chat Completions, Completions, Responses, Anthropic Messages, models, health.

Each API's route validates its body into the one internal request (ParsedRequest), renders
it through the model's chat template, and answers through its own Shape; serving, reply
parsing and client-disconnect handling are shared here.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Protocol

from aiohttp import web

from memrad import __version__
from memrad.protocol import Decision
from memrad.request import Completion, GenerationRequest
from memrad.scheduler import Job, QueueFull, ShuttingDown
from memrad.server.context import CONTEXT, ServerContext
from memrad.reply import Reply, ReplyBuilder, ReplyDelta, plain_reply_deltas
from memrad.server.errors import APIError, ErrorStyle, error_style, invalid, server_error, unavailable
from memrad.server.limits import LIMITS, check_body, parse_body
from memrad.server.messages_api import MessagesShape, new_message_id, parse_messages
from memrad.server.responses_api import ResponsesShape, new_response_id, parse_responses, remembered
from memrad.server.validate import ParsedRequest, parse_chat, parse_completion
from memrad.server.wire import Envelope, Event, OpenAIShape, Shape, new_request_id, sse

log = logging.getLogger("memrad.server")

class ReplyParserLike(Protocol):
    """memrad.engine.reply_parser.ReplyParser as the server sees it."""

    def feed(self, text: str) -> list[ReplyDelta]: ...
    def finish(self) -> list[ReplyDelta]: ...


# How often a waiting handler checks whether its client went away.
DISCONNECT_POLL_S = 0.05


async def json_body(request: web.Request) -> object:
    limits = request.app[LIMITS]
    body = parse_body(await request.read(), limits)
    check_body(body, limits)
    return body


def check_model(ctx: ServerContext, requested: str | None) -> None:
    if requested is not None and requested not in (ctx.engine.model_id, "default"):
        raise APIError(404, f"the model {requested!r} does not exist on this server; it serves "
                       f"{ctx.engine.model_id!r} (GET /v1/models lists it)",
                       param="model", code="model_not_found")


def check_context(num_prompt: int, max_tokens: int | None, context_len: int) -> None:
    if num_prompt == 0:
        raise invalid("the prompt is empty after tokenization", "prompt")
    wanted = num_prompt + (max_tokens if max_tokens is not None else 1)
    if wanted > context_len:
        asks = f" and max_tokens asks for {max_tokens} more ({wanted})" if max_tokens is not None else ""
        raise invalid(
            f"this model's maximum context length is {context_len} tokens; the prompt has "
            f"{num_prompt} tokens{asks}. Shorten the conversation or lower max_tokens.",
            "messages" if max_tokens is None else "max_tokens", code="context_length_exceeded")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    ctx = request.app[CONTEXT]
    parsed = parse_chat(await json_body(request), request.headers.get("x-session-id"))
    check_model(ctx, parsed.model)
    text, ids = render(ctx, parsed)
    request_id = new_request_id("chat")
    shape = OpenAIShape(Envelope.new("chat", request_id, ctx.engine.model_id), parsed.include_usage)
    return await serve(request, ctx, parsed, text, ids, shape, request_id)


async def completions(request: web.Request) -> web.StreamResponse:
    ctx = request.app[CONTEXT]
    parsed = parse_completion(await json_body(request), request.headers.get("x-session-id"))
    check_model(ctx, parsed.model)
    if isinstance(parsed.prompt, str):
        text, ids = parsed.prompt, ctx.engine.encode_prompt(parsed.prompt)
    else:
        ids = list(parsed.prompt or ())
        bad = [t for t in ids if not 0 <= t < ctx.engine.vocab_size]
        if bad:
            raise invalid(f"prompt token id {bad[0]} is outside the vocabulary (0..{ctx.engine.vocab_size - 1})",
                          "prompt")
        text = ctx.engine.decode_prompt(ids)
    request_id = new_request_id("completion")
    shape = OpenAIShape(Envelope.new("completion", request_id, ctx.engine.model_id), parsed.include_usage)
    return await serve(request, ctx, parsed, text, ids, shape, request_id, parse=False)


async def responses(request: web.Request) -> web.StreamResponse:
    """OpenAI Responses API; a stored response can be continued by previous_response_id."""
    ctx = request.app[CONTEXT]
    req = parse_responses(await json_body(request), request.headers.get("x-session-id"), ctx.responses.get)
    check_model(ctx, req.parsed.model)
    text, ids = render(ctx, req.parsed)
    response_id = new_response_id()
    shape = ResponsesShape(req, response_id, ctx.engine.model_id)

    def remember(reply: Reply, c: Completion) -> None:
        if req.store:
            ctx.responses.put(remembered(req, response_id, reply))

    return await serve(request, ctx, req.parsed, text, ids, shape, response_id, on_finished=remember)


async def messages(request: web.Request) -> web.StreamResponse:
    """Anthropic Messages API (x-api-key and anthropic-version are accepted and not checked)."""
    ctx = request.app[CONTEXT]
    parsed = parse_messages(await json_body(request), request.headers.get("x-session-id"))
    check_model(ctx, parsed.model)
    text, ids = render(ctx, parsed)
    message_id = new_message_id()
    return await serve(request, ctx, parsed, text, ids, MessagesShape(message_id, ctx.engine.model_id, len(ids)),
                       message_id)


async def count_tokens(request: web.Request) -> web.Response:
    """The prompt's length as /v1/messages would render it."""
    ctx = request.app[CONTEXT]
    parsed = parse_messages(await json_body(request), request.headers.get("x-session-id"), count_only=True)
    check_model(ctx, parsed.model)
    _, ids = render(ctx, parsed)
    return web.json_response({"input_tokens": len(ids)})


def render(ctx: ServerContext, parsed: ParsedRequest) -> tuple[str, list[int]]:
    """The one rendering path of every chat-shaped API: internal messages + tools -> ids."""
    messages = [dict(m) for m in parsed.messages or ()]
    tools = [dict(t) for t in parsed.tools] if parsed.tools else None
    return ctx.engine.render_chat(messages, tools)


Finished = Callable[[Reply, Completion], None]


async def serve(request: web.Request, ctx: ServerContext, parsed: ParsedRequest, text: str, ids: list[int],
                shape: Shape, request_id: str, parse: bool = True,
                on_finished: Finished | None = None) -> web.StreamResponse:
    """Queue the generation and answer in `shape`, streamed or whole. `parse`: run the reply
    through the model's reply parser (chat APIs); `on_finished` hears the whole reply."""
    check_context(len(ids), parsed.sampling.max_tokens, ctx.engine.context_len)
    gen = GenerationRequest(request_id=request_id, model=ctx.engine.model_id, prompt_ids=tuple(ids),
                            prompt_text=text, sampling=parsed.sampling, identity=parsed.identity,
                            cache_salt=parsed.cache_salt)
    try:
        job = ctx.scheduler.submit(gen)
    except QueueFull as full:
        raise APIError(429, f"the server is busy: {full.waiting} requests are waiting for the model; "
                       f"retry in {full.retry_after_s} s", type="rate_limit_error", code="queue_full",
                       headers={"Retry-After": str(full.retry_after_s)}) from None
    except ShuttingDown:
        raise unavailable("memrad is shutting down; start it again with `memrad start`") from None
    parser = ctx.engine.reply_parser(text, parsed.parse_tools) if parse else None
    run = _Run(request_id, shape, parser, on_finished, error_style(request.path))
    watch = _ClientWatch(request, job)
    try:
        if parsed.stream:
            return await _stream(request, run, job, watch)
        return await _whole(run, job, watch)
    finally:
        if not job.result.done():
            job.cancel()  # the handler is leaving early (error or cancellation)


DECISION_HEADER = "x-memra-decision"


def decision_header(decision: Decision | None) -> dict[str, str]:
    """The decision's one rendering, made header-safe: non-ASCII and control characters are
    backslash-escaped (a session name may hold either); everything else reads as logged."""
    if decision is None:
        return {}
    ascii_text = decision.render().encode("ascii", "backslashreplace").decode("ascii")
    return {DECISION_HEADER: "".join(c if c.isprintable() else repr(c)[1:-1] for c in ascii_text)}


class _ClientWatch:
    """Relays a job's items and cancels the job as soon as the client is gone.

    A job yields its reuse Decision first, then text deltas; `items()` yields both.
    """

    def __init__(self, request: web.Request, job: Job) -> None:
        self.request = request
        self.job = job
        self.gone = False

    def client_gone(self) -> bool:
        transport = self.request.transport
        return transport is None or transport.is_closing()

    def mark_gone(self) -> None:
        self.gone = True
        self.job.cancel()

    async def items(self) -> AsyncIterator[Decision | str]:
        getter: asyncio.Future | None = None
        try:
            while True:
                getter = getter or asyncio.ensure_future(self.job.deltas.get())
                done, _ = await asyncio.wait({getter}, timeout=DISCONNECT_POLL_S)
                if not done:
                    if not self.gone and self.client_gone():
                        self.mark_gone()
                    continue
                item, getter = getter.result(), None
                if item is None:
                    return
                yield item
        finally:
            if getter is not None:
                getter.cancel()


@dataclass
class _Run:
    """One request's rendering state: its Shape, its reply parser and the reply so far."""

    request_id: str
    shape: Shape
    parser: ReplyParserLike | None
    on_finished: Finished | None
    style: ErrorStyle
    built: ReplyBuilder = field(default_factory=ReplyBuilder)

    def feed(self, text: str) -> list[ReplyDelta]:
        deltas = self.parser.feed(text) if self.parser is not None else plain_reply_deltas(text)
        self.built.extend(deltas)
        return deltas

    def finish(self, c: Completion) -> tuple[list[ReplyDelta], Reply]:
        deltas = self.parser.finish() if self.parser is not None else []
        self.built.extend(deltas)
        reply = self.built.reply()
        if self.on_finished is not None:
            self.on_finished(reply, c)
        return deltas, reply


async def _whole(run: _Run, job: Job, watch: _ClientWatch) -> web.Response:
    decision = None
    async for item in watch.items():
        if isinstance(item, Decision):
            decision = item
        else:
            run.feed(item)
    completion = await job.result
    _log_request(run.request_id, job, completion, stream=False, gone=watch.gone)
    if completion is None or completion.finish_reason == "cancelled":
        raise unavailable("the request was cancelled because memrad is shutting down")
    _, reply = run.finish(completion)
    return web.json_response(run.shape.whole(reply, completion, decision), headers=decision_header(decision))


async def _stream(request: web.Request, run: _Run, job: Job, watch: _ClientWatch) -> web.StreamResponse:
    items = watch.items()
    # The decision comes before any prefill work, so waiting for it delays nothing.
    first = await anext(items, None)
    decision = first if isinstance(first, Decision) else None
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           **decision_header(decision)})
    await response.prepare(request)
    shape = run.shape

    async def send(events: list[Event]) -> None:
        for event, payload in events:
            if watch.gone:
                return
            try:
                await response.write(sse(payload, event))
            except (ConnectionError, RuntimeError):
                watch.mark_gone()

    async def send_deltas(deltas: list[ReplyDelta]) -> None:
        for delta in deltas:
            await send(shape.deltas(delta))

    await send(shape.opening(decision))
    if isinstance(first, str):
        await send_deltas(run.feed(first))
    async for item in items:
        if isinstance(item, str):
            await send_deltas(run.feed(item))
    try:
        completion = await job.result
    except Exception as exc:
        log.exception("request %s failed while streaming", run.request_id)
        await send(shape.stream_error(server_error(f"generation failed: {exc}").body(run.style)))
        return response
    _log_request(run.request_id, job, completion, stream=True, gone=watch.gone)
    if completion is None or completion.finish_reason == "cancelled":
        await send(shape.stream_error(
            unavailable("the request was cancelled because memrad is shutting down").body(run.style)))
        return response
    deltas, reply = run.finish(completion)
    await send_deltas(deltas)
    await send(shape.closing(reply, completion))
    if not watch.gone:
        await response.write_eof()
    return response


def _log_request(request_id: str, job: Job, c: Completion | None, stream: bool, gone: bool) -> None:
    waited_s = (job.started_at or time.monotonic()) - job.submitted_at
    if c is None:
        log.info("%s cancelled before it started (waited %.2fs)", request_id, waited_s)
        return
    outcome = "client disconnected" if gone else c.finish_reason
    ttft = f"{c.ttft_s:.3f}s" if c.ttft_s is not None else "-"
    log.info("%s %s prompt=%d cached=%d completion=%d queue=%.2fs ttft=%s total=%.2fs stream=%s",
             request_id, outcome, c.prompt_tokens, c.cached_tokens, c.completion_tokens,
             waited_s, ttft, c.total_s, "yes" if stream else "no")


async def models(request: web.Request) -> web.Response:
    ctx = request.app[CONTEXT]
    return web.json_response({"object": "list", "data": [{
        "id": ctx.engine.model_id, "object": "model", "created": int(ctx.started_at), "owned_by": "memra",
        "context_length": ctx.engine.context_len,
    }]})


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
        "threads": ctx.settings.model.threads,
        "prefill_chunk": ctx.settings.engine.prefill_chunk,
        "context_len": ctx.engine.context_len,
        "started_at": ctx.started_at,
        "uptime_s": round(time.time() - ctx.started_at, 3),
        "requests_served": ctx.scheduler.requests_served,
        "running": running.request.request_id if running else None,
        "waiting": ctx.scheduler.waiting,
    })


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/responses", responses)
    app.router.add_post("/v1/messages", messages)
    app.router.add_post("/v1/messages/count_tokens", count_tokens)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
