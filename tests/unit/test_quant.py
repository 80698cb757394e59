"""Packed weights: GGUF blocks unpack to what gguf-py dequantizes, the kernels agree with dense."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from memrad.engine.quant import GROUP, Int4Linear, Int8Linear, quantize_q4_1, unpack_blocks


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_unpacked_blocks_dequantize_exactly_as_gguf_defines_them(kind):
    rng = np.random.default_rng(0)
    weights = rng.standard_normal((48, 96)).astype(np.float32)
    raw = quants.quantize(weights, GGMLQuantizationType[kind])  # [48, 3 blocks x bytes]
    blocks = unpack_blocks(raw, kind)
    assert blocks.codes.shape == (48, 96) and int(blocks.codes.max()) <= 15
    assert (blocks.mins is None) == (kind == "Q4_0")
    reference = torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType[kind]))
    assert torch.equal(blocks.dequantize(), reference)


def test_a_row_permutation_moves_codes_scales_and_mins_together():
    blocks = quantize_q4_1(torch.randn(8, 64))
    rows = torch.tensor([3, 1, 0, 2, 7, 6, 5, 4])
    assert torch.equal(blocks.permuted(rows).dequantize(), blocks.dequantize()[rows])


def _linear(n: int, k: int, dtype: torch.dtype) -> tuple[torch.nn.Linear, object]:
    torch.manual_seed(0)
    linear = torch.nn.Linear(k, n, bias=False)
    blocks = quantize_q4_1(linear.weight)
    with torch.no_grad():
        linear.weight.copy_(blocks.dequantize())
    return linear.to(dtype), blocks


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_int4_linear_runs_packed_codes_for_one_token_and_the_dense_weight_for_more(dtype):
    linear, blocks = _linear(96, 128, dtype)
    packed = Int4Linear.from_blocks(linear, blocks, torch.bfloat16)
    one = torch.randn(1, 1, 128).to(dtype)
    many = torch.randn(1, 5, 128).to(dtype)
    assert torch.equal(packed(many), linear(many))  # prefill: the same dense GEMM, bit for bit
    got, want = packed(one).float(), linear(one).float()
    assert got.shape == (1, 1, 96) and packed(one).dtype == dtype
    # the int4 kernel: same codes, scales rounded to bf16, bf16 inputs
    assert (got - want).abs().max().item() < 0.05 * want.abs().max().item()


def test_int4_scales_and_zeros_follow_the_tinygemm_convention():
    linear, blocks = _linear(32, 64, torch.float32)
    packed = Int4Linear.from_blocks(linear, blocks, torch.float32)
    # w = (q - 8) * scale + zero  with  scale = d, zero = m + 8 d
    sz = packed.scales_and_zeros  # [K/32, N, 2]
    assert sz.shape == (64 // GROUP, 32, 2)
    q = blocks.codes.view(32, 2, GROUP).float()
    rebuilt = (q - 8) * sz[..., 0].t()[..., None] + sz[..., 1].t()[..., None]
    assert torch.allclose(rebuilt.view(32, 64), blocks.dequantize(), atol=1e-6)


def test_int8_linear_is_close_to_dense_for_one_token_and_exact_for_more():
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 48, bias=True).to(torch.bfloat16)
    packed = Int8Linear(linear)
    many = torch.randn(2, 3, 64).to(torch.bfloat16)
    assert torch.equal(packed(many), linear(many))
    one = torch.randn(1, 1, 64).to(torch.bfloat16)
    assert (packed(one).float() - linear(one).float()).abs().max().item() < 0.05
