"""Serving one generation for any API: queue it, parse the reply, answer in a Shape.

    route -> serve(parsed, text, ids, shape) -> scheduler job -> text deltas (+ token logprobs)
          -> ReplyParser (the engine's chat) -> ReplyDeltas -> shape events (stream) | shape.whole

Every API's output is a Shape (chat_api, responses_api, messages_api): events to open a
stream, events per reply delta, events to close it, and the whole object; this module
drives any Shape the same way and writes its events as server-sent events. The job yields
its reuse Decision first (before any prefill), then text; a client that goes away cancels
the job within one engine step. Where the request asks for logprobs each token's record
comes ahead of its text; a stream hands the records that arrived since the last event to
the next delta (the parser may hold text back) and the rest to the closing events, so the
streamed records, concatenated, are the whole reply's, token for token.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

from aiohttp import web

from memrad.protocol import Decision, Speculation
from memrad.chat.reply import Reply, ReplyBuilder, ReplyDelta, plain_reply_deltas
from memrad.request import Completion, GenerationRequest, TokenLogprob
from memrad.scheduler import Job, QueueFull, ShuttingDown
from memrad.server.connections import connection_of
from memrad.server.context import ReplyParserLike, ServerContext
from memrad.server.decoding import reply_sampling
from memrad.server.errors import APIError, ErrorStyle, error_style, invalid, server_error, unavailable
from memrad.server.metrics import CLIENT_GONE, CLIENT_GONE_KEY, STREAM_FAILED_KEY
from memrad.server.prepare import compiled
from memrad.server.tools import tool_names
from memrad.server.validate import ParsedRequest

log = logging.getLogger("memrad.server")

# One server-sent event: (event name or None, data object or a bare string like "[DONE]").
Event = tuple[str | None, dict | str]


class Shape(Protocol):
    """One API's rendering of a generation (pure; mutates only its own counters)."""

    def opening(self, decision: Decision | None) -> list[Event]: ...
    # `logprobs`: the tokens' records that arrived since the last event (none unless asked).
    def deltas(self, delta: ReplyDelta, logprobs: tuple[TokenLogprob, ...] = ()) -> list[Event]: ...
    def closing(self, reply: Reply, c: Completion, logprobs: tuple[TokenLogprob, ...] = ()) -> list[Event]: ...
    def whole(self, reply: Reply, c: Completion, decision: Decision | None) -> dict: ...
    def stream_error(self, body: dict) -> list[Event]: ...
    # What resets the API's clients' idle timers while nothing else flows (prefill, a queue,
    # a slow step); [] sends an SSE comment, which only byte-counting clients see.
    def keepalive(self) -> list[Event]: ...


# How often a handler checks whether its client went away when its connection is not
# memrad's (aiohttp's test server); memrad's own connections report it as an event.
DISCONNECT_POLL_S = 0.05
# The longest a stream stays silent: a keepalive follows while prefill or a queue holds the
# first token back (clients' first-byte timeouts: Claude Code re-sends after ~300 s).
KEEPALIVE_S = 15.0
# How long a stream's headers wait for the reuse decision (made before any prefill).
DECISION_WAIT_S = 0.5
# Probes after the peer's EOF: loopback resets arrive in microseconds, a LAN's in milliseconds.
PROBE_DELAYS_S = (0.0, 0.02, 0.1, 0.5, 2.0)
PROBE = b": probe\n\n"


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


Finished = Callable[[Reply, Completion], None]


async def serve(request: web.Request, ctx: ServerContext, parsed: ParsedRequest, text: str, ids: list[int],
                shape: Shape, request_id: str, parse: bool = True,
                on_finished: Finished | None = None) -> web.StreamResponse:
    """Queue the generation and answer in `shape`, streamed or whole. `parse`: run the reply
    through the model's reply parser (chat APIs); `on_finished` hears the whole reply."""
    check_context(len(ids), parsed.sampling.max_tokens, ctx.engine.context_len)
    choice, chat = parsed.tool_choice, ctx.engine.chat
    tools = parsed.tools if parsed.parse_tools else None
    args = (chat, parsed.sampling, tools, choice.mode, choice.name, parsed.parallel_tool_calls)
    if parsed.sampling.constraint is None and not tools:
        sampling = reply_sampling(*args)  # no grammar to compile
    else:  # compiling may take seconds: on the grammar worker, within limits.grammar_compile_s
        sampling = await compiled(request, lambda: chat.compiling, reply_sampling, *args)
    gen = GenerationRequest(request_id=request_id, model=ctx.engine.model_id, prompt_ids=tuple(ids),
                            prompt_text=text, sampling=sampling, identity=parsed.identity,
                            cache_salt=parsed.cache_salt)
    try:
        job = ctx.scheduler.submit(gen)
    except QueueFull as full:
        raise APIError(429, f"the server is busy: {full.waiting} requests are waiting for the model; "
                       f"retry in {full.retry_after_s} s", type="rate_limit_error", code="queue_full",
                       headers={"Retry-After": str(full.retry_after_s)}) from None
    except ShuttingDown:
        raise unavailable("memrad is shutting down; start it again with `memrad start`") from None
    parser = ctx.engine.chat.parser(text, parsed.parse_tools, frozenset(tool_names(parsed.tools))) if parse else None
    run = _Run(request_id, shape, parser, on_finished, error_style(request.path))
    watch = _ClientWatch(request, job)
    try:
        if parsed.stream:
            return await _stream(request, run, job, watch)
        return await _whole(run, job, watch)
    finally:
        watch.close()
        if not job.result.done():
            job.cancel()  # the handler is leaving early (error or cancellation)


