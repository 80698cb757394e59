"""LFM2 from its GGUF on memra's decode step: gated short convolutions beside attention.

The tiny LFM2 of tests/unit/tiny_gguf.py (six layers: conv, conv, attention, conv, attention,
conv; per-head q/k RMSNorms; Q4_K_M quants, the conv kernels F32), loaded through memra's GGUF
path. Its conv layers' cache is a RecurrentLayer holding conv state only, written in place by
the step, so parked state is a snapshot as the hybrids' is. In bf16 (what `auto` runs on this
CPU) the step's logits and conv states are transformers' forward's bit for bit, with float
weights and with the Q4_K blocks on the int4 kernel (fp32: within rounding of the fused
matmuls); a snapshot is not rewritten by later steps; the batched step gives a request's row
the same bits beside any neighbours and alone, and requests in flight together (two resumed)
decode their alone bits; an engine resumes turns bit-identically to their cold runs, from the
parked prompt and from a boundary snapshot below a rewritten reply (the disk tier's restart
and reload: tests/unit/test_disk.py, kind "lfm2"); the compiled step decodes what the eager one
does and resumes bit-identically to cold.
"""

import pytest
import torch
from transformers import DynamicCache

from memrad.engine.decode import decoder as decoder_module
from memrad.engine.decode import steps
from memrad.engine.decode.decoder import Decoder
from memrad.engine.decode.package import PackagedStep
from memrad.engine.decode.steps.lfm2 import Lfm2Step
from memrad.engine.engine import Engine, EngineOptions
from memrad.engine.forward import decode_one_token, prefill
from memrad.engine.model.gguf_header import read_header
from memrad.engine.model.preflight import gguf_config as preflight_config, inspect_gguf
from memrad.engine.state.snapshot import Snapshot
from stories import make_engine
from test_gguf_steps import (compacted_reply_resumes_at_its_boundary, fresh, own_cache,  # noqa: F401 - a fixture
                             turns_resume_as_cold)
from test_batching import in_flight_together_as_alone, rows_are_their_own
from test_experts import with_the_steps_attention_layout
from test_hybrid_steps import compiled_decodes_as_eager_and_resumes
from tiny_gguf import LFM2_LAYERS, tiny_gguf

PROMPT = list(range(5, 45))  # 40 tokens: two grid chunks of 16 and a part
STEPS = 24
REASON = ("Lfm2ForCausalLM layers on one graph: 4 short convolution (conv state rewritten in place), "
          "2 full-attention")
CONV = [i for i, kind in enumerate(LFM2_LAYERS) if kind == "conv"]


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    return tiny_gguf(tmp_path_factory.mktemp("lfm2"), "lfm2")[0]


def conv_states(cache):
    return [cache.layers[i].conv_states[0] for i in CONV]


def test_lfm2_loads_from_its_gguf_onto_its_step_and_says_so(gguf):
    loaded = fresh(gguf)
    assert type(loaded.model).__name__ == "Lfm2ForCausalLM" and loaded.model.config.layer_types == LFM2_LAYERS
    assert loaded.weights.value == "int4"
    assert steps.support(loaded.model, loaded.context_len) is None
    assert steps.describe(loaded.model, loaded.context_len) == steps.Choice("lfm2", REASON)
    engine = Engine(loaded, EngineOptions(16, 1))
    assert engine.runtime_choices["step"] == {"value": "lfm2", "reason": REASON}
    assert type(engine.decoder.eager_step) is Lfm2Step
    assert steps.recurrent(engine.decoder.eager_step) == [kind == "conv" for kind in LFM2_LAYERS]
    cache = engine.new_cache()
    assert [type(layer).__name__ for layer in cache.layers] == [
        "RecurrentLayer" if kind == "conv" else "SlabLayer" for kind in LFM2_LAYERS]
    assert not cache.layers[0].is_initialized  # nothing to step on before prefill
    prefill(loaded.model, cache, PROMPT, 0, 16)
    assert all(layer.is_initialized for layer in cache.layers)
    assert [tuple(state.shape) for state in conv_states(cache)] == [(1, 256, 3)] * 4  # [1, hidden, L]
    assert all(cache.layers[i].recurrent_states[0] is None for i in CONV)  # a short convolution has no other
    conv, nothing = cache.layers[0].step_buffers(len(PROMPT))
    assert conv is cache.layers[0].conv_states[0] and nothing.shape == (0,)


