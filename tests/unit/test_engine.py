import dataclasses

import pytest
import torch

from memrad.chat.detokenize import IncrementalDetokenizer
from memrad.engine.engine import Engine, EngineOptions
from memrad.engine.forward import cache_length, prefill
from memrad.grid import canonical_chunks, find_anchors, grid_chunks
from memrad.request import GenerationRequest, SamplingParams
from stories import make_engine

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


def request_for(engine, text="Read the file, then answer. def add(a, b): return a + b", **sampling):
    rendered, ids = engine.chat.render([{"role": "user", "content": text}], None)
    params = dataclasses.replace(GREEDY, **sampling)
    return GenerationRequest(request_id="r1", model=engine.model_id, prompt_ids=tuple(ids),
                             prompt_text=rendered, sampling=params)


def run(engine, request, cancelled=lambda: False):
    deltas = []
    completion = engine.generate(request, deltas.append, cancelled)
    return completion, deltas


def prompt_ids(n, vocab, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def test_prefill_cuts_chunks_at_absolute_grid_positions(tiny_engine):
    model = tiny_engine.loaded.model
    seen = []
    handle = model.register_forward_pre_hook(
        lambda mod, args, kwargs: seen.append(tuple(kwargs["position_ids"][0, [0, -1]].tolist())),
        with_kwargs=True)
    try:
        ids = prompt_ids(70, tiny_engine.chat.vocab_size)
        cache = tiny_engine.new_cache()
        prefill(model, cache, ids[:21], 0, 16)
        prefill(model, cache, ids[21:], 21, 16)
    finally:
        handle.remove()
    expected = grid_chunks(0, 21, 16) + grid_chunks(21, 70, 16)
    assert seen == [(a, b - 1) for a, b in expected]
    assert expected == [(0, 16), (16, 21), (21, 32), (32, 48), (48, 64), (64, 70)]
    assert cache_length(cache) == 70


def test_grid_prefill_equals_a_whole_prompt_forward_split_at_the_same_positions(tiny_engine):
    model = tiny_engine.loaded.model
    ids = prompt_ids(70, tiny_engine.chat.vocab_size)
    cache = tiny_engine.new_cache()
    grid_logits = prefill(model, cache, ids, 0, 16)

    manual = tiny_engine.new_cache()
    with torch.inference_mode():
        for a, b in ((0, 16), (16, 32), (32, 48), (48, 64), (64, 70)):
            out = model(input_ids=torch.tensor([ids[a:b]]), position_ids=torch.arange(a, b)[None],
                        cache=manual, use_cache=True, logits_to_keep=1)
    assert torch.equal(grid_logits, out.logits[0, -1].float())
    for layer, other in zip(cache.layers, manual.layers):
        assert torch.equal(layer.keys, other.keys) and torch.equal(layer.values, other.values)


def test_a_resume_from_a_grid_point_reproduces_the_cold_logits_bit_for_bit(tiny_engine):
    model = tiny_engine.loaded.model
    ids = prompt_ids(70, tiny_engine.chat.vocab_size)
    cold = prefill(model, tiny_engine.new_cache(), ids, 0, 16)
    cache = tiny_engine.new_cache()
    prefill(model, cache, ids[:32], 0, 16)
    resumed = prefill(model, cache, ids[32:], 32, 16)
    assert torch.equal(cold, resumed)


def test_greedy_generation_is_deterministic_and_stops_at_max_tokens(tiny_engine):
    first, deltas = run(tiny_engine, request_for(tiny_engine))
    second, _ = run(tiny_engine, request_for(tiny_engine))
    assert first.text == second.text and "".join(deltas) == first.text
    assert (first.finish_reason, first.completion_tokens) == ("length", 12)
    assert first.prompt_tokens == len(request_for(tiny_engine).prompt_ids)
    assert first.cached_tokens == 0 and first.ttft_s is not None


def test_seeded_sampling_reproduces_and_different_seeds_differ(tiny_engine):
    a, _ = run(tiny_engine, request_for(tiny_engine, temperature=1.0, seed=7, max_tokens=20))
    b, _ = run(tiny_engine, request_for(tiny_engine, temperature=1.0, seed=7, max_tokens=20))
    c, _ = run(tiny_engine, request_for(tiny_engine, temperature=1.0, seed=8, max_tokens=20))
    assert a.text == b.text
    assert a.text != c.text


def test_top_p_near_zero_is_greedy(tiny_engine):
    greedy, _ = run(tiny_engine, request_for(tiny_engine))
    nucleus, _ = run(tiny_engine, request_for(tiny_engine, temperature=1.0, top_p=1e-6, seed=3))
    assert nucleus.text == greedy.text


def test_a_stop_string_truncates_the_output_and_is_not_sent(tiny_engine):
    full, _ = run(tiny_engine, request_for(tiny_engine, max_tokens=30))
    stop = full.text[len(full.text) // 2 : len(full.text) // 2 + 2]
    cut = full.text.index(stop)
    stopped, deltas = run(tiny_engine, request_for(tiny_engine, max_tokens=30, stop=(stop,)))
    assert stopped.text == full.text[:cut] == "".join(deltas)
    assert stopped.finish_reason == "stop"


def test_eos_ends_generation_without_being_counted_or_sent(tiny_loaded):
    engine = make_engine(tiny_loaded, 16, pool=False)
    parked = engine.finished
    run(engine, request_for(engine))
    third = parked[0].generated_ids[2]
    assert third not in parked[0].generated_ids[:2]
    eos_engine = Engine(dataclasses.replace(tiny_loaded, eos_ids=frozenset({third})), EngineOptions(16, 1))
    done, _ = run(eos_engine, request_for(eos_engine))
    assert (done.finish_reason, done.completion_tokens) == ("stop", 2)


def test_cancellation_stops_within_one_decode_step(tiny_engine):
    polls = []
    req = request_for(tiny_engine, max_tokens=200)
    chunks = len(canonical_chunks(0, req.num_prompt_tokens, 16, find_anchors(req.prompt_ids, tiny_engine.reply_header)))
    # prefill polls once per chunk and once before each decoder layer (memrad.engine.interrupt),
    # then once per decode step
    polls_before_decode = chunks * (1 + tiny_engine.loaded.model.config.num_hidden_layers)

    def cancelled():
        polls.append(1)
        return len(polls) > polls_before_decode + 3

    done, _ = run(tiny_engine, req, cancelled)
    assert done.finish_reason == "cancelled"
    assert done.completion_tokens == len(polls) - polls_before_decode


def test_cancelled_during_prefill_generates_nothing(tiny_engine):
    done, deltas = run(tiny_engine, request_for(tiny_engine), cancelled=lambda: True)
    assert (done.finish_reason, done.completion_tokens, done.text, deltas) == ("cancelled", 0, "", [])


def test_the_finished_state_reaches_the_hook_with_the_prompt_checkpoint(tiny_loaded):
    engine = make_engine(tiny_loaded, 16, pool=False)
    parked = engine.finished
    req = request_for(engine, max_tokens=5)
    done, _ = run(engine, req)
    (state,) = parked
    prompt_len = req.num_prompt_tokens
    assert state.prompt_checkpoint == prompt_len
    # max_tokens ends before the 5th token is fed back: 4 generated tokens are in the cache.
    assert cache_length(state.cache) == prompt_len + 4
    assert state.cache_token_ids == req.prompt_ids + state.generated_ids[:4]
    assert len(state.generated_ids) == 5
    assert state.committed_text == req.prompt_text + done.text
    assert state.completion == done


def test_one_token_reply_never_feeds_the_first_generated_token(tiny_loaded):
    engine = make_engine(tiny_loaded, 16, pool=False)
    parked = engine.finished
    req = request_for(engine, max_tokens=1)
    run(engine, req)
    assert cache_length(parked[0].cache) == req.num_prompt_tokens == parked[0].prompt_checkpoint


def test_max_tokens_defaults_to_the_rest_of_the_context(tiny_engine):
    req = request_for(tiny_engine, max_tokens=None)
    long_prompt = dataclasses.replace(req, prompt_ids=tuple(prompt_ids(1024 - 3, tiny_engine.chat.vocab_size)))
    done, _ = run(tiny_engine, long_prompt)
    assert done.completion_tokens <= 3
    assert done.prompt_tokens + done.completion_tokens <= tiny_engine.context_len


@pytest.mark.parametrize("text", ["hi 東京 🙂 naïve café", "def add(a, b):\n    return a + b\n"])
def test_incremental_detokenization_reassembles_multibyte_text(tiny_engine, text):
    tokenizer = tiny_engine.loaded.tokenizer
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.push(i) for i in ids] + [detok.flush()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
