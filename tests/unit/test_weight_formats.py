"""Every weight format x activation dtype: resumed turns stay bit-identical to cold ones.

The tiny llama's linear layers are rounded to Q4_1 and its blocks kept as an int4 cache, as
`memrad pull` keeps a GGUF's, so `--weights int4` runs the packed kernel on single tokens.
"""

import pytest
import torch

from memrad.engine.engine import Engine
from memrad.engine.loader import load_model
from memrad.engine.pull import ModelUnavailable
from memrad.engine.quant import Int4Linear, Int8Linear
from memrad.engine.weights import INT4_CACHE, count_int4_cache
from memrad.reuse.pool import ReusePool
from test_reuse import ask

CONFIGS = [("float", "float32"), ("float", "bfloat16"), ("int4", "float32"), ("int4", "bfloat16"),
           ("int8", "bfloat16")]
SYSTEM = {"role": "system", "content": "You are a helpful coding assistant. Read the file, then answer."}


def _load(folder, weights, dtype):
    torch.set_num_threads(1)
    return load_model(str(folder), device="cpu", dtype=dtype, weights=weights)


def test_the_int4_cache_holds_every_layer_linear_but_the_head(q4_dir):
    assert count_int4_cache(q4_dir) == 2 * 7  # 2 layers x (q, k, v, o, gate, up, down)
    loaded = _load(q4_dir, "auto", "bfloat16")
    assert loaded.weights.value == "int4"
    packed = [m for m in loaded.model.modules() if isinstance(m, Int4Linear)]
    assert len(packed) == 14 and not isinstance(loaded.model.lm_head, Int4Linear)
    assert loaded.packed_bytes == sum(m.packed.nbytes + m.scales_and_zeros.nbytes for m in packed)


def test_int8_packs_every_linear_and_float_packs_none(q4_dir):
    assert sum(isinstance(m, Int8Linear) for m in _load(q4_dir, "int8", "bfloat16").model.modules()) == 15
    floats = _load(q4_dir, "float", "float32")
    assert floats.packed_bytes == 0 and floats.weights.reason == "set by model.weights"


def test_int4_without_cached_blocks_says_what_to_do(tiny_llama_dir):
    with pytest.raises(ModelUnavailable, match="--weights int4 needs a GGUF's Q4_0/Q4_1 blocks"):
        _load(tiny_llama_dir, "int4", "float32")
    assert not (tiny_llama_dir / INT4_CACHE).exists()
    assert _load(tiny_llama_dir, "auto", "float32").weights.value == "float"


@pytest.mark.parametrize("weights,dtype", CONFIGS)
def test_resumed_turns_equal_cold_turns_bit_for_bit(q4_dir, weights, dtype):
    loaded = _load(q4_dir, weights, dtype)
    engine = Engine(loaded, 16, 1, ReusePool(16, 10**9), "exact")
    engine.finished = []
    engine.on_finished = engine.finished.append
    messages = [SYSTEM]
    for turn in range(3):
        messages.append({"role": "user", "content": f"turn {turn}: list files, then open README.md"})
        warm, warm_state = ask(engine, messages, f"t{turn}")
        cold, cold_state = ask(engine, messages, f"c{turn}", salt=f"cold-{turn}")
        assert cold.decision.outcome == "cold"
        if turn:
            assert warm.decision.outcome == "resumed", warm.decision.render()
        assert torch.equal(warm_state.prompt_logits, cold_state.prompt_logits)
        assert warm.text == cold.text and warm_state.generated_ids == cold_state.generated_ids
        messages.append({"role": "assistant", "content": warm.text})


def test_parked_bytes_count_bf16_kv_at_two_bytes_a_value(q4_dir):
    engine = Engine(_load(q4_dir, "int4", "bfloat16"), 16, 1, ReusePool(16, 10**9), "exact")
    engine.finished = []
    engine.on_finished = engine.finished.append
    _, state = ask(engine, [SYSTEM, {"role": "user", "content": "hi"}], "r")
    assert state.cache.layers[0].keys.dtype == torch.bfloat16
    # 2 layers x (keys + values) x 2 kv heads x 16 dims x 2 bytes
    assert state.session.num_bytes == state.session.num_tokens * 2 * 2 * 2 * 16 * 2
    assert engine.pool.bytes_parked == state.session.num_bytes
