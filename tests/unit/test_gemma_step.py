"""Gemma 3 on the decode step, on a tiny random Gemma 3 (window of 8 tokens, one global layer of
four, two rope bases, q/k norms with random +1 weights, final soft-cap).

Its WindowLayers prefill exactly as transformers' sliding layers do; the step decodes what
transformers' forward decodes long past the window (fp32 tight, bf16 within rounding); the
compiled step (one AOTInductor graph, memra's kernel over the window views) computes what the
eager one computes, and a compiled engine resumes turns bit-identically to their cold runs.
The batched step (memrad.engine.decode.batch) runs Gemma's rows too: in bf16, float weights and
on the int4 kernel, a request's row is the same bits beside any neighbours and alone, and the
one-row step's, step after step past the window (each row attends its own window view); two
requests in flight on an engine of max_batch 2 decode the tokens each decodes alone; compiled,
the batched package gives a row the compiled one-row step's bits and resumed turns equal cold.
Boundary snapshots and the disk tier are covered with the other kinds (test_reuse,
test_disk: "gemma3").
"""

import pytest
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicSlidingWindowLayer

from memrad.engine.decode import decoder as decoder_module
from memrad.engine.decode.decoder import Decoder
from memrad.engine.decode.steps.gemma import GemmaStep
from memrad.engine.decode.package import PackagedStep
from memrad.engine.engine import Engine, EngineOptions
from memrad.engine.forward import decode_one_token, prefill
from memrad.engine.model.loader import load_model
from memrad.engine.state.window import WindowLayer, buffer_rows
from test_batching import _counting_graph, request, rows_are_their_own
from test_batching import conversation as chat
from test_reuse import conversation
from stories import make_engine, recording, run_together
from tiny import write_q4_folder

WINDOW = 8  # tests/unit/tiny.py: build_gemma3
PROMPT = list(range(5, 25))  # 20 tokens: past the window before the first step


def fresh(tiny_dir, dtype="float32", kv="auto"):
    torch.set_num_threads(1)
    return load_model(str(tiny_dir("gemma3")), device="cpu", dtype=dtype, kv_dtype=kv)


@pytest.fixture(scope="module")
def q4_gemma_dir(tmp_path_factory):
    """The tiny Gemma 3 as a GGUF's blocks: Q4_1 layers, a tied Q8_0 head (tiny.write_q4_folder)."""
    return write_q4_folder(tmp_path_factory.mktemp("tiny-gemma3-q4"), "gemma3")


@pytest.fixture(params=["float", "int4"])
def bf16_gemma(request, tiny_dir, q4_gemma_dir):
    """The tiny Gemma 3 in bf16, with float weights and on the int4 kernel."""
    torch.set_num_threads(1)
    if request.param == "float":
        return load_model(str(tiny_dir("gemma3")), device="cpu", dtype="bfloat16")
    loaded = load_model(str(q4_gemma_dir), device="cpu", dtype="bfloat16", weights="int4")
    assert loaded.weights.value == "int4"
    return loaded


def test_a_window_layer_prefills_exactly_as_transformers_sliding_layer():
    torch.manual_seed(0)
    ours, theirs = WindowLayer(WINDOW), DynamicSlidingWindowLayer(WINDOW)
    for rows in (3, 1, 5, 2 * WINDOW + 3, 1, 4, WINDOW):  # appends in place, and chunks past the buffer
        k, v = torch.randn(1, 2, rows, 4), torch.randn(1, 2, rows, 4)
        for a, b in zip(ours.update(k, v), theirs.update(k, v)):
            assert torch.equal(a, b)
        assert torch.equal(ours.keys, theirs.keys) and torch.equal(ours.values, theirs.values)
        assert ours.get_seq_length() == theirs.get_seq_length()
        assert ours.get_mask_sizes(1) == theirs.get_mask_sizes(1)
    assert ours.slab.capacity == buffer_rows(WINDOW) and ours.keys.shape[-2] == WINDOW - 1
    with pytest.raises(ValueError, match="cannot be cut back"):
        ours.crop(-1)


@pytest.mark.parametrize("dtype,tolerance", [("float32", 1e-5), ("bfloat16", 0.0625)])
def test_the_gemma_step_decodes_what_transformers_decodes_past_the_window(tiny_dir, dtype, tolerance):
    loaded = fresh(tiny_dir, dtype, kv="activations")  # transformers' rows (bf16 rows under fp32: test_kv_dtype)
    chosen = Decoder(loaded.model, loaded.context_len, loaded.device)
    assert isinstance(chosen.step, GemmaStep)
    assert (chosen.choice.value, chosen.choice.reason) == ("eager", "compile = off: torch's attention")
    feed = chosen.feeder()
    ours, theirs = Engine(loaded, EngineOptions(16, 1)).new_cache(), DynamicCache(config=loaded.model.config)
    assert [type(layer).__name__ for layer in ours.layers] == ["WindowLayer", "WindowLayer", "SlabLayer", "WindowLayer"]
    a = prefill(loaded.model, ours, PROMPT, 0, 16)
    b = prefill(loaded.model, theirs, PROMPT, 0, 16)
    assert torch.equal(a, b)  # WindowLayers leave prefill's bits alone
    for step in range(3 * WINDOW):  # the window's buffer (2W rows) moves twice
        token = int(b.argmax())
        a = feed(ours, token, len(PROMPT) + step)
        b = decode_one_token(loaded.model, theirs, token, len(PROMPT) + step)
        assert (a - b).abs().max() <= tolerance, (step, (a - b).abs().max())
    end = len(PROMPT) + 3 * WINDOW
    assert ours.get_seq_length() == theirs.get_seq_length() == end
    assert ours.layers[0].keys.shape[-2] == theirs.layers[0].keys.shape[-2] == WINDOW - 1
    assert torch.allclose(ours.layers[0].keys, theirs.layers[0].keys, atol=tolerance, rtol=0)


