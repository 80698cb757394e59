"""The fault harnesses, small, against a served tiny model: their checks must hold and be
able to fail. The full-size runs (default model) are `memrad bench faults ...`; their
figures are in docs/RELIABILITY.md."""

import time

from aiohttp import ClientSession, ClientTimeout
from aiohttp.test_utils import TestServer

from memrad.bench.faults import Api, churn, overload, soak
from memrad.config import ServerSettings, Settings
from memrad.engine.engine import Engine, EngineOptions
from memrad.reuse.pool import ReusePool
from memrad.server.app import make_app


class Slow:
    """The tiny engine, `step_s` slower per generated token: a job outlasts 16 arrivals."""

    def __init__(self, engine, step_s):
        self._engine, self.step_s = engine, step_s

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def admit(self, request, emit, cancelled, on_decision=None):
        def slow_emit(text):
            time.sleep(self.step_s)
            emit(text)

        return self._engine.admit(request, slow_emit, cancelled, on_decision)


async def harness(tiny_loaded, run, max_queue=16, pool=ReusePool(32, 10**9), step_s=0.0):
    engine = Engine(tiny_loaded, EngineOptions(16, 1), pool)
    engine = Slow(engine, step_s) if step_s else engine
    settings = Settings(server=ServerSettings(max_queue=max_queue, shutdown_grace_s=1.0))
    server = TestServer(make_app(settings, engine, "cpu", "float32"), host="127.0.0.1")
    await server.start_server()
    try:
        async with ClientSession(timeout=ClientTimeout(total=300)) as session:
            return await run(Api(str(server.make_url("")).rstrip("/"), session)), engine
    finally:
        await server.close()


async def test_soak_cut_streams_leave_nothing_behind(tiny_loaded, capsys):
    ok, engine = await harness(tiny_loaded, lambda api: soak(api, cuts=24, seed=3, long_lines=6))
    out = capsys.readouterr().out
    assert ok, out
    assert "queue back to 0 and nothing running: True" in out
    assert "parked before the soak, every 20 cuts and after: 6/6 exact" in out


async def test_overload_gets_429_with_retry_after_and_serves_everyone_in_order(tiny_loaded, capsys):
    # Clients 50 ms apart; each job takes 16 x 50 ms: the first still runs when the last arrives.
    ok, _ = await harness(tiny_loaded, lambda api: overload(api, clients=16, stagger_s=0.05), max_queue=4,
                          step_s=0.05)
    out = capsys.readouterr().out
    assert ok, out
    assert "every client served: 16/16" in out and "FIFO kept among the admitted: True" in out


async def test_churn_never_exceeds_the_byte_cap_seen_from_metrics(tiny_loaded, capsys):
    ok, engine = await harness(tiny_loaded, lambda api: churn(api, conversations=12, turns=2),
                               pool=ReusePool(64, 40_000))
    out = capsys.readouterr().out
    assert ok, out
    assert "cap exceeded: False" in out and "scrapes where pool != ledger: 0" in out
    assert engine.parking.pool.bytes_parked <= 40_000 and "evictions 0," not in out
