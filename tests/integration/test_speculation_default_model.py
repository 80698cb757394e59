"""The default model (bf16, int4 weights) on the eager steps (compile = off) and on the compiled
steps the daemon serves (compile = auto, max_batch 4, the packages open): a file-rewrite reply, a
fresh reply and a JSON reply under a grammar decode the same bits with speculate = auto as with
speculate = off (tokens, text, finish reason, usage, logprobs and every step's logits,
torch.equal), alone and beside other requests, and the rewrite keeps drafts (its acceptance is
in the record)."""

from dataclasses import replace

import pytest
import torch

import stories
from memrad.chat.grammar import json_constraint
from memrad.bench.speculation import fresh_messages, rewrite_messages
from memrad.request import GenerationRequest, SamplingParams

pytestmark = pytest.mark.integration

CHUNK = 256




def request(engine, messages, rid, max_tokens):
    text, ids = engine.chat.render(messages, None)
    return GenerationRequest(rid, engine.model_id, tuple(ids), text,
                             SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=1))


def outcome(result):
    completion, state, scores = result
    return (completion.text, completion.finish_reason, completion.prompt_tokens, completion.completion_tokens,
            tuple((lp.token, lp.logprob, lp.top) for lp in completion.logprobs), state.generated_ids,
            state.cache.layers[0].get_seq_length())


def runs(loaded, make, max_batch=1):
    out = {}
    for arm in ("off", "auto"):
        engine = stories.recording(stories.make_engine(loaded, CHUNK, 2, pool=False, max_batch=max_batch,
                                                       speculate=arm))
        out[arm] = stories.run_together(engine, make(engine))
    return out


def assert_same(out):
    for rid, plain in out["off"].items():
        spec = out["auto"][rid]
        assert outcome(spec) == outcome(plain), rid
        assert torch.equal(spec[2], plain[2]), rid


def test_a_rewrite_and_a_fresh_reply_are_plain_decodings_bits(smol_served):
    out = runs(smol_served, lambda e: [request(e, rewrite_messages(), "rewrite", 64)])
    assert_same(out)
    spec = out["auto"]["rewrite"][0].speculation
    assert spec.on and spec.reason == "on the eager step, up to 8 drafted", spec
    assert spec.accepted_tokens > 0 and spec.decode_steps < out["auto"]["rewrite"][0].completion_tokens - 1, spec
    out = runs(smol_served, lambda e: [request(e, fresh_messages(), "fresh", 32)])
    assert_same(out)


def test_beside_other_requests_the_bits_are_the_same(smol_served):
    out = runs(smol_served, lambda e: [request(e, rewrite_messages(), "rewrite", 40),
                                       request(e, fresh_messages(), "fresh", 24),
                                       request(e, [{"role": "user", "content": "What is 2 + 2?"}], "short", 8),
                                       request(e, [{"role": "user", "content": "Name three colours."}], "colours", 12)],
               max_batch=4)
    assert_same(out)
    assert out["auto"]["rewrite"][0].speculation.reason == ("on the eager batched step of 8 rows, up to 7 drafted in "
                                                            "the rows its neighbours leave")


JSON = '{"name": "order-book", "version": "1.4.2", "files": ["book.py", "orders.py", "prices.py"], "strict": true}'


def compiled_engine(loaded, speculate):
    """As the daemon decodes once compiled (max_batch 4, the one-row and batched packages open: 2, 4
    and, with speculation on, 8 rows; built once into the cache if `memrad pull` has not)."""
    engine = stories.recording(stories.make_engine(loaded, CHUNK, 2, pool=False, max_batch=4, compile="auto",
                                                   speculate=speculate))
    engine.decoder.start()
    engine.decoder.wait()
    engine.decoder.want_batch()
    engine.decoder.wait()
    assert (engine.decoder.choice.value, engine.decoder.batch_choice.value) == ("compiled", "compiled")
    return engine


def test_on_the_compiled_steps_replies_alone_and_beside_others_with_a_grammar_are_plain_decodings_bits(smol_served):
    def requests(engine):
        grammar = request(engine, [{"role": "user", "content": f"Give me this JSON back exactly:\n{JSON}"}], "json", 40)
        grammar = replace(grammar, sampling=replace(grammar.sampling,
                                                    constraint=json_constraint(None, "response_format")))
        return [request(engine, rewrite_messages(), "rewrite", 64), request(engine, fresh_messages(), "fresh", 32),
                grammar, request(engine, [{"role": "user", "content": "What is 2 + 2?"}], "short", 8)]

    out = {}
    for arm in ("off", "auto"):
        engine = compiled_engine(smol_served, arm)
        alone = {f"{r.request_id}-alone": stories.run_together(engine, [r])[r.request_id]
                 for r in requests(engine)[:3]}
        out[arm] = {**alone, **stories.run_together(engine, requests(engine))}
    assert_same(out)
    rewrite = out["auto"]["rewrite-alone"][0]
    assert rewrite.decision.step == "compiled"
    assert rewrite.speculation.reason == ("on the compiled batched step of 8 rows, up to 7 drafted in the rows its "
                                          "neighbours leave"), rewrite.speculation
    assert rewrite.speculation.accepted_tokens > 0
    assert out["auto"]["json-alone"][0].speculation.verify_steps > 0  # drafts offered through the grammar's mask
