"""/metrics after real requests: every number checked against what the requests did."""

import aiohttp
from aiohttp.test_utils import TestServer

from memrad.config import ServerSettings, Settings
from memrad.engine.engine import Engine, EngineOptions
from memrad.protocol import Decision, DecisionEvent, EvictEvent, ParkEvent, SessionInfo
from memrad.reuse.pool import ReusePool
from memrad.server.app import make_app
from memrad.server.metrics import Metrics, parse_samples

USER = [{"role": "user", "content": "Read the file, then answer."}]


samples = parse_samples


def session_info(session_id: str, num_bytes: int) -> SessionInfo:
    return SessionInfo(session_id, None, None, "m", None, 10, 8, 8, (), num_bytes, 0.0, 0, ())


def test_the_ledger_follows_parks_replacements_and_evictions_and_two_apps_do_not_collide():
    a, b = Metrics(), Metrics()
    a.observe(ParkEvent(0.0, session_info("s1", 100), None))
    a.observe(ParkEvent(0.0, session_info("s2", 50), None))
    a.observe(ParkEvent(0.0, session_info("s3", 70), "s1"))   # s3 replaces s1
    a.observe(EvictEvent(0.0, "s2", 10, 50))
    spilled = SessionInfo("s4", None, None, "m", None, 10, 8, 8, (), 30, 0.0, 0, (), on_disk=True)
    a.observe(ParkEvent(0.0, session_info("s4", 30), None))
    a.observe(ParkEvent(0.0, spilled, "s4"))  # the memory cap spilled s4 to the disk tier
    a.observe(DecisionEvent(0.0, Decision("r", "declined", "x", 0, 5, tier="affinity",
                                          reason_class="named-vs-unnamed"), 5, None, ()))
    assert a.ledger_bytes() == 70 and b.ledger_bytes() == 0
    got = samples(a.exposition().decode())
    assert got[("memra_parks_total", ())] == 4 and got[("memra_evictions_total", ())] == 1
    assert got[("memra_spills_total", ())] == 1
    assert got[("memra_declines_total", (("reason_class", "named-vs-unnamed"),))] == 1
    assert got[("memra_decisions_total", (("outcome", "declined"), ("tier", "affinity")))] == 1
    assert samples(b.exposition().decode())[("memra_parks_total", ())] == 0


async def test_metrics_are_scraped_with_real_values_after_real_requests(tiny_loaded):
    engine = Engine(tiny_loaded, EngineOptions(16, 1), ReusePool(8, 10**9))
    settings = Settings(server=ServerSettings(shutdown_grace_s=1.0))
    server = TestServer(make_app(settings, engine, "cpu", "float32"), host="127.0.0.1")
    await server.start_server()
    url = server.make_url("/v1/chat/completions")
    usages = []
    try:
        async with aiohttp.ClientSession() as session:
            body = {"messages": USER, "max_tokens": 6, "temperature": 0}
            async with session.post(url, json=body) as resp:
                first = await resp.json()
            usages.append(first["usage"])
            body["messages"] = USER + [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                                       {"role": "user", "content": "and then?"}]
            async with session.post(url, json=body) as resp:
                usages.append((await resp.json())["usage"])
            async with session.post(url, json={"messages": []}) as resp:
                assert resp.status == 400
            async with session.get(server.make_url("/nope")) as resp:
                assert resp.status == 404
            async with session.get(server.make_url("/metrics")) as resp:
                assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/plain; version=")
                got = samples(await resp.text())
    finally:
        await server.close()

    route = (("method", "POST"), ("route", "/v1/chat/completions"))
    assert got[("memra_http_requests_total", (*route[:1], route[1], ("status", "200")))] == 2
    assert got[("memra_http_requests_total", (*route[:1], route[1], ("status", "400")))] == 1
    assert got[("memra_http_requests_total", (("method", "GET"), ("route", "unmatched"), ("status", "404")))] == 1
    assert got[("memra_http_request_duration_seconds_count", (("route", "/v1/chat/completions"),))] == 3
    assert got[("memra_tokens_total", (("kind", "prompt"),))] == sum(u["prompt_tokens"] for u in usages)
    assert got[("memra_tokens_total", (("kind", "completion"),))] == 12
    cached = usages[1]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0 and got[("memra_tokens_total", (("kind", "cached"),))] == cached
    assert got[("memra_ttft_seconds_count", ())] == 2 and got[("memra_ttft_seconds_sum", ())] > 0
    assert got[("memra_prefill_tokens_per_second_count", ())] == 2
    assert got[("memra_decode_tokens_per_second_count", ())] == 2
    assert got[("memra_decisions_total", (("outcome", "cold"), ("tier", "none")))] == 1
    resumed = [v for (name, labels), v in got.items()
               if name == "memra_decisions_total" and ("outcome", "resumed") in labels]
    assert resumed == [1]
    assert got[("memra_declines_total", (("reason_class", "nothing-parked"),))] == 1
    (parked,) = engine.parking.pool.sessions()
    assert got[("memra_pool_sessions", (("tier", "memory"),))] == 1
    assert got[("memra_pool_bytes", (("tier", "memory"),))] == parked.num_bytes == got[("memra_pool_bytes_ledger", ())]
    assert got[("memra_pool_max_bytes", ())] == 10**9
    assert got[("memra_queue_depth", ())] == 0 and got[("memra_running_requests", ())] == 0
    assert got[("process_resident_memory_bytes", ())] > 10**7


