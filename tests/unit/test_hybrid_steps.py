"""Hybrid models on the decode step, on the tiny random hybrids of tests/unit/tiny.py (decay
slowed, so a stale state changes the logits):

  qwen3_next  three gated delta nets (conv and recurrent state) and one gated full-attention
              layer, each with a top-2-of-4 MoE and a shared expert;
  falcon_h1   two layers of Mamba-2 (conv and SSM state) beside attention.

The cache's recurrent layers (RecurrentLayer, HybridSlabLayer) prefill exactly as
transformers' layers; the step decodes what transformers' forward decodes (bf16: the same
bits, logits and states; fp32: the same tokens, logits within rounding), writing the cache's
own state tensors; a snapshot is not rewritten by later steps; the compiled step (one
AOTInductor graph, memra's kernel) decodes what the eager one does, and a compiled engine
resumes turns bit-identically to their cold runs. Eager resumes, boundary snapshots and the
disk tier are covered with the other kinds (test_reuse, test_disk).
"""

import pytest
import torch
from transformers import DynamicCache

from memrad.engine.decode import decoder as decoder_module
from memrad.engine.decode.decoder import Decoder
from memrad.engine.decode.steps.falcon_h1 import FalconH1Step
from memrad.engine.decode.package import PackagedStep
from memrad.engine.decode.steps.qwen3_next import Qwen3NextStep
from memrad.engine.engine import Engine, EngineOptions
from memrad.engine.forward import decode_one_token, prefill
from memrad.engine.model.loader import load_model
from memrad.engine.state.snapshot import Snapshot, state_bytes
from test_reuse import conversation
from stories import make_engine

PROMPT = list(range(5, 25))  # 20 tokens: one full grid chunk of 16 and a part
STEPS = 30
KINDS = ["qwen3_next", "falcon_h1"]
STEP = {"qwen3_next": Qwen3NextStep, "falcon_h1": FalconH1Step}
LAYERS = {"qwen3_next": ["RecurrentLayer"] * 3 + ["SlabLayer"], "falcon_h1": ["HybridSlabLayer"] * 2}
CHOICE = {
    "qwen3_next": {"value": "qwen3-next",
                   "reason": "Qwen3NextForCausalLM layers on one graph: 3 gated delta net (conv and recurrent state "
                             "rewritten in place), 1 full-attention; experts: top 2 of 4 per token"},
    "falcon_h1": {"value": "falcon-h1",
                  "reason": "FalconH1ForCausalLM layers on one graph: 2 Mamba-2 beside full attention (conv and SSM "
                            "state rewritten in place)"},
}
# (conv state, recurrent state) shapes: [1, C, K], and [1, H_v, D_k, D_v] / [1, H, P, N]
SHAPES = {"qwen3_next": ((1, 2 * 2 * 16 + 4 * 16, 4), (1, 4, 16, 16)), "falcon_h1": ((1, 64 + 2 * 16, 4), (1, 4, 16, 16))}


def fresh(tiny_dir, kind, dtype="float32"):
    torch.set_num_threads(1)
    return load_model(str(tiny_dir(kind)), device="cpu", dtype=dtype)


def states(layers):
    """(conv state, recurrent state) of every layer that has them."""
    return [(layer.conv_states[0], layer.recurrent_states[0]) for layer in layers if hasattr(layer, "conv_states")]


@pytest.mark.parametrize("kind", KINDS)
def test_a_hybrid_engine_decodes_on_its_step_and_says_which(tiny_dir, kind):
    loaded = fresh(tiny_dir, kind)
    engine = Engine(loaded, EngineOptions(16, 1))
    assert type(engine.decoder.step) is STEP[kind]
    assert engine.runtime_choices["decode"] == {"value": "eager", "reason": "compile = off: torch's attention"}
    assert engine.runtime_choices["step"] == CHOICE[kind]
    cache = engine.new_cache()
    assert [type(layer).__name__ for layer in cache.layers] == LAYERS[kind]
    assert not cache.layers[0].is_initialized  # nothing to step on before prefill
    prefill(loaded.model, cache, PROMPT, 0, 16)
    assert all(layer.is_initialized for layer in cache.layers)
    conv, state = states(cache.layers)[0]
    assert (conv.shape, state.shape) == SHAPES[kind]
    assert state.dtype == torch.float32  # as transformers keeps it, whatever the model's dtype


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_hybrid_step_decodes_what_transformers_decodes(tiny_dir, kind, dtype):
    loaded = fresh(tiny_dir, kind, dtype)
    feed = Decoder(loaded.model, loaded.context_len, loaded.device).feeder()
    ours, theirs = Engine(loaded, EngineOptions(16, 1)).new_cache(), DynamicCache(config=loaded.model.config)
    a = prefill(loaded.model, ours, PROMPT, 0, 16)
    b = prefill(loaded.model, theirs, PROMPT, 0, 16)
    assert torch.equal(a, b)  # the in-place layers leave prefill's bits alone
    written = [t.data_ptr() for pair in states(ours.layers) for t in pair]
    for step in range(STEPS):
        token = int(b.argmax())
        a = feed(ours, token, len(PROMPT) + step)
        b = decode_one_token(loaded.model, theirs, token, len(PROMPT) + step)
        assert int(a.argmax()) == int(b.argmax()), step
        if dtype == "bfloat16":  # the same operations in the same order: the same bits
            assert torch.equal(a, b), (step, (a - b).abs().max())
        else:  # attention's reduction order differs from transformers' in the last bits
            assert (a - b).abs().max() <= 1e-6, (step, (a - b).abs().max())
    for (conv, state), (their_conv, their_state) in zip(states(ours.layers), states(theirs.layers)):
        if dtype == "bfloat16":  # the state the step left is transformers', in the cache's own tensors
            assert torch.equal(conv, their_conv) and torch.equal(state, their_state)
        else:
            assert torch.allclose(state, their_state, atol=1e-6, rtol=0)
    assert [t.data_ptr() for pair in states(ours.layers) for t in pair] == written
    assert ours.get_seq_length() == theirs.get_seq_length() == len(PROMPT) + STEPS


