"""Gemma 3 on the decode step, on a tiny random Gemma 3 (window of 8 tokens, one global layer of
four, two rope bases, q/k norms with random +1 weights, final soft-cap).

Its WindowLayers prefill exactly as transformers' sliding layers do; the step decodes what
transformers' forward decodes long past the window (fp32 tight, bf16 within rounding); the
compiled step (one AOTInductor graph, memra's kernel over the window views) computes what the
eager one computes, and a compiled engine resumes turns bit-identically to their cold runs.
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
from test_reuse import conversation
from stories import make_engine

WINDOW = 8  # tests/unit/tiny.py: build_gemma3
PROMPT = list(range(5, 25))  # 20 tokens: past the window before the first step


def fresh(tiny_dir, dtype="float32"):
    torch.set_num_threads(1)
    return load_model(str(tiny_dir("gemma3")), device="cpu", dtype=dtype)


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
    loaded = fresh(tiny_dir, dtype)
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
    loaded = fresh(tiny_dir)
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
