"""The aiohttp app factory, shared by the daemon and the tests."""

from __future__ import annotations

import logging

from aiohttp import web

from memrad.config import Settings
from memrad.engine.prompt import PromptError
from memrad.scheduler import Scheduler
from memrad.server.context import CONTEXT, ServerContext, ServingEngine
from memrad.server.errors import APIError, error_style, invalid, server_error
from memrad.server.routes import add_routes

log = logging.getLogger("memrad.server")

MAX_BODY_BYTES = 64 * 1024 * 1024


@web.middleware
async def openai_errors(request: web.Request, handler) -> web.StreamResponse:
    """Every failure leaves as an error body in the route's API style (OpenAI, or Anthropic
    on /v1/messages); nothing escapes to kill the daemon."""
    style = error_style(request.path)
    try:
        return await handler(request)
    except APIError as err:
        return err.response(style)
    except PromptError as err:
        return invalid(str(err), err.param).response(style)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        kind = "invalid_request_error" if exc.status < 500 else "server_error"
        message = {404: f"no route {request.method} {request.path}; see GET /v1/models and "
                        "POST /v1/chat/completions",
                   405: f"method {request.method} is not allowed on {request.path}",
                   413: f"the request body is larger than {MAX_BODY_BYTES // (1024 * 1024)} MiB"
                   }.get(exc.status, exc.reason)
        return APIError(exc.status, message, type=kind, code=exc.reason.lower().replace(" ", "_")).response(style)
    except Exception as exc:
        log.exception("internal error on %s %s", request.method, request.path)
        return server_error(f"internal error ({type(exc).__name__}: {exc}); the daemon is still "
                            "serving, and `memrad logs` has the traceback").response(style)


def make_app(settings: Settings, engine: ServingEngine, device: str, dtype: str) -> web.Application:
    """Build the app around a loaded engine. The scheduler is closed on shutdown."""
    app = web.Application(middlewares=[openai_errors], client_max_size=MAX_BODY_BYTES)
    scheduler = Scheduler(engine, settings.server.max_queue)
    app[CONTEXT] = ServerContext(settings=settings, engine=engine, scheduler=scheduler,
                                 device=device, dtype=dtype)

    async def finish_requests(app: web.Application) -> None:
        await scheduler.close(settings.server.shutdown_grace_s)

    app.on_shutdown.append(finish_requests)
    add_routes(app)
    return app