@pytest.mark.skipif(decoder_module.cxx_compiler() is None, reason="torch.compile on the CPU needs a C++ compiler")
def test_the_compiled_gemma_step_computes_what_the_eager_step_computes(tiny_dir):
    # fp32 rows: with bf16 rows a last-bit difference in a computed key can round it to the next bf16
    # value (1.05e-5 in a logit here); the compiled step over bf16 rows resumes as cold (test_kv_dtype)
    loaded = fresh(tiny_dir, kv="activations")
    eager = Decoder(loaded.model, loaded.context_len, loaded.device, "off").feeder()
    compiled = Decoder(loaded.model, loaded.context_len, loaded.device, "on")
    compiled.start()
    assert compiled.choice.value == "compiled", compiled.choice.reason
    assert "memra's attention kernel" in compiled.choice.reason
    assert isinstance(compiled.step, PackagedStep) and list(compiled.step.runners) == ["kernel"]
    feed = compiled.feeder()
    engine = Engine(loaded, EngineOptions(16, 1))
    ours, theirs = engine.new_cache(), engine.new_cache()
    a = prefill(loaded.model, ours, PROMPT[:2], 0, 16)  # from 3 attended rows: windows shorter than W, then full
    b = prefill(loaded.model, theirs, PROMPT[:2], 0, 16)
    for step in range(4 * WINDOW):
        token = int(b.argmax())
        a, b = feed(ours, token, 2 + step), eager(theirs, token, 2 + step)
        assert (a - b).abs().max() <= 1e-5, (step, (a - b).abs().max())


@pytest.mark.skipif(decoder_module.cxx_compiler() is None, reason="torch.compile on the CPU needs a C++ compiler")
def test_a_compiled_gemma_engine_resumes_bit_identical_to_cold(tiny_dir):
    loaded = fresh(tiny_dir, "bfloat16")
    rows = compiled_turns_equal_cold(make_engine(loaded, 16, max_sessions=16, mode="exact", compile="on"))
    assert all(row["warm"].prompt_tokens > WINDOW for row in rows)


def compiled_turns_equal_cold(engine, turns: int = 3) -> list[dict]:
    """Compile `engine`'s step, then hold a conversation: every turn after the first resumed,
    its reply the cold run's token for token (test_reuse.conversation's rows)."""
    engine.decoder.start()
    assert engine.decoder.choice.value == "compiled", engine.decoder.choice.reason
    rows = conversation(engine, turns)
    for turn, row in enumerate(rows):
        if turn:
            assert row["warm"].decision.outcome == "resumed", row["warm"].decision.render()
        warm, cold = row["warm_state"].generated_ids, row["cold_state"].generated_ids
        assert warm == cold and len(warm) > 1
    return rows


# -- the batched step (memrad.engine.decode.batch): each row over its own slabs and window views --

def decode_together(engine, model, prompts, steps, rows=4):
    """Greedy decode `prompts` side by side on `engine`'s batched step of `rows` rows, `steps`
    tokens each: every step's logits per prompt, [steps, V] float32."""
    step = engine.decoder.batch_step(rows)
    caches, tokens = [], []
    for prompt in prompts:
        cache = engine.new_cache()
        tokens.append(int(prefill(model, cache, prompt, 0, 16).argmax()))
        caches.append(cache)
    out = [[] for _ in prompts]
    for offset in range(steps):
        logits = step(caches, tokens, [len(prompt) + offset for prompt in prompts])
        for row, scores in zip(out, logits):
            row.append(scores)
        tokens = [int(scores.argmax()) for scores in logits]
    return [torch.stack(row) for row in out]


def decode_alone(engine, model, prompt, steps):
    """The same greedy decode of one prompt on the one-row step: [steps, V] float32."""
    feed, cache = engine.decoder.feeder(), engine.new_cache()
    token, out = int(prefill(model, cache, prompt, 0, 16).argmax()), []
    for offset in range(steps):
        out.append(feed(cache, token, len(prompt) + offset))
        token = int(out[-1].argmax())
    return torch.stack(out)


