"""Every weight format x activation dtype: resumed turns stay bit-identical to cold ones.

The tiny llama is shaped like SmolLM2's GGUF: its linear layers are rounded to Q4_1 and its
head, tied to the input embedding, to Q8_0, and both sets of blocks are kept as `memrad pull`
keeps a GGUF's, so `--weights int4` runs the packed kernel on single tokens, head included.
A folder made before memra kept the head still loads, with a dense head.
"""

import logging

import pytest
import torch
from tiny import build_llama, build_tokenizer, write_q4_folder, write_tiny_gguf

from memrad.engine.engine import Engine, EngineOptions
from memrad.engine.state.disk import state_format
from memrad.engine.model.loader import load_model
from memrad.engine.model.pull import ModelUnavailable
from memrad.engine.kernels import block_gemv
from memrad.engine.model import kernel_choice
from memrad.engine.model.block_linear import BlockLinear
from memrad.engine.model.quant import Int4Linear, Int8Linear, Q8Linear
from memrad.engine.model.weights import (
    INT4_CACHE, Q8_CACHE, count_int4_cache, count_q8_cache, load_int4_cache, load_q8_cache, quantize_head_q8_0,
    quantize_layers_q4_1, save_block_caches, write_int4_cache, write_q8_cache,
)
from stories import ask, make_engine

CONFIGS = [("float", "float32"), ("float", "bfloat16"), ("int4", "float32"), ("int4", "bfloat16"),
           ("int8", "bfloat16")]
SYSTEM = {"role": "system", "content": "You are a helpful coding assistant. Read the file, then answer."}
BLOCKS = block_gemv.why_not() is None  # memra's block kernel runs here (AVX512 with a compiler)
needs_blocks = pytest.mark.skipif(not BLOCKS, reason=str(block_gemv.why_not()))
# The Q4_1 layers (rows in sixteens) run memra's kernel, 16 rows interleaved (kernel_choice): on AVX512
# as measured once, on AVX2 as measured at load (`x16_wins` fixes that measurement's outcome)
LAYERS_ON_BLOCKS = BLOCKS and block_gemv.interleaves()
MEASURED = block_gemv.capability() in kernel_choice.MEASURED_ON


@pytest.fixture
def x16_wins(monkeypatch):
    """Where the verdicts are measured at load (AVX2), the measurement this test expects: the
    interleaved blocks fastest (row-major 2x, the other kernel 3x their time), kept for the test's
    later loads (as the kernel cache keeps them) and for no other test."""
    kept = {}
    monkeypatch.setattr(kernel_choice, "_read", lambda cache: dict(kept))
    monkeypatch.setattr(kernel_choice, "_write", lambda cache, verdicts: kept.update(verdicts))
    monkeypatch.setattr(kernel_choice, "_fastest", lambda *calls: (2e-4, 3e-4, 1e-4)[:len(calls)])


def head_reason(x16: str) -> str:
    """The head's verdict as `memrad status` says it, on this kernel build (`x16_wins` on AVX2)."""
    if MEASURED:
        return f"memra block kernel, {block_gemv.path()}, 16 rows interleaved, 3.0x torch int4 hi|lo, " \
               "2.0x row-major blocks (measured at load, one row)"
    return (f"memra block kernel, {block_gemv.path()}{', 16 rows interleaved' if x16 else ''}; "
            "measured once: docs/BENCHMARKS.md#memras-block-kernel")


@pytest.fixture
def hi_lo(monkeypatch):
    """Loads as on a machine without memra's block kernel: Q8_0 / Q5_0 run as int4 hi|lo."""
    monkeypatch.setattr(block_gemv, "why_not", lambda build_missing=True: "no block kernel (test)")


@pytest.fixture
def old_dir(tmp_path):
    """The same model as made before memra kept the head's Q8_0 blocks (they wait beside it)."""
    folder = write_q4_folder(tmp_path / "tiny-q4-old")
    (folder / Q8_CACHE).rename(tmp_path / Q8_CACHE)
    return folder


def _load(folder, weights, dtype, progress=lambda _: None):
    torch.set_num_threads(1)
    return load_model(str(folder), device="cpu", dtype=dtype, weights=weights, progress=progress)


