"""The default model as the daemon serves it (bf16, int4 weights, max_batch 4): three requests
of different lengths, one resumed from a parked turn, decode the same bits alone and batched
(every step's logits, torch.equal), and the resumed one equals its cold run."""

import pytest
import torch

import stories
from memrad.request import GenerationRequest, SamplingParams

pytestmark = pytest.mark.integration

CHUNK = 256
SYSTEM = {"role": "system", "content": "You are a helpful coding assistant."}




def request(engine, messages, rid, max_tokens=8):
    text, ids = engine.chat.render(messages, None)
    return GenerationRequest(rid, engine.model_id, tuple(ids), text,
                             SamplingParams(temperature=0.0, max_tokens=max_tokens))


def turns(engine, first_reply):
    first = [SYSTEM, {"role": "user", "content": "Write a Python function that reverses a list."}]
    return [request(engine, first + [{"role": "assistant", "content": first_reply},
                                     {"role": "user", "content": "Now make it work on strings too."}], "resumed"),
            request(engine, [SYSTEM, {"role": "user", "content": "What is 2 + 2?"}], "short", max_tokens=6),
            request(engine, [SYSTEM, {"role": "user", "content": "Explain recursion. " * 40}], "long", max_tokens=10)]


def served(loaded):
    """An engine like the daemon's (batched, pool on) holding the first turn parked."""
    engine = stories.recording(stories.make_engine(loaded, CHUNK, 2, max_sessions=8, max_bytes=2**31, max_batch=4))
    first = [SYSTEM, {"role": "user", "content": "Write a Python function that reverses a list."}]
    done = stories.run_together(engine, [request(engine, first, "first", max_tokens=12)])["first"]
    return engine, done[0].text


def test_batched_requests_decode_the_bits_they_decode_alone(smol_served):
    engine, reply = served(smol_served)
    assert engine.runtime_choices["batch"]["value"] == "batched, 4 rows"
    together = stories.run_together(engine, turns(engine, reply))
    assert together["resumed"][0].decision.outcome == "resumed", together["resumed"][0].decision.render()
    for index, rid in enumerate(("resumed", "short", "long")):
        alone_engine, alone_reply = served(smol_served)
        assert alone_reply == reply
        alone = stories.run_together(alone_engine, [turns(alone_engine, reply)[index]])[rid]
        assert together[rid][1].generated_ids == alone[1].generated_ids, rid
        assert torch.equal(together[rid][1].prompt_logits, alone[1].prompt_logits), rid
        assert torch.equal(together[rid][2], alone[2]), rid
    cold_engine = stories.recording(stories.make_engine(smol_served, CHUNK, 2, pool=False, max_batch=4))
    cold = stories.run_together(cold_engine, [turns(cold_engine, reply)[0]])["resumed"]
    assert cold[0].cached_tokens == 0 and together["resumed"][0].cached_tokens > 0
    assert together["resumed"][1].generated_ids == cold[1].generated_ids
    assert torch.equal(together["resumed"][2], cold[2])


def test_compiled_one_row_and_batched_steps_give_a_request_the_same_bits(smol_served):
    # As the daemon decodes once compiled: a request alone on the compiled one-row step, beside
    # others on the compiled 4-row step (both AOTInductor packages, memrad pull builds them)
    def compiled():
        engine = stories.recording(stories.make_engine(smol_served, CHUNK, 2, max_sessions=8, max_bytes=2**31,
                                                       max_batch=4, compile="auto"))
        engine.decoder.start()
        engine.decoder.wait()
        engine.decoder.want_batch()  # as a second request would (built once, if `memrad pull` has not)
        engine.decoder.wait()
        assert (engine.decoder.choice.value, engine.decoder.batch_choice.value) == ("compiled", "compiled")
        assert engine.decoder.batch_step(4).alone is not None
        return engine

    engine = compiled()
    together = stories.run_together(engine, turns(engine, "def reverse(xs): return xs[::-1]"))
    for index, rid in enumerate(("resumed", "short", "long")):
        alone_engine = compiled()
        alone = stories.run_together(alone_engine, [turns(alone_engine, "def reverse(xs): return xs[::-1]")[index]])[rid]
        assert together[rid][1].generated_ids == alone[1].generated_ids, rid
        assert torch.equal(together[rid][2], alone[2]), rid
