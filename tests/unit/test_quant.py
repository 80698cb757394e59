"""Packed weights: GGUF blocks unpack to what gguf-py dequantizes, the kernels agree with dense."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from memrad.engine.model.quant import (
    GROUP, Int4Blocks, Int4Linear, Int8Blocks, Int8Linear, Q8Linear, quantize_q4_1, unpack_blocks, unpack_q8_0,
)


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


def test_unpacked_q8_0_blocks_dequantize_exactly_as_gguf_defines_them():
    weights = np.random.default_rng(0).standard_normal((48, 96)).astype(np.float32)
    raw = quants.quantize(weights, GGMLQuantizationType.Q8_0)  # [48, 3 blocks x 34 bytes]
    blocks = unpack_q8_0(raw)
    assert blocks.codes.shape == (48, 96) and blocks.codes.dtype == torch.int8
    assert blocks.scales.shape == (48, 3) and int(blocks.codes.abs().max()) == 127  # each block's max
    assert torch.equal(blocks.dequantize(), torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType.Q8_0)))


def test_q8_0_blocks_are_exactly_two_int4_halves_over_the_whole_int8_range():
    codes = torch.arange(-128, 128, dtype=torch.int16).to(torch.int8).view(8, 32)  # every code once
    d = (torch.tensor([[2.0 ** -e] for e in range(8)]) * 0.7).half().float()  # fp16, as shipped
    blocks = Int8Blocks(codes, d)
    high, low = blocks.halves()
    assert int(high.codes.max()) == 15 and int(low.codes.max()) == 15 and int(high.codes.min()) == 0
    assert torch.equal(high.dequantize() + low.dequantize(), blocks.dequantize())


def _exact_blocks(kind: str, n: int, k: int) -> Int4Blocks | Int8Blocks:
    """Random blocks whose every weight, scale and zero is exact in bf16 (powers-of-two
    scales, zeros small multiples of them): the kernel must reproduce each weight bit for bit."""
    g = torch.Generator().manual_seed(0)
    scales = 2.0 ** torch.randint(-9, -2, (n, k // GROUP), generator=g).float()
    if kind == "Q8_0":
        return Int8Blocks(torch.randint(-128, 128, (n, k), generator=g).to(torch.int8), scales)
    codes = torch.randint(0, 16, (n, k), generator=g).to(torch.uint8)
    mins = scales * torch.randint(-16, 1, scales.shape, generator=g) if kind == "Q4_1" else None
    return Int4Blocks(codes, scales, mins)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_the_packed_kernel_reproduces_every_shipped_weight_bit_for_bit(kind):
    blocks = _exact_blocks(kind, 32, 64)
    linear = torch.nn.Linear(64, 32, bias=False)
    with torch.no_grad():
        linear.weight.copy_(blocks.dequantize())
    layer = (Q8Linear if kind == "Q8_0" else Int4Linear).from_blocks(linear, blocks, torch.bfloat16)
    # one-hot inputs read the weight matrix out one column at a time, through the packed path
    columns = [layer(torch.eye(64)[j].view(1, 1, 64)).view(32) for j in range(64)]
    assert torch.equal(torch.stack(columns, dim=1), blocks.dequantize())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_q8_head_runs_its_blocks_for_one_token_and_the_dense_weight_for_more(dtype):
    rng = np.random.default_rng(0)
    blocks = unpack_q8_0(quants.quantize((0.05 * rng.standard_normal((400, 64))).astype(np.float32),
                                         GGMLQuantizationType.Q8_0))
    head = torch.nn.Linear(64, 400, bias=False)
    with torch.no_grad():
        head.weight.copy_(blocks.dequantize())
    head = head.to(dtype)
    packed = Q8Linear.from_blocks(head, blocks, torch.bfloat16)
    assert packed.weight is head.weight  # a tied head keeps sharing the embedding's float weight
    many = torch.randn(1, 5, 64).to(dtype)
    assert torch.equal(packed(many), head(many))  # prefill: the same dense GEMM, bit for bit
    worst = 0.0
    for seed in range(20):
        x = 3 * torch.randn(1, 1, 64, generator=torch.Generator().manual_seed(seed))
        exact = x.double() @ blocks.dequantize().double().t()  # [1, 1, 400]
        got = packed(x.to(dtype))
        assert got.shape == (1, 1, 400) and got.dtype == dtype
        worst = max(worst, ((got.double() - exact).abs().max() / exact.abs().max()).item())
    # bf16 inputs, scales and output: measured 0.0049 of the largest logit here (a bf16 dense
    # head: 0.0051); on SmolLM2's real head and hidden states 0.0081 (bf16 dense: 0.0053)
    assert worst < 0.006


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