def test_conversion_keeps_the_q8_0_token_embedding_as_the_tied_heads_blocks(tmp_path):
    model = build_llama(400, tied=True)
    quantize_layers_q4_1(model)
    quantize_head_q8_0(model)
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf", model)
    assert save_block_caches(gguf, model, tmp_path) == (1, 1, 0)  # layer 0's V, and the head
    assert set(load_int4_cache(tmp_path)) == {"model.layers.0.self_attn.v_proj"}
    head, = load_q8_cache(tmp_path).values()
    assert torch.equal(head.dequantize(), model.model.embed_tokens.weight)


def test_a_head_whose_blocks_differ_from_the_float_weights_stays_float(tmp_path, caplog):
    model = build_llama(400, tied=True)
    quantize_head_q8_0(model)
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf", model)
    with torch.no_grad():
        model.lm_head.weight[7, 3] += 1e-3  # the folder's float weights are not the GGUF's
    with caplog.at_level(logging.WARNING, logger="memrad.engine"):
        assert save_block_caches(gguf, model, tmp_path)[1] == 0
    assert "GGUF tensor for lm_head does not match the float weights: it stays float" in caplog.text
    assert count_q8_cache(tmp_path) == 0 and (tmp_path / Q8_CACHE).is_file()


def test_int4_runs_every_layer_linear_and_the_q8_0_head_tied_to_a_float_embedding(q4_dir, hi_lo):
    assert count_int4_cache(q4_dir) == 2 * 7  # 2 layers x (q, k, v, o, gate, up, down)
    assert count_q8_cache(q4_dir) == 1 and set(load_q8_cache(q4_dir)) == {"lm_head"}
    said = []
    loaded = _load(q4_dir, "auto", "bfloat16", said.append)
    assert loaded.weights.value == "int4" and "14 Q4 tensors from the GGUF and its Q8_0 head" in loaded.weights.reason
    model = loaded.model
    assert type(model.lm_head) is Q8Linear and loaded.head == "q8_0"
    assert type(model.model.embed_tokens) is torch.nn.Embedding
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied, still float
    assert model.lm_head.weight.dtype == torch.bfloat16
    packed = [m for m in model.modules() if isinstance(m, Int4Linear)]  # Q8Linear is one
    assert len(packed) == 15 and sum(type(m) is Int4Linear for m in packed) == 14
    assert loaded.packed_bytes == sum(m.packed.nbytes + m.scales_and_zeros.nbytes for m in packed)
    # the head: [hi | lo] codes for 400 x 128 at 2 a byte, and (scale, zero) per 32 of them
    assert model.lm_head.packed.nbytes + model.lm_head.scales_and_zeros.nbytes == 400 * 64 + 4 * 400 * 2 * 2
    assert any("(15 layers packed with the Q8_0 head" in line for line in said)
    assert "lm_head GGUF x1: int4 hi|lo (memra's block kernel: no block kernel (test))" in loaded.tensors.reason


@needs_blocks
def test_with_memra_s_block_kernel_the_q8_0_head_runs_its_gguf_blocks_and_a_second_start_packs_no_int4_again(
        q4_dir, monkeypatch, x16_wins):
    first = _load(q4_dir, "auto", "bfloat16")
    model = first.model
    assert type(model.lm_head) is BlockLinear and first.head == "q8_0 blocks" and model.lm_head.format == "Q8_0"
    assert model.lm_head.weight is model.model.embed_tokens.weight  # prefill still runs the float embedding
    assert model.lm_head.blocks.shape == (400, 2 * 34)  # 64 inputs: 2 blocks of 34 bytes a row
    int4 = [m for m in model.modules() if type(m) is Int4Linear]
    layers = [m for m in model.modules() if isinstance(m, BlockLinear) and m is not model.lm_head]
    assert (len(int4), len(layers)) == ((0, 14) if LAYERS_ON_BLOCKS else (14, 0))
    assert first.packed_bytes == model.lm_head.blocks.nbytes + sum(
        m.packed.nbytes + m.scales_and_zeros.nbytes for m in int4) + sum(m.blocks.nbytes for m in layers)
    # the AVX512 build lays the head's 400 rows (and the layers') out 16 side by side
    x16 = " x16" if block_gemv.interleaves() else ""
    assert model.lm_head.interleaved == block_gemv.interleaves() and all(m.interleaved for m in layers)
    assert f"lm_head GGUF x1: Q8_0{x16} blocks ({head_reason(x16)}); " in first.tensors.reason
    assert first.tensors.value == ("Q8_0 x16 blocks 1, Q4_1 x16 blocks 14" if LAYERS_ON_BLOCKS
                                   else f"Q8_0{x16} blocks 1, int4 14")

    def repack(*_):
        raise AssertionError("packed again")

    monkeypatch.setattr(Int4Linear, "from_blocks", repack)
    second = _load(q4_dir, "auto", "bfloat16")
    assert torch.equal(second.model.lm_head.blocks, model.lm_head.blocks)
    # the disk tier's key: parked state made under the hi|lo head (its bf16 scales) is not loaded here
    assert state_format(second, 16, "exact")["head"] == "q8_0 blocks"