def test_an_lfm2_gguf_is_described_before_it_loads(gguf):
    from transformers import AutoConfig

    preflight = inspect_gguf(gguf, 0, torch.bfloat16)
    ours = preflight_config(read_header(gguf), gguf)
    theirs = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    assert ours.layer_types == theirs.layer_types == LFM2_LAYERS
    assert ours.norm_eps == theirs.norm_eps  # the header's float32 epsilon, under LFM2's name
    lines = preflight.lines()
    assert lines[:2] == ["tiny-lfm2.gguf: lfm2 (Lfm2ForCausalLM)",
                         f"  fast decode step: yes, memra's lfm2 step ({REASON})"]
    assert "shortconv.conv F32; shortconv.in_proj Q4_K; shortconv.out_proj Q4_K" in lines[2]
    assert lines[4] == "  KV: 1,024 B/token in bfloat16"  # the 2 attention layers x K and V x 2 KV heads x 64 x 2 bytes


@pytest.mark.parametrize("dtype,weights,tolerance", [("bfloat16", "float", 0.0), ("bfloat16", "auto", 0.0),
                                                     ("float32", "float", 1e-6)])
def test_the_lfm2_step_decodes_transformers_bits(gguf, dtype, weights, tolerance):
    loaded = fresh(gguf, dtype, weights)
    feed = Decoder(loaded.model, loaded.context_len, loaded.device).feeder()
    ours, theirs = Engine(loaded, EngineOptions(16, 1)).new_cache(), DynamicCache(config=loaded.model.config)
    with_the_steps_attention_layout(loaded.model, feed.kernel)  # as test_experts says why
    a = prefill(loaded.model, ours, PROMPT, 0, 16)
    b = prefill(loaded.model, theirs, PROMPT, 0, 16)
    assert torch.equal(a, b)  # the in-place layers leave prefill's bits alone
    written = [state.data_ptr() for state in conv_states(ours)]
    for step in range(STEPS):
        token = int(b.argmax())
        a = feed(ours, token, len(PROMPT) + step)
        b = decode_one_token(loaded.model, theirs, token, len(PROMPT) + step)
        assert float((a - b).abs().max()) <= tolerance, (step, float((a - b).abs().max()))
        assert int(a.argmax()) == int(b.argmax()), step
    for state, theirs_state in zip(conv_states(ours), conv_states(theirs)):
        if tolerance == 0.0:  # the state the step left is transformers', in the cache's own tensors
            assert torch.equal(state, theirs_state)
        else:  # values near 3: the last bits of the fused matmuls upstream
            assert torch.allclose(state, theirs_state, rtol=1e-5, atol=1e-6)
    assert [state.data_ptr() for state in conv_states(ours)] == written  # rewritten in place, never replaced
    if tolerance == 0.0:
        assert torch.equal(ours.layers[2].keys, theirs.layers[2].keys)  # the step's KV rows: forward's bits
    assert ours.get_seq_length() == theirs.get_seq_length() == len(PROMPT) + STEPS


def test_the_step_reads_the_conv_state_it_is_handed(gguf):
    """A stale conv state changes the next logits: the step convolves over it, not over zeros."""
    loaded = fresh(gguf)
    feed = Decoder(loaded.model, loaded.context_len, loaded.device).feeder()
    engine = Engine(loaded, EngineOptions(16, 1))
    caches = [engine.new_cache(), engine.new_cache()]
    for cache in caches:
        prefill(loaded.model, cache, PROMPT, 0, 16)
    with torch.inference_mode():  # the cache's tensors are inference tensors
        conv_states(caches[1])[0].zero_()
    assert not torch.equal(feed(caches[0], 7, len(PROMPT)), feed(caches[1], 7, len(PROMPT)))


def test_a_snapshot_of_the_conv_layers_is_not_rewritten_by_later_steps(gguf):
    loaded = fresh(gguf)
    feed = Decoder(loaded.model, loaded.context_len, loaded.device).feeder()
    cache = Engine(loaded, EngineOptions(16, 1)).new_cache()
    logits = prefill(loaded.model, cache, PROMPT, 0, 16)
    snapshot = Snapshot.take(cache, len(PROMPT))
    kept = [state.clone() for state in conv_states(snapshot)]
    for step in range(4):
        logits = feed(cache, int(logits.argmax()), len(PROMPT) + step)
    assert not torch.equal(conv_states(cache)[0], kept[0])  # the live state moved on
    assert all(torch.equal(state, k) for state, k in zip(conv_states(snapshot), kept))