async def test_a_client_gone_before_its_answer_is_counted_as_499_not_an_internal_error(caplog):
    caplog.set_level("INFO", logger="memrad.server")
    from memrad.server.app import openai_errors

    class Request:
        path, method = "/v1/chat/completions", "POST"

    async def handler(request):
        raise ConnectionResetError("Cannot write to closing transport")  # what prepare() raised

    response = await openai_errors(Request(), handler)
    assert response.status == 499
    assert "internal error" not in caplog.text and "client left before the answer" in caplog.text


async def test_a_stream_whose_generation_fails_after_its_200_is_counted_as_500():
    from fake_engine import FakeEngine

    class Failing(FakeEngine):
        def generate(self, request, emit, cancelled, on_decision=None):
            emit("partial")
            raise RuntimeError("the model broke")

    server = TestServer(make_app(Settings(), Failing(), "cpu", "float32"), host="127.0.0.1")
    await server.start_server()
    try:
        async with aiohttp.ClientSession() as session:
            body = {"messages": USER, "max_tokens": 6, "stream": True}
            async with session.post(server.make_url("/v1/chat/completions"), json=body) as resp:
                assert resp.status == 200
                assert b"generation failed: the model broke" in await resp.read()
            async with session.get(server.make_url("/metrics")) as resp:
                got = samples(await resp.text())
    finally:
        await server.close()
    counted = {dict(labels)["status"]: value for (name, labels), value in got.items()
               if name == "memra_http_requests_total" and dict(labels)["route"] == "/v1/chat/completions"}
    assert counted == {"500": 1.0}


def test_speculation_figures_are_counted_from_finished_turns():
    from memrad.protocol import Speculation, TurnEvent

    m = Metrics()
    spec = Speculation(True, "on the eager step, up to 8 drafted", 40, 30, 6, 12, 42)
    m.observe(TurnEvent(0.0, "r1", None, None, 10, 0, 43, 0.1, "cold", "length", 1.0, speculation=spec))
    m.observe(TurnEvent(0.0, "r2", None, None, 10, 0, 5, 0.1, "cold", "length", 1.0,
                        speculation=Speculation(False, "speculate = off")))
    got = samples(m.exposition().decode())
    assert got[("memra_draft_tokens_total", (("kind", "drafted"),))] == 40
    assert got[("memra_draft_tokens_total", (("kind", "accepted"),))] == 30
    assert got[("memra_decode_steps_total", (("kind", "verify"),))] == 6
    assert got[("memra_decode_steps_total", (("kind", "plain"),))] == 6