@pytest.mark.parametrize("kind", KINDS)
def test_a_snapshot_of_recurrent_layers_is_not_rewritten_by_later_steps(tiny_dir, kind):
    loaded = fresh(tiny_dir, kind, "bfloat16")
    feed = Decoder(loaded.model, loaded.context_len, loaded.device).feeder()
    cache = Engine(loaded, EngineOptions(16, 1)).new_cache()
    logits = prefill(loaded.model, cache, PROMPT, 0, 16)
    snapshot = Snapshot.take(cache, len(PROMPT))
    kept = [(conv.clone(), state.clone()) for conv, state in states(snapshot.layers)]
    assert [type(layer).__name__ for layer in snapshot.layers] == LAYERS[kind]
    for step in range(4):
        logits = feed(cache, int(logits.argmax()), len(PROMPT) + step)
    assert not torch.equal(states(cache.layers)[0][1], kept[0][1])  # the live state moved on
    for (conv, state), (kept_conv, kept_state) in zip(states(snapshot.layers), kept):
        assert torch.equal(conv, kept_conv) and torch.equal(state, kept_state)


@pytest.mark.skipif(decoder_module.cxx_compiler() is None, reason="torch.compile on the CPU needs a C++ compiler")
@pytest.mark.parametrize("kind", KINDS)
def test_the_compiled_hybrid_step_decodes_as_the_eager_one_and_resumes_bit_identical(tiny_dir, kind):
    loaded = fresh(tiny_dir, kind, "bfloat16")
    engine = make_engine(loaded, 16, max_sessions=16, mode="exact", compile="on")
    engine.decoder.start()  # builds the package (minutes on a shared 2-core machine)
    compiled = engine.decoder
    assert compiled.choice.value == "compiled", compiled.choice.reason
    assert "AOTInductor" in compiled.choice.reason and "memra's attention kernel" in compiled.choice.reason
    assert isinstance(compiled.step, PackagedStep) and list(compiled.step.runners) == ["kernel"]
    assert engine.runtime_choices["step"] == CHOICE[kind]

    compiled_decodes_as_eager_and_resumes(engine, loaded)


def compiled_decodes_as_eager_and_resumes(engine, loaded, steps=STEPS):
    """`engine`'s compiled step decodes `steps` tokens from 3 attended rows as the eager step
    does (bf16 rounding of fused work apart), and its turns resume bit-identical to cold."""
    feed, eager = engine.decoder.feeder(), Decoder(loaded.model, loaded.context_len, loaded.device, "off").feeder()
    ours, theirs = engine.new_cache(), engine.new_cache()
    a = prefill(loaded.model, ours, PROMPT[:2], 0, 16)  # from 3 attended rows
    b = prefill(loaded.model, theirs, PROMPT[:2], 0, 16)
    for step in range(steps):
        token = int(b.argmax())
        a, b = feed(ours, token, 2 + step), eager(theirs, token, 2 + step)
        assert int(a.argmax()) == int(b.argmax()), step
        assert (a - b).abs().max() <= 0.0625, (step, (a - b).abs().max())  # bf16 rounding of fused work

    for turn, row in enumerate(conversation(engine, 3)):
        if turn:
            assert row["warm"].decision.outcome == "resumed", row["warm"].decision.render()
        warm, cold = row["warm_state"], row["cold_state"]
        assert warm.generated_ids == cold.generated_ids and len(warm.generated_ids) > 1
        assert torch.equal(warm.prompt_logits, cold.prompt_logits)


def test_a_falcon_h1_state_counts_its_rows_and_its_recurrent_state(tiny_dir):
    loaded = fresh(tiny_dir, "falcon_h1")
    cache = Engine(loaded, EngineOptions(16, 1)).new_cache()
    prefill(loaded.model, cache, PROMPT, 0, 16)
    rows = sum(layer.slab.high_water * layer.slab.bytes_per_row for layer in cache.layers)
    recurrent = sum(t.numel() * t.element_size() for pair in states(cache.layers) for t in pair)
    assert rows == 2 * len(PROMPT) * 2 * (2 * 16) * 4  # layers x rows x (K + V) x (2 KV heads x 16) x fp32
    assert state_bytes([Snapshot.adopt(cache, len(PROMPT))]) == rows + recurrent
    fork = cache.layers[0].copied(len(PROMPT))  # a fork keeps its own copy of the state with the rows
    assert type(fork).__name__ == "HybridSlabLayer" and fork.slab is not cache.layers[0].slab
    assert torch.equal(fork.recurrent_states[0], cache.layers[0].recurrent_states[0])
    assert fork.recurrent_states[0].data_ptr() != cache.layers[0].recurrent_states[0].data_ptr()