def decision_field(decision: Decision | None, notes: tuple[str, ...] = (),
                   speculation: Speculation | None = None) -> dict:
    """The `memra` field every API's object carries: the reuse decision's one rendering and
    what its resume cost (memrad.protocol.Decision.render_cost), the decode step the reply
    runs on (`step`: compiled, eager or transformers), the RoPE it runs under (`rope`: native or
    e.g. yarn x4, memrad.engine.model.rope), what memrad left out of or changed in the request
    (validate.Notes), and, on a finished reply, how it decoded with drafts
    (memrad.engine.speculation: acceptance, tokens per step)."""
    field: dict = {"decision": decision.render(), "cost": decision.render_cost()} if decision is not None else {}
    if decision is not None and decision.step is not None:
        field["step"] = decision.step
    if decision is not None and decision.rope is not None:
        field["rope"] = decision.rope  # "native", or the scaling past the native length ("yarn x4")
    if notes:
        field["notes"] = list(notes)
    if speculation is not None:
        field["speculation"] = speculation.render()
    return {"memra": field} if field else {}


DECISION_HEADER = "x-memra-decision"
STEP_HEADER = "x-memra-step"


def decision_header(decision: Decision | None) -> dict[str, str]:
    """The decision's one rendering, made header-safe: non-ASCII and control characters are
    backslash-escaped (a session name may hold either); everything else reads as logged. The
    decode step beside it (`x-memra-step`) where the engine named one."""
    if decision is None:
        return {}
    ascii_text = decision.render().encode("ascii", "backslashreplace").decode("ascii")
    step = {STEP_HEADER: decision.step} if decision.step is not None else {}
    return {DECISION_HEADER: "".join(c if c.isprintable() else repr(c)[1:-1] for c in ascii_text), **step}


# Why a wait for the job's next item ended without one.
IDLE = object()


class _ClientWatch:
    """Relays a job's items and cancels the job the moment the client is gone.

    A job yields its reuse Decision first, then text deltas, then None. Through memrad's
    listener (memrad.server.connections) the connection reports its loss as an event, so the
    cancel reaches the engine before its next prefill chunk or decode step, however fast
    tokens flow; a request from another listener is checked on every item and every
    DISCONNECT_POLL_S. After the peer's EOF (a half-close, or a full close) `probe` writes
    a few bytes: a peer that closed fully answers them with a reset, which the next probe
    turns into the loss event; a half-closed one reads them and is served.
    """

    def __init__(self, request: web.Request, job: Job) -> None:
        self.request = request
        self.job = job
        self.gone = False
        self.conn = connection_of(request)
        # Before a response starts, an interim response; a stream swaps in an SSE comment.
        self.probe: Callable[[], Awaitable[None]] = self._interim_probe
        self._getter: asyncio.Future | None = None
        self._prober: asyncio.Task | None = None
        if self.conn is not None:
            self.conn.on_gone(self.mark_gone)
            self.conn.on_eof(self._start_probing)

    def client_gone(self) -> bool:
        if self.conn is not None:
            return self.conn.gone
        transport = self.request.transport
        return transport is None or transport.is_closing()

    def mark_gone(self) -> None:
        if not self.gone:
            self.gone = True
            self.request[CLIENT_GONE_KEY] = True
            self.job.cancel()

    async def next_item(self, timeout_s: float) -> Decision | str | TokenLogprob | None | object:
        """The job's next item, None at its end, or IDLE when none came within `timeout_s`."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            self._getter = self._getter or asyncio.ensure_future(self.job.deltas.get())
            left = deadline - loop.time()
            wait = left if self.conn is not None else min(left, DISCONNECT_POLL_S)
            done, _ = await asyncio.wait({self._getter}, timeout=max(0.0, wait))
            if self.conn is None and not self.gone and self.client_gone():
                self.mark_gone()
            if done:
                item, self._getter = self._getter.result(), None
                return item
            if loop.time() >= deadline:
                return IDLE

    def _start_probing(self) -> None:
        self._prober = asyncio.ensure_future(self._probe_after_eof())

    async def _probe_after_eof(self) -> None:
        for delay in PROBE_DELAYS_S:
            await asyncio.sleep(delay)
            if self.gone or self.job.result.done():
                return
            await self.probe()

    async def _interim_probe(self) -> None:
        # RFC 9110 15.2: a client must accept 1xx responses it did not ask for (not HTTP/1.0).
        transport = self.request.transport
        if transport is not None and self.request.version >= (1, 1):
            transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def close(self) -> None:
        for waiter in (self._getter, self._prober):
            if waiter is not None:
                waiter.cancel()


@dataclass
class _Run:
    """One request's rendering state: its Shape, its reply parser and the reply so far."""

    request_id: str
    shape: Shape
    parser: ReplyParserLike | None
    on_finished: Finished | None
    style: ErrorStyle
    built: ReplyBuilder = field(default_factory=ReplyBuilder)
    pending: list[TokenLogprob] = field(default_factory=list)  # token records not yet on an event

    def take_logprobs(self) -> tuple[TokenLogprob, ...]:
        taken, self.pending = tuple(self.pending), []
        return taken

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
    while (item := await watch.next_item(KEEPALIVE_S)) is not None:
        if isinstance(item, Decision):
            decision = item
        elif isinstance(item, str):
            run.feed(item)
    completion = await job.result
    _log_request(run.request_id, job, completion, stream=False, gone=watch.gone)
    if watch.gone:
        return web.Response(status=int(CLIENT_GONE))  # nobody reads it; /metrics counts a 499
    if completion is None or completion.finish_reason == "cancelled":
        raise unavailable("the request was cancelled because memrad is shutting down")
    if completion.finish_reason == "grammar":
        raise grammar_failed(job, completion)
    _, reply = run.finish(completion)
    return web.json_response(run.shape.whole(reply, completion, decision), headers=decision_header(decision))


