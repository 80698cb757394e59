"""The aiohttp app factory, shared by the daemon and the tests.

Middlewares, outermost first: the connection's request tracking (memrad.server.connections),
request metrics (they see the status the client got), errors as API error bodies, then the
access guard (Host, Origin, API key) before any handler reads a body.
"""

from __future__ import annotations

import logging
import secrets

from aiohttp import web

from memrad.config import Settings
from memrad.chat.render import PromptError
from memrad.scheduler import Scheduler
from memrad.server import connections, security
from memrad.server.context import CONTEXT, ServerContext, ServingEngine
from memrad.server.errors import APIError, ErrorStyle, error_style, invalid, server_error
from memrad.server.limits import LIMITS, Limits, too_large
from memrad.server.metrics import CLIENT_GONE, METRICS, Metrics, count_requests, scrape
from memrad.server.openapi import openapi
from memrad.server.prepare import PREPARER, Preparer
from memrad.server.routes import add_routes

log = logging.getLogger("memrad.server")


@web.middleware
async def openai_errors(request: web.Request, handler) -> web.StreamResponse:
    """Every failure leaves as an error body in the route's API style (OpenAI, or Anthropic
    on /v1/messages); nothing escapes to kill the daemon."""
    style = error_style(request.path)
    try:
        return await handler(request)
    except APIError as err:
        return refused(request, err, style)
    except PromptError as err:
        return refused(request, invalid(str(err), err.param), style)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        if exc.status == 413:
            return refused(request, too_large(request.app[LIMITS]), style)
        kind = "invalid_request_error" if exc.status < 500 else "server_error"
        message = {404: f"no route {request.method} {request.path}; see GET /v1/models and "
                        "POST /v1/chat/completions",
                   405: f"method {request.method} is not allowed on {request.path}",
                   }.get(exc.status, exc.reason)
        return refused(request, APIError(exc.status, message, type=kind, code=exc.reason.lower().replace(" ", "_")),
                       style)
    except ConnectionError:
        # The client hung up before its answer could be written (found by the disconnect
        # soak: a stream cut while queued failed in prepare). Nobody to answer; not a 500.
        log.info("client left before the answer to %s %s could be written", request.method, request.path)
        return web.Response(status=int(CLIENT_GONE))
    except Exception as exc:
        log.exception("internal error on %s %s", request.method, request.path)
        return refused(request, server_error(f"internal error ({type(exc).__name__}: {exc}); the daemon is still "
                                             "serving, and `memrad logs` has the traceback"), style)


def refused(request: web.Request, err: APIError, style: ErrorStyle) -> web.Response:
    """A refused or failed request: one warning line (its id, route, status, message), and
    the id in the `x-request-id` header so the client's report can be matched to the log.
    (The route middleware counts it in /metrics by route and status.)"""
    request_id = request.headers.get("x-request-id") or "req_" + secrets.token_hex(8)
    log.warning("%s refused %s %s: %d %s", request_id, request.method, request.path, err.status, err.message)
    response = err.response(style)
    response.headers["x-request-id"] = request_id
    return response


def make_app(settings: Settings, engine: ServingEngine, device: str, dtype: str) -> web.Application:
    """Build the app around a loaded engine. The scheduler is closed on shutdown."""
    app = web.Application(middlewares=[connections.track, count_requests, openai_errors, security.guard],
                          client_max_size=settings.limits.max_body_bytes)
    scheduler = Scheduler(engine, settings.server.max_queue)
    ctx = ServerContext(settings=settings, engine=engine, scheduler=scheduler, device=device, dtype=dtype)
    app[CONTEXT] = ctx
    app[LIMITS] = Limits.from_settings(settings.limits)
    app[PREPARER] = preparer = Preparer(settings.limits.max_preparing_bytes, settings.server.body_timeout_s,
                                            settings.limits.grammar_compile_s)
    app[METRICS] = metrics = Metrics(lambda: _gauges(ctx))
    ctx.event_sinks.append(metrics.observe)
    engine.events.subscribe(ctx.publish)
    security.install(app, settings.security, settings.server.host)

    async def finish_requests(app: web.Application) -> None:
        await scheduler.close(settings.server.shutdown_grace_s)
        preparer.close()

    app.on_shutdown.append(finish_requests)
    add_routes(app)
    app.router.add_get("/metrics", scrape)
    app.router.add_get("/openapi.json", openapi)
    return app


def connection_limits(settings: Settings) -> connections.ConnectionLimits:
    server = settings.server
    return connections.ConnectionLimits(server.max_connections, server.header_timeout_s, server.idle_timeout_s,
                                        server.body_timeout_s, server.max_body_connections)


def _gauges(ctx: ServerContext) -> dict:
    """What /metrics reads at scrape time (memrad.server.metrics.GAUGES names the keys)."""
    running = len(ctx.scheduler.running)
    values: dict = {"queue_depth": ctx.scheduler.waiting, "running_requests": running}
    stats = ctx.engine.stats()  # zeros for a tier that is off
    values.update(pool_sessions={"memory": stats.sessions, "disk": stats.disk_sessions},
                  pool_bytes={"memory": stats.bytes_parked, "disk": stats.disk_bytes},
                  pool_max_bytes=stats.max_bytes, pool_max_sessions=stats.max_sessions)
    counts = getattr(ctx.engine, "thread_counts", None)  # the test fakes have none
    if counts:
        values["threads"] = counts
    return values
