"""A cancel lands between decoder layers, mid-chunk (memrad.engine.interrupt): the chunk's rows
are rewound, the prefix of whole chunks is parked on the grid, and the retry resumes it and
answers what a cold run answers."""

import torch

import stories
from memrad.engine.interrupt import between_layers, decoder_layers
from memrad.request import GenerationRequest, SamplingParams

CHUNK = 16


def prompt(engine, rid):
    text, ids = engine.chat.render([{"role": "user", "content": "Read the file, then answer. " * 12}], None)
    return GenerationRequest(rid, engine.model_id, tuple(ids), text,
                             SamplingParams(temperature=0.0, max_tokens=6, logprobs=3))


def cancel_in_layer(model, layer, chunk_number):
    """A `cancelled` that turns true while decoder layer `layer` runs the `chunk_number`-th
    chunk (0-based): the next layer's check stops the chunk. Returns (cancelled, calls)."""
    state = {"runs": 0, "cancel": False}

    def hook(module, args):
        if state["runs"] == chunk_number:
            state["cancel"] = True
        state["runs"] += 1

    handle = decoder_layers(model)[layer].register_forward_pre_hook(hook)
    return (lambda: state["cancel"]), handle


def test_the_hooks_are_on_the_layers_only_while_a_chunk_runs(tiny_loaded):
    layers = decoder_layers(tiny_loaded.model)
    assert len(layers) == tiny_loaded.model.config.num_hidden_layers
    with between_layers(tiny_loaded.model, lambda: False):
        assert all(len(layer._forward_pre_hooks) == 1 for layer in layers)
    assert all(len(layer._forward_pre_hooks) == 0 for layer in layers)


def test_a_cancel_mid_chunk_parks_the_whole_chunks_before_it_and_the_retry_equals_cold(tiny_loaded):
    engine = stories.recording(stories.make_engine(tiny_loaded, CHUNK))
    first = prompt(engine, "first")
    assert len(first.prompt_ids) > 4 * CHUNK
    cancelled, handle = cancel_in_layer(tiny_loaded.model, 1, 2)  # in chunk [32, 48), at layer 1 of 2
    try:
        done = engine.generate(first, lambda _: None, cancelled)
    finally:
        handle.remove()
    assert (done.finish_reason, done.completion_tokens) == ("cancelled", 0)
    parked = engine.finished[-1]
    assert parked.prompt_checkpoint == 2 * CHUNK and parked.cache_token_ids == first.prompt_ids[: 2 * CHUNK]
    # layer 0 had written the interrupted chunk's rows: rewound with the others
    assert [layer.get_seq_length() for layer in parked.cache.layers] == [2 * CHUNK] * len(parked.cache.layers)

    retry = engine.generate(prompt(engine, "retry"), lambda _: None, lambda: False)
    assert retry.decision.render() == f"token-prefix: resumed (session s1; checkpoint {2 * CHUNK}; primed {len(first.prompt_ids) - 2 * CHUNK})"
    cold_engine = stories.recording(stories.make_engine(tiny_loaded, CHUNK, pool=False))
    cold = cold_engine.generate(prompt(cold_engine, "cold"), lambda _: None, lambda: False)
    assert retry.text == cold.text and retry.completion_tokens == cold.completion_tokens == 6
    assert retry.logprobs == cold.logprobs
    assert torch.equal(torch.stack(list(engine.scores.values())[-1]), torch.stack(list(cold_engine.scores.values())[-1]))


def test_a_cancel_before_any_chunk_ends_parks_nothing(tiny_loaded):
    engine = stories.make_engine(tiny_loaded, CHUNK)
    cancelled, handle = cancel_in_layer(tiny_loaded.model, 0, 0)
    try:
        done = engine.generate(prompt(engine, "first"), lambda _: None, cancelled)
    finally:
        handle.remove()
    assert done.finish_reason == "cancelled" and engine.stats().sessions == 0
