"""OpenAI-compatible routes: /v1/chat/completions, /v1/completions, /v1/models, /health."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import AsyncIterator

from aiohttp import web

from memrad import __version__
from memrad.protocol import Decision
from memrad.request import Completion, GenerationRequest
from memrad.scheduler import Job, QueueFull, ShuttingDown
from memrad.server.context import CONTEXT, ServerContext
from memrad.server.errors import APIError, invalid, server_error, unavailable
from memrad.server.validate import ParsedRequest, parse_chat, parse_completion
from memrad.server.wire import Envelope, Kind, finish_reason, new_request_id, sse

log = logging.getLogger("memrad.server")

# How often a waiting handler checks whether its client went away.
DISCONNECT_POLL_S = 0.05


async def _json_body(request: web.Request) -> object:
    raw = await request.read()
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise invalid(f"the request body is not valid JSON ({exc}); send a JSON object") from None


def _check_model(ctx: ServerContext, requested: str | None) -> None:
    if requested is not None and requested not in (ctx.engine.model_id, "default"):
        raise APIError(404, f"the model {requested!r} does not exist on this server; it serves "
                       f"{ctx.engine.model_id!r} (GET /v1/models lists it)",
                       param="model", code="model_not_found")


def _check_context(num_prompt: int, max_tokens: int | None, context_len: int) -> None:
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
    parsed = parse_chat(await _json_body(request), request.headers.get("x-session-id"))
    _check_model(ctx, parsed.model)
    messages = [dict(m) for m in parsed.messages or ()]
    tools = [dict(t) for t in parsed.tools] if parsed.tools else None
    text, ids = ctx.engine.render_chat(messages, tools)
    return await _serve(request, ctx, "chat", parsed, text, ids)


async def completions(request: web.Request) -> web.StreamResponse:
    ctx = request.app[CONTEXT]
    parsed = parse_completion(await _json_body(request), request.headers.get("x-session-id"))
    _check_model(ctx, parsed.model)
    if isinstance(parsed.prompt, str):
        text, ids = parsed.prompt, ctx.engine.encode_prompt(parsed.prompt)
    else:
        ids = list(parsed.prompt or ())
        bad = [t for t in ids if not 0 <= t < ctx.engine.vocab_size]
        if bad:
            raise invalid(f"prompt token id {bad[0]} is outside the vocabulary (0..{ctx.engine.vocab_size - 1})",
                          "prompt")
        text = ctx.engine.decode_prompt(ids)
    return await _serve(request, ctx, "completion", parsed, text, ids)


async def _serve(request: web.Request, ctx: ServerContext, kind: Kind, parsed: ParsedRequest,
                 text: str, ids: list[int]) -> web.StreamResponse:
    _check_context(len(ids), parsed.sampling.max_tokens, ctx.engine.context_len)
    request_id = new_request_id(kind)
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
    envelope = Envelope.new(kind, request_id, ctx.engine.model_id)
    watch = _ClientWatch(request, job)
    try:
        if parsed.stream:
            return await _stream(request, envelope, parsed, job, watch)
        return await _whole(envelope, job, watch)
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


async def _whole(envelope: Envelope, job: Job, watch: _ClientWatch) -> web.Response:
    decision = None
    async for item in watch.items():
        if isinstance(item, Decision):
            decision = item
    completion = await job.result
    _log_request(envelope, job, completion, stream=False, gone=watch.gone)
    if completion is None or completion.finish_reason == "cancelled":
        raise unavailable("the request was cancelled because memrad is shutting down")
    body = envelope.whole(completion)
    if decision is not None:
        body["memra"] = {"decision": decision.render()}
    return web.json_response(body, headers=decision_header(decision))


async def _stream(request: web.Request, envelope: Envelope, parsed: ParsedRequest, job: Job,
                  watch: _ClientWatch) -> web.StreamResponse:
    items = watch.items()
    # The decision comes before any prefill work, so waiting for it delays nothing.
    first = await anext(items, None)
    decision = first if isinstance(first, Decision) else None
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           **decision_header(decision)})
    await response.prepare(request)
    usage_field = parsed.include_usage

    async def send(payload: dict | str) -> None:
        if watch.gone:
            return
        try:
            await response.write(sse(payload))
        except (ConnectionError, RuntimeError):
            watch.mark_gone()

    if envelope.kind == "chat":
        await send(envelope.chunk(first=True, with_usage_field=usage_field))
    if isinstance(first, str):
        await send(envelope.chunk(first, with_usage_field=usage_field))
    async for item in items:
        if isinstance(item, str):
            await send(envelope.chunk(item, with_usage_field=usage_field))
    try:
        completion = await job.result
    except Exception as exc:
        log.exception("request %s failed while streaming", envelope.request_id)
        await send(server_error(f"generation failed: {exc}").body())
        return response
    _log_request(envelope, job, completion, stream=True, gone=watch.gone)
    if completion is None or completion.finish_reason == "cancelled":
        await send(unavailable("the request was cancelled because memrad is shutting down").body())
        return response
    await send(envelope.chunk(finish=finish_reason(completion), with_usage_field=usage_field))
    if usage_field:
        await send(envelope.usage_chunk(completion))
    await send("[DONE]")
    if not watch.gone:
        await response.write_eof()
    return response


def _log_request(envelope: Envelope, job: Job, c: Completion | None, stream: bool, gone: bool) -> None:
    waited_s = (job.started_at or time.monotonic()) - job.submitted_at
    if c is None:
        log.info("%s cancelled before it started (waited %.2fs)", envelope.request_id, waited_s)
        return
    outcome = "client disconnected" if gone else c.finish_reason
    ttft = f"{c.ttft_s:.3f}s" if c.ttft_s is not None else "-"
    log.info("%s %s prompt=%d cached=%d completion=%d queue=%.2fs ttft=%s total=%.2fs stream=%s",
             envelope.request_id, outcome, c.prompt_tokens, c.cached_tokens, c.completion_tokens,
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
        "choices": getattr(ctx.engine, "runtime_choices", {}),  # dtype / weights picked, and why
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
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
