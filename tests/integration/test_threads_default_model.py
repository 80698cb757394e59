"""The decode steps give the same bits at 1 and 2 intra-op threads, so the thread count may
follow the CPU actually free (memrad.engine.team): the default model as served (bf16, int4),
the one-row and the batched step, eager and compiled, each request's every logit torch.equal."""

import pytest
import torch

import stories
from memrad.engine.model.loader import load_model
from memrad.request import GenerationRequest, SamplingParams

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def served():
    torch.set_num_threads(2)
    return load_model("default", device="cpu", dtype="auto")


def requests(engine, tag, count):
    text, ids = engine.chat.render([{"role": "user", "content": "Write a poem about the sea. " * 5}], None)
    return [GenerationRequest(f"{tag}{i}", engine.model_id, tuple(ids[: len(ids) - i]), text,
                              SamplingParams(temperature=0.0, max_tokens=16)) for i in range(count)]


def decode_at(engine, reqs, threads):
    """Prefill at 2 threads (prefill's bits depend on the count), decode at `threads`."""
    before = torch.get_num_threads()
    try:
        flights = [engine.admit(r, lambda _: None, lambda: False) for r in reqs]
        while any(f.phase == "prefill" for f in flights):
            torch.set_num_threads(2)
            engine.step()
        while any(f.completion is None and f.error is None for f in flights):
            torch.set_num_threads(threads)
            engine.step()
    finally:
        torch.set_num_threads(before)
    return [torch.stack(engine.scores[id(r.sampling)]) for r in reqs]


@pytest.mark.parametrize("compile", ["off", "auto"])
def test_one_row_and_batched_decode_give_the_same_bits_at_1_and_2_threads(served, compile):
    engine = stories.recording(stories.make_engine(served, 256, 2, pool=False, compile=compile, max_batch=4))
    engine.decoder.start()
    if compile == "auto":
        engine.decoder.wait()
        assert (engine.decoder.choice.value, engine.decoder.batch_choice.value) == ("compiled", "compiled")
    for count in (1, 3):  # alone: the one-row step; three together: the batched step
        two = decode_at(engine, requests(engine, f"two{count}-", count), 2)
        one = decode_at(engine, requests(engine, f"one{count}-", count), 1)
        assert all(torch.equal(a, b) for a, b in zip(one, two)), (compile, count)