def sse(payload: dict | str, event: str | None = None) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {data}\n\n".encode()


# An SSE comment: every SSE parser skips it, so only clients that time the bytes see it
# (httpx's read timeout in the OpenAI and Anthropic Python SDKs, undici's body timeout).
KEEPALIVE_COMMENT = b": keepalive\n\n"


async def _stream(request: web.Request, run: _Run, job: Job, watch: _ClientWatch) -> web.StreamResponse:
    # The decision comes before any prefill work, so a running job's is here within
    # milliseconds and rides in the headers; a queued job's headers leave without it.
    first = await watch.next_item(DECISION_WAIT_S)
    decision = first if isinstance(first, Decision) else None
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           **decision_header(decision)})
    await response.prepare(request)
    shape = run.shape

    async def write(data: bytes) -> None:
        if watch.gone:
            return
        try:
            await response.write(data)
        except (ConnectionError, RuntimeError):
            watch.mark_gone()

    async def send(events: list[Event]) -> None:
        for event, payload in events:
            await write(sse(payload, event))

    async def send_deltas(deltas: list[ReplyDelta]) -> None:
        for delta in deltas:
            await send(shape.deltas(delta, run.take_logprobs()))

    watch.probe = lambda: write(PROBE)
    await send(shape.opening(decision))
    item = first
    while item is not None:
        if isinstance(item, str):
            await send_deltas(run.feed(item))
        elif isinstance(item, TokenLogprob):
            run.pending.append(item)
        elif item is IDLE:
            # prefill or a queue: keep first-byte and idle timers quiet (docs/SERVING.md, Keepalives)
            events = shape.keepalive()
            await (send(events) if events else write(KEEPALIVE_COMMENT))
        item = await watch.next_item(KEEPALIVE_S)
    try:
        completion = await job.result
    except Exception as exc:
        # The status line already left as 200: the failure is the stream's error event.
        log.exception("%s failed %s %s while streaming: 500 generation failed: %s", run.request_id,
                      request.method, request.path, exc)
        failed = server_error(f"generation failed: {exc}")
        request[STREAM_FAILED_KEY] = failed.status
        await send(shape.stream_error(failed.body(run.style)))
        return response
    _log_request(run.request_id, job, completion, stream=True, gone=watch.gone)
    if watch.gone:
        return response
    if completion is None or completion.finish_reason == "cancelled":
        cancelled = unavailable("the request was cancelled because memrad is shutting down")
        log.warning("%s failed %s %s while streaming: %d %s", run.request_id, request.method, request.path,
                    cancelled.status, cancelled.message)
        request[STREAM_FAILED_KEY] = cancelled.status
        await send(shape.stream_error(cancelled.body(run.style)))
        return response
    if completion.finish_reason == "grammar":
        failed = grammar_failed(job, completion)
        log.warning("%s failed %s %s while streaming: %d %s", run.request_id, request.method, request.path,
                    failed.status, failed.message)
        request[STREAM_FAILED_KEY] = failed.status
        await send(shape.stream_error(failed.body(run.style)))
        return response
    deltas, reply = run.finish(completion)
    await send_deltas(deltas)
    await send(shape.closing(reply, completion, run.take_logprobs()))
    if not watch.gone:
        await response.write_eof()
    return response


def grammar_failed(job: Job, c: Completion) -> APIError:
    """A reply whose grammar could not go on: an error naming the schema's field, never a
    finished reply (its text is not valid against the grammar)."""
    constraint = job.request.sampling.constraint
    param = constraint.param if constraint is not None else None
    return APIError(400, f"the reply's grammar (from {param}) could not continue after {c.completion_tokens} tokens: "
                    f"{c.error}; simplify the schema", param=param, code="grammar_failed")


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