def test_every_row_of_the_batched_lfm2_step_is_its_own_and_the_one_row_steps(gguf):
    """Each request's conv state is its own tensor, convolved on its own row: a request's row is
    the same bits beside any neighbours and alone, and the one-row step gives it those bits."""
    loaded = fresh(gguf)
    engine = make_engine(loaded, 16, max_batch=4)
    assert engine.runtime_choices["batch"]["value"] == "batched, 4 rows"
    first = rows_are_their_own(engine, loaded.model, 16)
    cache = engine.new_cache()
    prefill(loaded.model, cache, PROMPT, 0, 16)
    assert torch.equal(engine.decoder.feeder()(cache, 11, len(PROMPT)).float(), first)
    step = engine.decoder.batch_step(4)
    assert step.alone is not None and [twin.rows for twin in step.smaller] == [2]  # checked: the same bits


def test_lfm2_requests_in_flight_together_decode_their_bits_alone(gguf):
    """Four requests, two resumed from parked sessions, decoding on the batched step together:
    each one's tokens, first logits and every step's scores as when it runs alone."""
    in_flight_together_as_alone(fresh(gguf))


def test_an_lfm2_engine_resumes_turns_bit_identical_to_cold(gguf):
    turns_resume_as_cold(make_engine(fresh(gguf), 16, max_sessions=16, mode="exact"))


def test_a_rewritten_reply_resumes_from_the_boundary_snapshot_below_it(gguf):
    """Conv state cannot be cut back: a client that compacts turn 2's reply resumes at the
    snapshot taken at that reply's anchor, and its turn is the cold run's bit for bit."""
    compacted_reply_resumes_at_its_boundary(make_engine(fresh(gguf), 16, max_sessions=16, mode="exact"))


needs_compiler = pytest.mark.skipif(decoder_module.cxx_compiler() is None,
                                    reason="torch.compile on the CPU needs a C++ compiler")


@pytest.fixture(scope="module")
def compiled(gguf, tmp_path_factory):
    """An exact-mode engine (max_batch 2) whose one-row and 2-row packages were built at its
    start (compile = on: minutes on a shared 2-core machine), in a compile cache of its own."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MEMRA_CACHE_DIR", str(tmp_path_factory.mktemp("lfm2-compiled")))
        loaded = fresh(gguf)
        engine = make_engine(loaded, 16, max_sessions=16, mode="exact", compile="on", max_batch=2)
        engine.decoder.start()
    return loaded, engine


@needs_compiler
def test_the_compiled_lfm2_step_decodes_as_the_eager_one_and_resumes_bit_identical(compiled):
    loaded, engine = compiled
    decoder = engine.decoder
    assert decoder.choice.value == "compiled", decoder.choice.reason
    assert isinstance(decoder.step, PackagedStep) and list(decoder.step.runners) == ["kernel"]
    assert engine.runtime_choices["step"] == {"value": "lfm2", "reason": REASON}
    compiled_decodes_as_eager_and_resumes(engine, loaded, STEPS)


@needs_compiler
def test_the_compiled_batched_lfm2_step_gives_a_row_its_bits_at_any_neighbours_and_alone(compiled):
    loaded, engine = compiled
    assert engine.decoder.batch_choice.value == "compiled", engine.decoder.batch_choice.reason
    step = engine.decoder.batch_step(2)
    assert step.compiled and step.rows == 2
    assert step.alone is not None  # the compiled one-row step gives a lone request a batched row's bits
    prompts = [PROMPT, list(range(7, 20))]

    def logits(rows):
        caches = []
        for i in rows:
            cache = engine.new_cache()
            prefill(loaded.model, cache, prompts[i], 0, 16)
            caches.append(cache)
        return step(caches, [11 + i for i in rows], [len(prompts[i]) for i in rows])

    first = logits([0])[0]
    assert torch.equal(logits([0, 1])[0], first) and torch.equal(logits([1, 0])[1], first)
    cache = engine.new_cache()
    prefill(loaded.model, cache, PROMPT, 0, 16)
    assert torch.equal(engine.decoder.feeder()(cache, 11, len(PROMPT)).float(), first)