def test_a_second_start_reads_the_packed_head_instead_of_packing_again(q4_dir, monkeypatch, hi_lo):
    first = _load(q4_dir, "int4", "float32")

    def repack(*_):
        raise AssertionError("packed again")

    monkeypatch.setattr(Q8Linear, "from_blocks", repack)
    monkeypatch.setattr(Int4Linear, "from_blocks", repack)
    second = _load(q4_dir, "int4", "float32")
    assert type(second.model.lm_head) is Q8Linear
    assert torch.equal(second.model.lm_head.packed, first.model.lm_head.packed)


def test_a_folder_made_before_the_head_was_kept_loads_with_a_dense_head_and_says_what_to_run(old_dir, caplog,
                                                                                              x16_wins):
    with caplog.at_level(logging.WARNING, logger="memrad.engine"):
        loaded = _load(old_dir, "auto", "bfloat16")
    assert loaded.weights.value == "int4" and "Q8_0" not in loaded.weights.reason
    assert type(loaded.model.lm_head) is torch.nn.Linear and loaded.head == "float"
    assert sum(type(m) is (BlockLinear if LAYERS_ON_BLOCKS else Int4Linear) for m in loaded.model.modules()) == 14
    assert f"the output head runs dense: {old_dir} was made before memra kept the head's Q8_0 blocks; " \
           "`memrad pull` (the default model) or `memrad pull FILE.gguf` (a GGUF) adds them" in caplog.text


def test_adding_the_head_blocks_later_packs_the_head_at_the_next_start(old_dir, hi_lo):
    before = _load(old_dir, "int4", "bfloat16")  # keeps a packed file without the head
    engine_before = Engine(before, EngineOptions(16, 1))
    (old_dir.parent / Q8_CACHE).rename(old_dir / Q8_CACHE)  # as `memrad pull` adds them
    after = _load(old_dir, "int4", "bfloat16")
    assert type(after.model.lm_head) is Q8Linear
    # parked state on disk made under the dense head is never loaded under the Q8_0 head
    before_key, after_key = state_format(engine_before.loaded, 16, "exact"), state_format(after, 16, "exact")
    assert before_key["head"] == "float" and after_key["head"] == "q8_0"
    assert {key for key in after_key if after_key[key] != before_key[key]} == {"head", "kernels"}


def test_a_head_the_gguf_ships_in_another_format_stays_dense_and_says_so(old_dir, caplog):
    write_q8_cache({}, old_dir, "test", "Q6_K")
    with caplog.at_level(logging.INFO, logger="memrad.engine"):
        assert _load(old_dir, "int4", "bfloat16").head == "float"
    said, = [r for r in caplog.records if "output head" in r.getMessage()]
    assert said.levelname == "INFO"  # nothing to run: the GGUF's own choice
    assert said.getMessage() == "the output head runs dense: the GGUF ships it as Q6_K, not Q8_0"


def _odd_vocabulary_folder(folder):
    tokenizer = build_tokenizer()
    model = build_llama(len(tokenizer) + 8, tied=True)  # 408 rows: the CPU int4 packer takes sixteens
    layers, head = quantize_layers_q4_1(model), quantize_head_q8_0(model)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    write_int4_cache(layers, folder, "test")
    write_q8_cache(head, folder, "test", "Q8_0")
    return folder


@needs_blocks
def test_a_vocabulary_the_int4_packer_cannot_take_runs_its_q8_0_blocks_on_memra_s_kernel(tmp_path):
    loaded = _load(_odd_vocabulary_folder(tmp_path), "int4", "bfloat16")
    assert loaded.head == "q8_0 blocks" and loaded.model.lm_head.blocks.shape == (408, 2 * 34)


