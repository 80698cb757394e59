"""`memrad bench concurrent`: its figures from replies (pure), and its agents against a real
server on a tiny batching engine, whose requests are on the model together."""

import asyncio

import pytest
from aiohttp.test_utils import TestServer

from memrad.bench.concurrent import Reply, agents_at_once, decoding_s, summarize
from memrad.config import ServerSettings, Settings
from memrad.server.app import make_app
from stories import make_engine


def test_aggregate_decode_counts_tokens_after_each_first_over_the_decoding_span():
    replies = [Reply(0.0, 1.0, 3.0, 100, 21, "a"), Reply(0.5, 2.0, 5.0, 120, 41, "b"), Reply(1.0, None, 1.2, 5, 0, "")]
    s = summarize(replies, wall_s=5.5)
    assert s.requests == 3 and s.completion_tokens == 62
    assert s.decode_tok_s == pytest.approx((20 + 40) / (5.0 - 1.0))
    assert (s.ttft_median_s, s.ttft_max_s, s.wall_s) == (pytest.approx(1.25), 1.5, 5.5)


def test_the_decoding_span_leaves_out_gaps_where_no_reply_decodes():
    # one agent's two turns: its second turn's prefill (3.0 -> 4.0) is not decode time
    turns = [Reply(0.0, 1.0, 3.0, 100, 21, "a"), Reply(3.1, 4.0, 6.0, 150, 21, "b")]
    assert decoding_s(turns) == pytest.approx(4.0)
    assert summarize(turns, wall_s=6.0).decode_tok_s == pytest.approx(40 / 4.0)
    nested = [Reply(0.0, 1.0, 5.0, 1, 2, "a"), Reply(0.0, 2.0, 3.0, 1, 2, "b"), Reply(0.0, 4.5, 7.0, 1, 2, "c")]
    assert decoding_s(nested) == pytest.approx(6.0)


async def test_agents_at_once_are_served_together_by_a_batching_engine(tiny_loaded):
    engine = make_engine(tiny_loaded, 16, max_batch=4)
    admitted_together = []
    step = engine.step

    def counting_step():
        admitted_together.append(len(engine.flights))
        return step()

    engine.step = counting_step
    settings = Settings(server=ServerSettings(max_queue=4, max_batch=4, shutdown_grace_s=1.0))
    server = TestServer(make_app(settings, engine, "cpu", "float32"), host="127.0.0.1")
    await server.start_server()
    try:
        import openai

        client = openai.OpenAI(base_url=str(server.make_url("/v1")), api_key="unused", max_retries=0)
        result = await asyncio.to_thread(agents_at_once, client, 3, 2, 12, "ok")
    finally:
        await server.close()
    assert result.requests == 6 and result.completion_tokens > 0
    assert result.ttft_max_s is not None and result.decode_tok_s is not None
    assert max(admitted_together) >= 2  # the agents' requests were in flight at once