def rows_decode_their_own_bits(engine, model, window):
    """A request's every step on the batched step, 3W steps from a prompt past the window and from
    one inside it (its window view grows to W, then the buffer moves twice), is the same bits
    alone, beside neighbours of other lengths, in another row, and on the one-row step."""
    prompts = [list(range(5, 45)), list(range(7, 10)), list(range(9, 60)), list(range(3, 3 + window))]
    steps = 3 * window
    for first in (0, 1):  # 40 tokens: past the window; 3 tokens: inside it
        alone = decode_together(engine, model, [prompts[first]], steps)[0]
        others = [i for i in range(4) if i != first]
        assert torch.equal(decode_together(engine, model, [prompts[first], *[prompts[i] for i in others]], steps)[0],
                           alone)
        assert torch.equal(decode_together(engine, model, [prompts[others[1]], prompts[first]], steps)[1], alone)
        assert torch.equal(decode_alone(engine, model, prompts[first], steps), alone)


def test_every_row_of_the_batched_gemma_step_is_its_own_and_the_one_row_steps(bf16_gemma):
    loaded = bf16_gemma
    engine = make_engine(loaded, 16, max_batch=4)
    assert engine.runtime_choices["batch"]["value"] == "batched, 4 rows"
    assert engine.runtime_choices["step"]["value"] == "gemma3"
    first = rows_are_their_own(engine, loaded.model, 16)
    cache = engine.new_cache()  # the one-row step gives the lone row the batched step's bits
    prefill(loaded.model, cache, list(range(5, 45)), 0, 16)
    assert torch.equal(engine.decoder.feeder()(cache, 11, 40).float(), first)
    step = engine.decoder.batch_step(4)
    assert step.alone is not None and [twin.rows for twin in step.smaller] == [2]  # checked: the same bits
    rows_decode_their_own_bits(engine, loaded.model, WINDOW)


def test_two_gemma_requests_in_flight_decode_the_tokens_each_decodes_alone(bf16_gemma):
    """An engine of max_batch 2: two requests, their prompts past the window and replies past
    its buffer, decode together on the 2-row step the tokens and logits each decodes alone
    (on the one-row step: its bits are a batched row's)."""
    loaded = bf16_gemma
    engine = recording(make_engine(loaded, 16, max_batch=2))
    feed, calls = _counting_graph(engine, 2)
    assert feed.rows == 2 and feed.alone is not None

    def two_requests():  # fresh ones each run: the recording engine keeps scores per request
        return [request(engine, chat(topic, turns)[:-1], f"{topic}-{turns}", max_tokens=tokens)
                for topic, turns, tokens in (("a", 1, 2 * WINDOW + 4), ("b", 2, 3 * WINDOW))]

    requests = two_requests()
    assert all(len(r.prompt_ids) > WINDOW for r in requests)
    alone = {r.request_id: run_together(engine, [r])[r.request_id] for r in requests}
    assert calls == []  # alone: the one-row step
    together = run_together(engine, two_requests())
    assert calls and set(calls) == {(2, 2)}  # decoding side by side: both rows of one step
    for r in requests:
        (completion, state, scores), (_, their_state, their_scores) = together[r.request_id], alone[r.request_id]
        assert state.generated_ids == their_state.generated_ids and len(state.generated_ids) > 2 * WINDOW
        assert torch.equal(scores, their_scores), r.request_id  # every decode step's logits, bit for bit


@pytest.mark.skipif(decoder_module.cxx_compiler() is None, reason="torch.compile on the CPU needs a C++ compiler")
def test_the_compiled_batched_gemma_step_gives_a_row_the_compiled_one_row_bits_and_resumes_as_cold(q4_gemma_dir):
    """compile = on with max_batch 2: the 2-row package (each row's window views their own
    symbol) opens beside the one-row one; the decoder's check finds a row's bits the compiled
    one-row step's, two requests together decode their alone bits, and turns resume as cold."""
    torch.set_num_threads(1)
    loaded = load_model(str(q4_gemma_dir), device="cpu", dtype="bfloat16", weights="int4")
    engine = recording(make_engine(loaded, 16, max_sessions=16, mode="exact", compile="on", max_batch=2))
    engine.decoder.start()
    assert engine.decoder.batch_choice.value == "compiled", engine.decoder.batch_choice.reason
    feed = engine.decoder.batch_step(2)
    assert feed.compiled and feed.alone is not None  # the compiled one-row step's bits, checked

    def two_requests():  # fresh ones each run: the recording engine keeps scores per request
        return [request(engine, chat(topic, 1)[:-1], f"{topic}-1", max_tokens=2 * WINDOW + 2) for topic in "ab"]

    alone = {r.request_id: run_together(engine, [r])[r.request_id] for r in two_requests()}
    together = run_together(engine, two_requests())
    for r in two_requests():
        assert together[r.request_id][1].generated_ids == alone[r.request_id][1].generated_ids
        assert torch.equal(together[r.request_id][2], alone[r.request_id][2]), r.request_id
    compiled_turns_equal_cold(engine)
