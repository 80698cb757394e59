"""The decode steps give the same bits at 1 and 2 intra-op threads, so the thread count may
follow the CPU actually free (memrad.engine.team): the default model as served (bf16, int4),
the one-row and the batched step, eager and compiled, each request's every logit torch.equal."""

import pytest
import torch

import stories
from memrad.request import GenerationRequest, SamplingParams

pytestmark = pytest.mark.integration




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


def torch_attention_varies_with_threads(dtype: torch.dtype) -> bool:
    """Whether torch's CPU attention (the eager step's under compile = off, over rows in the activations'
    dtype) gives other bits at 1 and 2 threads for one token's queries: fp32 on an AVX2-only EPYC
    (Zen 2) does, at every length tried."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 3, rows, 64, generator=g).to(dtype) for rows in (3, 300, 300))
    before, outs = torch.get_num_threads(), []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            outs.append(torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=0.125))
    finally:
        torch.set_num_threads(before)
    return not torch.equal(*outs)


@pytest.mark.parametrize("compile", ["off", "auto"])
def test_one_row_and_batched_decode_give_the_same_bits_at_1_and_2_threads(smol_served, compile):
    engine = stories.recording(stories.make_engine(smol_served, 256, 2, pool=False, compile=compile, max_batch=4))
    if not engine.decoder.feeder().kernel and torch_attention_varies_with_threads(smol_served.dtype):
        pytest.skip("torch's CPU attention gives other bits at 1 and 2 threads on this CPU: compile = off's eager "
                    "step on it keeps its bits only at one thread count here; memra's kernel (compile = auto / "
                    "on, and off over bf16 rows) keeps them at any")
    engine.decoder.start()
    if compile == "auto":
        engine.decoder.want_batch()  # as a second request would: built after the one-row step, whatever ran before
        engine.decoder.wait()
        assert (engine.decoder.choice.value, engine.decoder.batch_choice.value) == ("compiled", "compiled")
    for count in (1, 3):  # alone: the one-row step; three together: the batched step
        two = decode_at(engine, requests(engine, f"two{count}-", count), 2)
        one = decode_at(engine, requests(engine, f"one{count}-", count), 1)
        assert all(torch.equal(a, b) for a, b in zip(one, two)), (compile, count)


def prefill_at(engine, request, counts):
    """Run `request` with each prefill step at the next of `counts` (cycled) and decode at 2:
    every step's logits and the parked state's keys of layer 0."""
    before = torch.get_num_threads()
    try:
        flight = engine.admit(request, lambda _: None, lambda: False)
        steps = 0
        while flight.completion is None and flight.error is None:
            torch.set_num_threads(counts[steps % len(counts)] if flight.phase == "prefill" else 2)
            engine.step()
            steps += 1
    finally:
        torch.set_num_threads(before)
    state = engine.finished[-1]
    return torch.stack(engine.scores[id(request.sampling)]), state.cache.layers[0].keys[:, :, : state.prompt_checkpoint].clone()


def test_prefill_gives_the_same_bits_at_1_and_2_threads_so_its_count_may_follow_the_cpu(smol_served):
    """The default model's prefill chunks under memra's sliced products (memrad.engine.model.products):
    a 3-chunk prompt prefilled at 2 threads, at 1, and switching every chunk gives the same
    logits at every step and the same parked keys."""
    assert smol_served.products.choice.value == "sliced x2"
    engine = stories.recording(stories.make_engine(smol_served, 256, 2, pool=True, compile="off"))
    text, ids = engine.chat.render([{"role": "user", "content": "Tell me about the tides and the moon. " * 70}], None)
    assert 512 < len(ids) <= 768

    def request(tag):
        return GenerationRequest(tag, engine.model_id, tuple(ids), text, SamplingParams(temperature=0.0, max_tokens=3),
                                 cache_salt=tag)

    two = prefill_at(engine, request("two"), [2])
    for counts in ([1], [1, 2]):
        got = prefill_at(engine, request(f"at{counts}"), counts)
        assert torch.equal(got[0], two[0]) and torch.equal(got[1], two[1]), counts
