"""GGUF k-quants and Q5_0 as shipped: Q4_K super-blocks unpack to int4 blocks (one scale and
min per 32 weights) that dequantize bit for bit as gguf-py does, the kernel's bf16 scales stay
inside the stated bound, Q5_0 runs exactly as int8 codes hi|lo, and a GGUF mixing the types is
read, checked and named group by group (what `memrad status` shows)."""

import json

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter, quants

from memrad.engine.model import formats
from memrad.engine.model.quant import GROUP, Int4Linear, Q8Linear, SuperBlocks, unpack_q4_k, unpack_q5_0
from memrad.engine.model.weights import (
    BLOCKS_LAYOUT, INT4_CACHE, Q8_CACHE, load_int4_cache, load_kinds, load_q8_cache, save_block_caches,
)
from tiny import build_llama
from test_kernel_choice import _timer  # a fake clock: (row-major, the other kernel[, interleaved]) a call


def pack_q4_k(rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random Q4_K bytes [rows, cols/256 * 144] laid out as llama.cpp writes them (gguf-py can
    read Q4_K but not write it): fp16 d and dmin, 6-bit sc and m packed in 12 bytes, then the
    4-bit codes, run i of 32 bytes holding sub-block 2i low and 2i+1 high."""
    rng = np.random.default_rng(seed)
    n = rows * cols // 256
    d = (rng.random(n) * 0.01).astype(np.float16)
    dmin = (rng.random(n) * 0.01).astype(np.float16)
    sc = rng.integers(0, 64, (n, 8), dtype=np.uint8)
    m = rng.integers(0, 64, (n, 8), dtype=np.uint8)
    scales = np.zeros((n, 12), dtype=np.uint8)
    scales[:, 0:4] = (sc[:, 0:4] & 0x3F) | ((sc[:, 4:8] >> 4) << 6)
    scales[:, 4:8] = (m[:, 0:4] & 0x3F) | ((m[:, 4:8] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:8] & 0x0F) | ((m[:, 4:8] & 0x0F) << 4)
    codes = rng.integers(0, 16, (n, 4, 2, 32), dtype=np.uint8)
    qs = (codes[:, :, 0] | (codes[:, :, 1] << 4)).reshape(n, 128)
    blocks = np.concatenate([d.view(np.uint8).reshape(n, 2), dmin.view(np.uint8).reshape(n, 2), scales, qs], axis=1)
    return blocks.reshape(rows, cols // 256 * 144)


def test_q4_k_unpacks_to_32_weight_blocks_that_dequantize_bit_for_bit_as_gguf_py():
    raw = pack_q4_k(32, 512)
    blocks = unpack_q4_k(raw)
    assert blocks.codes.shape == (32, 512) and blocks.scales.shape == (32, 512 // GROUP)
    assert int(blocks.codes.max()) <= 15 and bool((blocks.mins <= 0).all())  # min = −dmin·m
    reference = torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType.Q4_K))
    assert torch.equal(blocks.dequantize(), reference)
    # d·sc has up to 17 significant bits: fp16 cannot keep it, so the block file stores float32
    assert not torch.equal(blocks.scales.half().float(), blocks.scales)


def test_the_kernels_bf16_scales_and_zeros_stay_within_the_stated_bound():
    blocks = unpack_q4_k(pack_q4_k(32, 512, seed=1))
    linear = torch.nn.Linear(512, 32, bias=False)
    with torch.no_grad():
        linear.weight.copy_(blocks.dequantize())
    layer = Int4Linear.from_blocks(linear, blocks, torch.bfloat16)
    scale, zero = layer.scales_and_zeros.float().unbind(-1)  # [K/32, N]
    q = blocks.codes.view(32, -1, GROUP).float()
    kernel_weights = ((q - 8) * scale.t()[..., None] + zero.t()[..., None]).view(32, 512)
    error = (kernel_weights - blocks.dequantize()).abs()
    bound = blocks.kernel_error_bound()
    assert bool((error <= bound).all()) and float(error.max()) > 0  # rounded, but never past the bound
    assert float(bound.max()) < 2 ** -7 * float(blocks.dequantize().abs().max() + 8 * blocks.scales.abs().max())
    x = torch.randn(1, 1, 512, dtype=torch.bfloat16)
    expected = x.double() @ blocks.dequantize().double().t()
    assert float((layer(x).double() - expected).abs().max()) < 0.02 * float(expected.abs().max())


def test_q5_0_runs_as_its_shipped_codes_hi_lo():
    weights = np.random.default_rng(2).standard_normal((48, 96)).astype(np.float32)
    raw = quants.quantize(weights, GGMLQuantizationType.Q5_0)
    blocks = unpack_q5_0(raw)
    assert blocks.codes.dtype == torch.int8 and int(blocks.codes.min()) == -16 and int(blocks.codes.max()) <= 15
    assert torch.equal(blocks.dequantize(), torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType.Q5_0)))
    high, low = blocks.halves()
    assert torch.equal(high.dequantize() + low.dequantize(), blocks.dequantize())  # hi|lo is exact
    linear = torch.nn.Linear(96, 48, bias=False)
    with torch.no_grad():
        linear.weight.copy_(blocks.dequantize())
    x = torch.randn(1, 1, 96, dtype=torch.bfloat16)
    expected = x.double() @ blocks.dequantize().double().t()
    got = Q8Linear.from_blocks(linear, blocks, torch.bfloat16)(x).double()
    assert float((got - expected).abs().max()) < 0.02 * float(expected.abs().max())


def _write_mixed_gguf(path, model, q4_k_down: np.ndarray):
    """A GGUF as a Q4_K_M one mixes types: o_proj Q5_0, down_proj Q4_K, up_proj Q6_K-like
    (written as F16: a type with no packed form), the tied head Q8_0."""
    writer = GGUFWriter(str(path), "llama")
    layer = model.model.layers[0]
    for name, weight, kind in (
        ("token_embd.weight", model.model.embed_tokens.weight, GGMLQuantizationType.Q8_0),
        ("blk.0.attn_output.weight", layer.self_attn.o_proj.weight, GGMLQuantizationType.Q5_0),
        ("blk.0.ffn_up.weight", layer.mlp.up_proj.weight, GGMLQuantizationType.F16),
    ):
        raw = quants.quantize(weight.detach().float().numpy(), kind)
        writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=kind)
    writer.add_tensor("blk.0.ffn_down.weight", q4_k_down, raw_shape=q4_k_down.shape, raw_dtype=GGMLQuantizationType.Q4_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture
def mixed(tmp_path):
    """A tiny llama (intermediate 256, so down_proj's rows hold whole super-blocks) whose float
    weights are what its mixed GGUF dequantizes to, and that GGUF."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=400, hidden_size=64, intermediate_size=256, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    model = LlamaForCausalLM(config).eval()
    down = pack_q4_k(64, 256, seed=3)
    layer = model.model.layers[0]
    with torch.no_grad():
        for linear, kind in ((layer.self_attn.o_proj, GGMLQuantizationType.Q5_0),
                             (model.model.embed_tokens, GGMLQuantizationType.Q8_0),
                             (layer.mlp.up_proj, GGMLQuantizationType.F16)):
            raw = quants.quantize(linear.weight.detach().float().numpy(), kind)
            linear.weight.copy_(torch.from_numpy(quants.dequantize(raw, kind).copy()).view(linear.weight.shape))
        layer.mlp.down_proj.weight.copy_(torch.from_numpy(quants.dequantize(down, GGMLQuantizationType.Q4_K)))
    return model, _write_mixed_gguf(tmp_path / "mixed.gguf", model, down)


def test_a_mixed_gguf_keeps_q4_k_as_int4_q5_0_and_q8_0_as_int8_and_names_every_linears_type(mixed, tmp_path):
    model, gguf = mixed
    assert save_block_caches(gguf, model, tmp_path) == (1, 2, 1)  # down_proj: int4 blocks and super-blocks
    assert set(load_int4_cache(tmp_path)) == {"model.layers.0.mlp.down_proj"}
    assert set(load_q8_cache(tmp_path)) == {"model.layers.0.self_attn.o_proj", "lm_head"}
    assert torch.equal(load_int4_cache(tmp_path)["model.layers.0.mlp.down_proj"].dequantize(),
                       model.model.layers[0].mlp.down_proj.weight)  # float32 scales kept them exact
    assert load_kinds(tmp_path) == {"lm_head": "Q8_0", "model.layers.0.self_attn.o_proj": "Q5_0",
                                    "model.layers.0.mlp.down_proj": "Q4_K", "model.layers.0.mlp.up_proj": "F16"}
    from safetensors import safe_open

    for name in (INT4_CACHE, Q8_CACHE):
        with safe_open(str(tmp_path / name), "pt") as f:
            assert f.metadata()["layout"] == BLOCKS_LAYOUT
    with safe_open(str(tmp_path / Q8_CACHE), "pt") as f:
        assert json.loads(f.metadata()["kinds"])["lm_head"] == "Q8_0" and f.metadata()["head"] == "Q8_0"


def test_status_names_what_each_group_runs_as_and_why_a_dense_one_is_dense(mixed, tmp_path):
    model, gguf = mixed
    save_block_caches(gguf, model, tmp_path)
    layer = model.model.layers[0]
    int4, q8 = load_int4_cache(tmp_path), load_q8_cache(tmp_path)
    layer.mlp.down_proj = Int4Linear.from_blocks(layer.mlp.down_proj, int4["model.layers.0.mlp.down_proj"],
                                                 torch.bfloat16)
    layer.self_attn.o_proj = Q8Linear.from_blocks(layer.self_attn.o_proj, q8["model.layers.0.self_attn.o_proj"],
                                                  torch.bfloat16)
    found = formats.groups(model, load_kinds(tmp_path))
    by_role = {group.role: group for group in found}
    assert by_role["model.layers.*.mlp.down_proj"] == formats.TensorGroup(
        "model.layers.*.mlp.down_proj", "Q4_K", "int4", 1, None)
    assert by_role["model.layers.*.self_attn.o_proj"].runs == "int4 hi|lo"
    assert by_role["model.layers.*.mlp.up_proj"].why == "shipped unquantized"
    assert by_role["lm_head"].why == "its blocks did not match the float weights at conversion, or --weights float"
    assert by_role["model.layers.*.self_attn.q_proj"].kind == "float"  # not in this GGUF
    assert formats.summary(found) == "dense float32 6, int4 1, int4 hi|lo 1"
    assert "mlp.down_proj Q4_K x1: int4; " in formats.describe(found)
    unrecorded = {g.role: g.kind for g in formats.groups(model, {})}  # block files made before the types
    assert unrecorded["model.layers.*.mlp.down_proj"] == "GGUF" and unrecorded["lm_head"] == "float"
    q6 = formats.groups(model, {"model.layers.0.mlp.up_proj": "Q6_K"})
    assert {g.role: g.why for g in q6}["model.layers.*.mlp.up_proj"] == (
        "16-weight sub-blocks with their own scales: no exact form in torch's int4 kernel's 32-weight groups")


def test_block_files_of_an_older_layout_are_added_again_and_the_start_says_what_adds_them(tmp_path):
    from safetensors.torch import save_file

    from memrad.engine.model.loader import _int4_source
    from memrad.engine.model.pull import has_block_caches

    for name in (INT4_CACHE, Q8_CACHE):  # as memrad before Q4_K wrote them: no layout stamp
        save_file({}, str(tmp_path / name), metadata={"source": "gemma-3-270m-q4_k_m.gguf"})
    assert not has_block_caches(tmp_path)
    assert _int4_source("gemma3-270m", tmp_path, 0) == (
        "its GGUF's blocks were kept by an older memrad (no Q4_K / Q5_0, or no k-quant super-blocks): "
        "`memrad pull gemma3-270m` adds them")
    for name in (INT4_CACHE, Q8_CACHE):
        save_file({}, str(tmp_path / name), metadata={"layout": BLOCKS_LAYOUT})
    assert has_block_caches(tmp_path)
    assert _int4_source("gemma3-270m", tmp_path, 0) == "the GGUF ships no Q4_0/Q4_1/Q4_K linear weights"


@pytest.mark.parametrize("rows", [(128, 64), (48, 16)])
def test_fused_hi_lo_projections_compute_what_each_computes(rows):
    """Rows in whole blocks of 64 (gemma3-270m's 1024 + 256 + 256) share one packed tensor;
    others (the CPU packing interleaves 64 rows) are run one by one, never joined wrongly."""
    from memrad.engine.decode.steps.llama import fuse

    layers = []
    for count, seed in zip(rows, (4, 5)):  # q and a smaller k, as a Q5_0 attention ships them
        weights = np.random.default_rng(seed).standard_normal((count, 96)).astype(np.float32)
        blocks = unpack_q5_0(quants.quantize(weights, GGMLQuantizationType.Q5_0))
        linear = torch.nn.Linear(96, count, bias=False, dtype=torch.bfloat16)
        with torch.no_grad():
            linear.weight.copy_(blocks.dequantize())
        layers.append(Q8Linear.from_blocks(linear, blocks, torch.bfloat16))
    x = torch.randn(1, 1, 96, dtype=torch.bfloat16)
    apart = torch.cat([layer(x) for layer in layers], dim=-1)
    fused = fuse(layers)
    assert torch.equal(fused(x), apart)
    if rows[0] % 64 == 0:
        assert type(fused) is Q8Linear and fused.out_features == sum(rows)
        assert layers[1].packed.data_ptr() == fused.packed[rows[0]:].data_ptr()  # a view, not a copy
    else:
        assert type(fused).__name__ == "_Concatenated"


def test_status_names_the_head_s_gguf_blocks_on_memra_s_kernel_and_says_why_hi_lo_where_it_cannot_run(mixed, tmp_path):
    from memrad.engine.kernels import block_gemv
    from memrad.engine.model.block_linear import BlockLinear

    model, gguf = mixed
    save_block_caches(gguf, model, tmp_path)
    q8 = load_q8_cache(tmp_path)
    original = model.lm_head
    model.lm_head = Q8Linear.from_blocks(original, q8["lm_head"], torch.bfloat16)
    layer = model.model.layers[0]
    layer.self_attn.o_proj = Q8Linear.from_blocks(layer.self_attn.o_proj, q8["model.layers.0.self_attn.o_proj"],
                                                  torch.bfloat16)
    why = "memra's block kernel: the CPU kernels are AVX2 (memra's block kernel is measured on AVX512 only)"
    by_role = {g.role: g for g in formats.groups(model, load_kinds(tmp_path), why)}
    assert by_role["lm_head"].why == why and by_role["model.layers.*.self_attn.o_proj"].why is None
    assert f"lm_head Q8_0 x1: int4 hi|lo ({why})" in formats.describe(tuple(by_role.values()))
    if block_gemv.why_not() is None:
        model.lm_head = BlockLinear.from_blocks(original, q8["lm_head"])
        found = formats.groups(model, load_kinds(tmp_path))
        assert {g.role: (g.runs, g.why) for g in found}["lm_head"] == ("Q8_0 blocks", None)
        assert formats.summary(found) == "Q8_0 blocks 1, dense float32 6, int4 hi|lo 1"


def _qwen3_k_quants(tmp_path, monkeypatch):
    """A tiny Qwen3 GGUF as a Q4_K_M / Q5_K_M file mixes k-quants: attention and gate/up Q4_K,
    attn_output Q5_K, ffn_down Q6_K, the embedding Q8_0; memra's own cache for it."""
    import tiny_gguf

    monkeypatch.setenv("MEMRA_CACHE_DIR", str(tmp_path))
    return tiny_gguf.tiny_gguf(tmp_path, "qwen3", kinds=lambda name, shape: (
        GGMLQuantizationType.Q5_K if ".attn_output" in name else tiny_gguf.kind_for(name, shape)))[0]


def _load_gguf(path):
    from memrad.engine.model.loader import load_model

    torch.set_num_threads(1)
    return load_model(str(path), device="cpu", dtype="bfloat16", weights="auto", progress=lambda _: None)


def test_a_tiny_gguf_of_k_quants_loads_its_super_blocks_onto_memras_kernel_where_it_wins(tmp_path, monkeypatch):
    from memrad.engine.kernels import block_gemv
    from memrad.engine.model import kernel_choice
    from memrad.engine.model.block_linear import BlockLinear

    if block_gemv.why_not() is not None:
        pytest.skip(block_gemv.why_not())
    path = _qwen3_k_quants(tmp_path, monkeypatch)
    # (on AVX2 the Q8_0 head is measured too, with its interleaved arm third)
    monkeypatch.setattr(kernel_choice, "_fastest", _timer(1e-4, 3e-4, 3e-4))
    loaded = _load_gguf(path)
    model = loaded.model
    layer = model.model.layers[0]
    formats_of = {name: (type(m).__name__, getattr(m, "format", None)) for name, m in
                  (("q", layer.self_attn.q_proj), ("o", layer.self_attn.o_proj), ("down", layer.mlp.down_proj))}
    assert formats_of == {"q": ("BlockLinear", "Q4_K"), "o": ("BlockLinear", "Q5_K"), "down": ("BlockLinear", "Q6_K")}
    kernel = block_gemv.path()
    assert (f"self_attn.o_proj Q5_K x2: Q5_K blocks (memra block kernel, {kernel}, 3.0x dense bfloat16 "
            "(measured at load, one row))") in loaded.tensors.reason
    assert f"mlp.down_proj Q6_K x2: Q6_K blocks (memra block kernel, {kernel}, 3.0x dense bfloat16" in loaded.tensors.reason
    assert f"self_attn.q_proj Q4_K x2: Q4_K blocks (memra block kernel, {kernel}, 3.0x torch int4 (" in loaded.tensors.reason
    # each layer multiplies the GGUF's weights (as gguf-py reads them), within the int16 rounding of x
    for linear in (m for m in model.modules() if isinstance(m, BlockLinear) and m.format.endswith("_K")):
        x = torch.randn(3, 1, linear.in_features, dtype=torch.bfloat16)  # 3 rows, one token each
        w = SuperBlocks(linear.format, linear.blocks).dequantize().double()
        assert torch.equal(w.to(torch.bfloat16), linear.weight)  # what prefill's dense weight was made of
        expected = x.view(3, -1).double() @ w.t()
        bound = block_gemv.rounding_bound(x.view(3, -1).float(), w, block_gemv.activation_step(kernel))
        got = linear(x).view(3, -1).double()
        assert bool(((got - expected).abs() <= bound + 2 ** -8 * expected.abs() + 1e-6).all())  # + the bf16 output
        assert torch.equal(linear(x[1:2]), linear(x)[1:2])  # a row alone is the row among others


def test_where_memras_kernel_loses_q4_k_runs_on_the_int4_kernel_and_q6_k_q5_k_stay_dense_and_status_says_why(
        tmp_path, monkeypatch):
    from memrad.engine.kernels import block_gemv
    from memrad.engine.model import kernel_choice
    from memrad.engine.model.block_linear import BlockLinear

    if block_gemv.why_not() is not None:
        pytest.skip(block_gemv.why_not())
    path = _qwen3_k_quants(tmp_path, monkeypatch)
    monkeypatch.setattr(kernel_choice, "_fastest", _timer(4e-4, 2e-4, 4e-4))
    loaded = _load_gguf(path)
    layer = loaded.model.model.layers[0]
    assert type(layer.self_attn.q_proj) is Int4Linear
    assert type(layer.mlp.down_proj) is torch.nn.Linear and type(layer.self_attn.o_proj) is torch.nn.Linear
    assert not any(isinstance(m, BlockLinear) and m.format.endswith("_K") for m in loaded.model.modules())
    kernel = block_gemv.path()
    assert (f"mlp.down_proj Q6_K x2: dense bfloat16 (dense bfloat16, 2.0x memra block kernel ({kernel}; "
            "measured at load, one row))") in loaded.tensors.reason
    assert f"self_attn.q_proj Q4_K x2: int4 (torch int4, 2.0x memra block kernel ({kernel};" in loaded.tensors.reason
