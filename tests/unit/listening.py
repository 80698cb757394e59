"""The daemon's own listener (memrad.server.connections) around an app, for tests that need
what aiohttp's TestServer does not do: half-close, disconnect events, timeouts, the cap."""

from __future__ import annotations

import contextlib

from aiohttp import web

from memrad.config import Settings
from memrad.server.app import connection_limits, make_app
from memrad.server.connections import Listener


@contextlib.asynccontextmanager
async def listening(engine, settings: Settings | None = None):
    """Yield (base url, listener) for `engine` served as the daemon serves it."""
    settings = settings or Settings()
    runner = web.AppRunner(make_app(settings, engine, "cpu", "float32"), access_log=None, shutdown_timeout=1)
    await runner.setup()
    listener = Listener(runner, connection_limits(settings))
    await listener.start("127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{listener.port}", listener
    finally:
        await listener.close()
        await runner.cleanup()
