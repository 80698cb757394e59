"""No prefill done twice, on the default model as the daemon serves it (bf16, int4, max_batch 4):
a request cancelled at a chunk boundary or mid-chunk parks the whole chunks it primed; a retry
resumes exactly from them, or, sent while the first still prefills, waits and forks its state;
every reply equals a cold one, tokens and logprobs bit for bit."""

import pytest
import torch

import stories
from memrad.engine.interrupt import decoder_layers
from memrad.request import GenerationRequest, SamplingParams

pytestmark = pytest.mark.integration

CHUNK = 64




def request(engine, rid):
    messages = [{"role": "system", "content": "You are a helpful coding assistant."},
                {"role": "user", "content": "Explain what this does:\n" + "def add(a, b):\n    return a + b\n" * 24}]
    text, ids = engine.chat.render(messages, None)
    return GenerationRequest(rid, engine.model_id, tuple(ids), text,
                             SamplingParams(temperature=0.0, max_tokens=8, logprobs=2))


def engine_for(loaded, pool=True):
    return stories.recording(stories.make_engine(loaded, CHUNK, 2, pool=pool, max_sessions=8, max_bytes=2**31,
                                                 max_batch=4))


def run(engine, req, cancelled=lambda: False):
    flight = engine.admit(req, lambda _: None, cancelled)
    while flight.completion is None and flight.error is None:
        engine.step()
    return flight


@pytest.fixture(scope="module")
def cold(smol_served):
    engine = engine_for(smol_served, pool=False)
    flight = run(engine, request(engine, "cold"))
    return flight.completion, torch.stack(engine.scores[id(flight.request.sampling)])


def assert_equals_cold(engine, flight, cold):
    completion, scores = cold
    assert flight.completion.text == completion.text and flight.completion.logprobs == completion.logprobs
    assert torch.equal(torch.stack(engine.scores[id(flight.request.sampling)]), scores)


@pytest.mark.parametrize("where", ["boundary", "mid-chunk"])
def test_a_retry_resumes_exactly_what_the_cancelled_prefill_parked(smol_served, cold, where):
    engine = engine_for(smol_served)
    engine.decoder.batch_step(4)  # built now: its bit check's scratch prefill runs the layers too
    first = request(engine, "first")
    n = len(first.prompt_ids)
    assert n > 5 * CHUNK
    state = {"layer_runs": 0}
    layers = decoder_layers(smol_served.model)
    hook = layers[12].register_forward_pre_hook(lambda m, a: state.__setitem__("layer_runs", state["layer_runs"] + 1))
    if where == "boundary":  # cancelled once 3 chunks ran: noticed before the 4th starts
        cancelled = lambda: state["layer_runs"] >= 3 and engine.flights[0].pre.primed_to == 3 * CHUNK  # noqa: E731
    else:  # cancelled as layer 12 of the 4th chunk starts: its check stops the chunk there
        cancelled = lambda: state["layer_runs"] >= 4  # noqa: E731
    try:
        stopped = run(engine, first, cancelled)
    finally:
        hook.remove()
    assert stopped.completion.finish_reason == "cancelled"
    assert state["layer_runs"] == (3 if where == "boundary" else 4)
    parked = engine.finished[-1]
    assert parked.prompt_checkpoint == 3 * CHUNK
    assert {layer.get_seq_length() for layer in parked.cache.layers} == {3 * CHUNK}
    retry = run(engine, request(engine, "retry"))
    assert retry.completion.decision.render() == (
        f"token-prefix: resumed (session s1; checkpoint {3 * CHUNK}; primed {n - 3 * CHUNK})")
    assert_equals_cold(engine, retry, cold)


def test_a_retry_sent_while_the_first_prefills_forks_it_and_both_equal_cold(smol_served, cold):
    engine = engine_for(smol_served)
    first, retry = request(engine, "first"), request(engine, "retry")
    n = len(first.prompt_ids)
    one = engine.admit(first, lambda _: None, lambda: False)
    engine.step(), engine.step()
    waited = 0
    while engine.holds(retry):
        waited += 1
        engine.step()
    two = engine.admit(retry, lambda _: None, lambda: False)
    while one.completion is None or two.completion is None:
        engine.step()
    target = (n - 1) // CHUNK * CHUNK
    assert waited == target // CHUNK - 2
    assert two.completion.decision.render() == (
        f"live: resumed (attached to a running prefill at {2 * CHUNK} of {n} (first); forked at {target}; "
        f"primed {n - target})")
    assert_equals_cold(engine, one, cold)
    assert_equals_cold(engine, two, cold)