def test_a_vocabulary_the_kernel_cannot_pack_keeps_a_dense_head_and_says_why(tmp_path, caplog, hi_lo):
    _odd_vocabulary_folder(tmp_path)
    with caplog.at_level(logging.INFO, logger="memrad.engine"):
        loaded = _load(tmp_path, "int4", "bfloat16")
    assert loaded.head == "float" and sum(type(m) is Int4Linear for m in loaded.model.modules()) == 14
    assert "the output head runs dense: the int4 kernel packs rows in sixteens and it has 408" in caplog.text


def test_int8_packs_every_linear_and_float_packs_none(q4_dir):
    int8 = _load(q4_dir, "int8", "bfloat16")
    assert sum(isinstance(m, Int8Linear) for m in int8.model.modules()) == 15 and int8.head == "int8"
    floats = _load(q4_dir, "float", "float32")
    assert floats.packed_bytes == 0 and floats.weights.reason == "set by model.weights" and floats.head == "float"


def test_int4_without_cached_blocks_says_what_to_do(tiny_llama_dir):
    with pytest.raises(ModelUnavailable, match="--weights int4 needs a GGUF's Q4_0/Q4_1/Q4_K blocks"):
        _load(tiny_llama_dir, "int4", "float32")
    assert not (tiny_llama_dir / INT4_CACHE).exists() and not (tiny_llama_dir / Q8_CACHE).exists()
    assert _load(tiny_llama_dir, "auto", "float32").weights.value == "float"


@pytest.mark.parametrize("weights,dtype", CONFIGS)
def test_resumed_turns_equal_cold_turns_bit_for_bit(q4_dir, weights, dtype):
    loaded = _load(q4_dir, weights, dtype)
    assert loaded.head == {"float": "float", "int4": "q8_0 blocks" if BLOCKS else "q8_0", "int8": "int8"}[weights]
    engine = make_engine(loaded, 16, max_sessions=16, mode="exact")
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
    engine = make_engine(_load(q4_dir, "int4", "bfloat16"), 16, max_sessions=16, mode="exact")
    _, state = ask(engine, [SYSTEM, {"role": "user", "content": "hi"}], "r")
    assert state.cache.layers[0].keys.dtype == torch.bfloat16
    # 2 layers x (keys + values) x 2 kv heads x 16 dims x 2 bytes
    assert state.session.num_bytes == state.session.num_tokens * 2 * 2 * 2 * 16 * 2
    assert engine.parking.pool.bytes_parked == state.session.num_bytes


@needs_blocks
@pytest.mark.skipif(not LAYERS_ON_BLOCKS, reason="the layers run memra's kernel interleaved on AVX512 and AVX2 only")
def test_state_parked_under_torch_s_int4_layers_is_not_resumed_under_the_interleaved_kernel_s(q4_dir, tmp_path,
                                                                                              monkeypatch, x16_wins):
    from memrad.engine.state.disk import DiskTier

    interleaved = _load(q4_dir, "int4", "bfloat16")
    decide = kernel_choice.decide
    with monkeypatch.context() as patch:  # a start where the layers stayed on torch's int4 kernel
        patch.setattr(kernel_choice, "interleaved_4_bit", lambda members: False)  # as measured once (AVX512)
        patch.setattr(kernel_choice, "decide", lambda group, *measured: (  # as measured at load (AVX2)
            decide(group, *measured) if group.startswith("head") else kernel_choice.Verdict(group, False, "the test's")))
        int4 = _load(q4_dir, "int4", "bfloat16")
    assert sum(type(m) is Int4Linear for m in int4.model.modules()) == 14
    assert sum(isinstance(m, BlockLinear) and m.interleaved for m in interleaved.model.modules()) == 15
    int4_key, x16_key = state_format(int4, 16, "fast"), state_format(interleaved, 16, "fast")
    assert {key for key in x16_key if x16_key[key] != int4_key[key]} == {"kernels"}
    assert x16_key["kernels"] == f"Q8_0 x16 blocks 1, Q4_1 x16 blocks 14; memra block kernel {block_gemv.path()}"
    # fast mode parks the decoded KV, which the layers' kernel computed
    before = make_engine(int4, 16, mode="fast", disk=DiskTier(tmp_path, 10**9, int4_key))
    ask(before, [SYSTEM, {"role": "user", "content": "one " * 20}], "a")
    before.close()
    assert [p.name for p in tmp_path.iterdir()] == ["s1.safetensors"]
    tier = DiskTier(tmp_path, 10**9, x16_key)
    assert tier.index() == [] and list(tier.foreign) == ["s1"]
    assert len(DiskTier(tmp_path, 10**9, int4_key).index()) == 1  # its own engine's key still loads it
