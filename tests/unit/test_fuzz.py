"""The fast fuzz slice: a few hundred generated requests against a served tiny model.

The long run is `memrad bench fuzz --requests 5000` against the default model
(docs/RELIABILITY.md has its figures); both use memrad.bench.fuzz.
"""

import asyncio

from aiohttp.test_utils import TestServer

from memrad.bench.fuzz import fuzz
from memrad.config import ServerSettings, Settings
from memrad.engine.engine import Engine, EngineOptions
from memrad.reuse.pool import ReusePool
from memrad.server.app import make_app


async def test_fuzzed_requests_never_get_a_5xx_and_the_canary_keeps_resuming_exactly(tiny_loaded):
    engine = Engine(tiny_loaded, EngineOptions(16, 1), ReusePool(64, 10**9))
    settings = Settings(server=ServerSettings(shutdown_grace_s=1.0))
    server = TestServer(make_app(settings, engine, "cpu", "float32"), host="127.0.0.1")
    await server.start_server()
    try:
        report = await asyncio.to_thread(fuzz, str(server.make_url("")), 300, 1, None, 100)
    finally:
        await server.close()
    assert report.server_errors == [] and report.hangs == [] and report.bad_bodies == []
    assert report.canary_failures == [] and report.canaries >= 3
    assert report.alive_after and report.requests == 300
    assert sum(n for status, n in report.statuses.items() if 400 <= status < 500) > 100  # it did probe edges
