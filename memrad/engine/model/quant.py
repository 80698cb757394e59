"""Weight-only quantized linear layers, loaded from a GGUF's own blocks (no float round trip).

A GGUF Q4_1 block is 32 weights of one output row: w = q·d + m, q in 0..15, d and m fp16.
torch's int4 kernels (the CPU `_weight_int4pack_mm_for_cpu`, CUDA's tinygemm
`_weight_int4pack_mm`) take the same shape of quantization, group 32 along the input, with
w = (q - 8)·scale + zero. So a block maps onto the packed format exactly by

    scale = d,  zero = m + 8·d          (Q4_0: w = (q - 8)·d, so zero = 0)

up to the scales' dtype: the kernels keep scale and zero in the activation dtype (bf16), so
d and m lose their last 3 mantissa bits. The 4-bit codes are the shipped ones, bit for bit.

    block (20 B)   | d fp16 | m fp16 | qs[16]: low nibble = weight j, high nibble = weight j+16 |
    codes          q  [N, K]          uint8 0..15     (N output rows, K inputs)
    scales/zeros   sz [K/32, N, 2]    activation dtype
    packed         [N, K/2] uint8 (CPU) or the tinygemm tile layout (CUDA)

The int4 kernel reads a quarter of the bytes and wins for one token, but loses several-fold to
the dense bf16 GEMM on a 256-token prefill chunk (measured: docs/BENCHMARKS.md, Weight
formats). So an Int4Linear keeps the
dense weight for prefill and runs the packed codes only for single-token (decode) steps.

A Q8_0 block (the output head llama.cpp ships: 32 int8 codes q in -128..127, one fp16 d,
w = q·d) is exactly two int4 blocks, since q = 16·(hi - 8) + lo with 4-bit codes

    hi = (q >> 4) + 8   scale 16·d, zero 0     ->  16·d·(hi - 8)
    lo = q & 15         scale d,    zero 8·d   ->  d·lo

A Q8Linear lays hi and lo side by side along the input ([N, 2K] codes, 2K/32 groups of
scales) and feeds the kernel the activation twice, [x, x]: one call sums both halves in the
kernel's own fp32 accumulator: faster than two calls summed and than the bf16 dense GEMV, and
as accurate as two calls (its error is the cost of bf16 scales, as for the int4 layers; both
measured: docs/BENCHMARKS.md, Decode: the step's parts). Its logits are bf16 whatever the
activation dtype.

K-quants and Q5_0 (what a Q4_K_M GGUF ships besides Q8_0; gemma3-270m is one):

    Q4_K  super-block of 256 = 8 sub-blocks of 32; fp16 d, dmin; 6-bit sc, m per sub-block;
          w = q·(d·sc) − dmin·m, q in 0..15     ->  Int4Blocks, scale d·sc, min −dmin·m
    Q5_0  32 weights, fp16 d, 5-bit q in 0..31; w = (q − 16)·d   ->  Int8Blocks, codes q − 16
    Q6_K  16 sub-blocks of 16 with int8 scales: no 32-weight group has one scale, so it
          cannot map onto the int4 kernel's group 32 exactly
    Q5_K  as Q4_K with 5-bit q in 0..31: no int4 pass holds it

All three k-quants also run as shipped, their super-blocks' bytes kept whole (SuperBlocks), on
memra's block kernel (memrad.engine.model.block_linear), where it runs and wins; elsewhere Q4_K
runs on the int4 kernel as above and Q6_K, Q5_K stay dense (memrad.engine.model.weights).

d·sc (11 + 6 significant bits) and −dmin·m are exact in float32, so the blocks dequantize to
the float weights transformers makes of them bit for bit (gguf-py computes the same float32
products); the int4 kernel then rounds scale and zero to bf16, as for Q4_1: each weight moves
by at most 2^-8·(|q − 8|·|scale| + |zero|) (`kernel_error_bound`, tested). A Q5_0 tensor runs
the Q8_0 way, hi|lo, its codes exact: 5 bits do not fit one int4 pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch.nn import functional as F

GROUP = 32
# bytes per block of 32 weights, and where the 16 bytes of codes start in it
_BLOCK_LAYOUT = {"Q4_0": (18, 2), "Q4_1": (20, 4)}
_Q8_0_BLOCK_BYTES = 34
_Q5_0_BLOCK_BYTES = 22  # d fp16 | qh: bit j = the high bit of weight j (uint32) | qs[16] as Q4_0
_Q4_K_BLOCK_BYTES = 144  # d fp16 | dmin fp16 | 12 bytes of 6-bit sc, m | qs[128]
SUPER_BLOCK = 256  # weights per k-quant super-block
SUPER_BLOCK_BYTES = {"Q4_K": _Q4_K_BLOCK_BYTES, "Q5_K": 176, "Q6_K": 210}  # llama.cpp's block_q4_K / _q5_K / _q6_K
# Blocks kept whole as shipped that are not k-quants: (weights, bytes) a block. MXFP4 (gpt-oss's
# experts): an E8M0 scale byte and 16 bytes of E2M1 codes per 32 weights (llama.cpp's block_mxfp4).
WHOLE_BLOCKS = {"MXFP4": (GROUP, 17), **{kind: (SUPER_BLOCK, size) for kind, size in SUPER_BLOCK_BYTES.items()}}
_BF16_ROUNDOFF = 2.0 ** -8  # bf16 keeps 8 significant bits: rounding moves a value by <= 2^-8 of it


@dataclass(frozen=True, slots=True)
class Int4Blocks:
    """One weight matrix's GGUF blocks, unpacked: codes, scales and mins as shipped."""

    codes: torch.Tensor  # [N, K] uint8, 0..15
    scales: torch.Tensor  # [N, K/32] float32 (the block's d)
    mins: torch.Tensor | None  # [N, K/32] float32 (Q4_1's m); None for Q4_0 (symmetric around 8)

    @property
    def shape(self) -> tuple[int, int]:
        """(N, K) of the weight matrix."""
        return tuple(self.codes.shape)

    def dequantize(self) -> torch.Tensor:
        """The float weights [N, K] float32, computed as GGUF defines them (q·d + m)."""
        n, k = self.codes.shape
        q = self.codes.view(n, k // GROUP, GROUP).float()
        if self.mins is None:
            w = (q - 8) * self.scales[..., None]
        else:
            w = q * self.scales[..., None] + self.mins[..., None]
        return w.view(n, k)

    def permuted(self, rows: torch.Tensor) -> "Int4Blocks":
        """The same blocks with output rows reordered (transformers un-permutes llama's Q/K)."""
        return Int4Blocks(self.codes[rows], self.scales[rows], None if self.mins is None else self.mins[rows])

    def kernel_error_bound(self) -> torch.Tensor:
        """[N, K] float32: how far the kernel's weights, (q − 8)·bf16(scale) + bf16(zero), may
        lie from `dequantize()` (its scale and zero rounded to bf16: 2^-8 of each, at most)."""
        n, k = self.codes.shape
        zeros = torch.zeros_like(self.scales) if self.mins is None else self.mins + 8 * self.scales
        q = self.codes.view(n, k // GROUP, GROUP).float()
        bound = (q - 8).abs() * self.scales.abs()[..., None] + zeros.abs()[..., None]
        # + 2^-20: the float32 sums (q·scale + min against (q − 8)·scale + zero) round too
        return (bound * (_BF16_ROUNDOFF + 2.0 ** -20)).view(n, k)


@dataclass(frozen=True, slots=True)
class SuperBlocks:
    """One weight matrix's GGUF k-quant super-blocks (Q4_K, Q5_K, Q6_K: 256 weights each), or
    another type's blocks kept whole (MXFP4: 32 weights each, WHOLE_BLOCKS), the bytes as shipped;
    memra's block kernel reads them as they are."""

    kind: str  # "Q4_K", "Q5_K", "Q6_K" or "MXFP4"
    raw: torch.Tensor  # [N, K / weights a block · bytes a block] uint8 (WHOLE_BLOCKS)

    @property
    def shape(self) -> tuple[int, int]:
        """(N, K) of the weight matrix."""
        weights, size = WHOLE_BLOCKS[self.kind]
        return self.raw.shape[0], self.raw.shape[1] // size * weights

    def dequantize(self) -> torch.Tensor:
        """The float weights [N, K] float32, as gguf-py (and so transformers' GGUF loader) computes them."""
        from gguf import GGMLQuantizationType, quants

        weights = quants.dequantize(self.raw.numpy(), GGMLQuantizationType[self.kind])
        return torch.from_numpy(np.ascontiguousarray(weights, dtype=np.float32)).view(self.shape)

    def permuted(self, rows: torch.Tensor) -> "SuperBlocks":
        """The same blocks with output rows reordered (transformers un-permutes llama's Q/K)."""
        return SuperBlocks(self.kind, self.raw[rows].contiguous())


def random_super_blocks(kind: str, rows: int, cols: int, generator: torch.Generator) -> SuperBlocks:
    """Random k-quant super-blocks [rows, cols] (`cols` a multiple of 256): every byte random but
    the fp16 d (and dmin), small positive values, as a real tensor's are. gguf-py reads k-quants
    but cannot write them; memra's kernel probe and the tests take these. MXFP4 (`cols` a multiple
    of 32): random codes, scale bytes e in 117..124 (weights of 2^-11..2^-4 times a code up to 12,
    as a trained expert's are)."""
    weights, size = WHOLE_BLOCKS[kind]
    assert cols % weights == 0, f"a {kind} row holds whole blocks of {weights}, not {cols}"
    n = rows * cols // weights
    raw = torch.randint(0, 256, (n, size), generator=generator, dtype=torch.uint8)
    scales = (torch.rand(n, 2, generator=generator) / 100).half().view(torch.uint8)  # [n, 4]: d, dmin
    if kind == "MXFP4":
        raw[:, 0] = torch.randint(117, 125, (n,), generator=generator, dtype=torch.uint8)
    elif kind == "Q6_K":
        raw[:, 208:210] = scales[:, :2]
    else:
        raw[:, 0:4] = scales
    return SuperBlocks(kind, raw.view(rows, cols // weights * size).contiguous())


@dataclass(frozen=True, slots=True)
class Int8Blocks:
    """One weight matrix's GGUF Q8_0 blocks, unpacked: codes and scales as shipped."""

    codes: torch.Tensor  # [N, K] int8
    scales: torch.Tensor  # [N, K/32] float32 (the block's d)

    @property
    def shape(self) -> tuple[int, int]:
        """(N, K) of the weight matrix."""
        return tuple(self.codes.shape)

    def dequantize(self) -> torch.Tensor:
        """The float weights [N, K] float32, computed as GGUF defines them (q·d)."""
        n, k = self.codes.shape
        return (self.codes.view(n, k // GROUP, GROUP).float() * self.scales[..., None]).view(n, k)

    def permuted(self, rows: torch.Tensor) -> "Int8Blocks":
        """The same blocks with output rows reordered (transformers un-permutes llama's Q/K)."""
        return Int8Blocks(self.codes[rows], self.scales[rows])

    def halves(self) -> tuple[Int4Blocks, Int4Blocks]:
        """(high, low): int4 blocks whose weights sum to these exactly (module docstring)."""
        q = self.codes.to(torch.int16)
        high = Int4Blocks(((q >> 4) + 8).to(torch.uint8), 16 * self.scales, None)  # (hi - 8)·16d
        low = Int4Blocks((q & 15).to(torch.uint8), self.scales, torch.zeros_like(self.scales))  # lo·d
        return high, low


def quantize_q4_1(weight: torch.Tensor) -> Int4Blocks:
    """Q4_1 blocks for a float weight [N, K] (min/max per block, d and m rounded to fp16 as
    llama.cpp stores them). For models that ship no GGUF: tests and the random-weight model."""
    n, k = weight.shape
    groups = weight.detach().float().reshape(n, k // GROUP, GROUP)
    low, high = groups.amin(-1), groups.amax(-1)
    d = ((high - low) / 15).half().float()
    m = low.half().float()
    safe = torch.where(d == 0, torch.ones_like(d), d)
    codes = torch.round((groups - m[..., None]) / safe[..., None]).clamp(0, 15).to(torch.uint8)
    return Int4Blocks(codes.reshape(n, k), d, m)


def unpack_blocks(raw: np.ndarray, kind: str) -> Int4Blocks:
    """Split a GGUF Q4_0/Q4_1 tensor's bytes [N, K/32 * block bytes] into codes, scales, mins."""
    size, codes_at = _BLOCK_LAYOUT[kind]
    blocks = torch.from_numpy(np.ascontiguousarray(raw)).view(raw.shape[0], -1, size)  # [N, K/32, size]
    n, nb, _ = blocks.shape
    d = blocks[..., 0:2].contiguous().view(torch.float16).view(n, nb).float()
    m = blocks[..., 2:4].contiguous().view(torch.float16).view(n, nb).float() if kind == "Q4_1" else None
    qs = blocks[..., codes_at:codes_at + 16]
    codes = torch.cat([qs & 0x0F, qs >> 4], dim=-1).reshape(n, nb * GROUP)  # [N, K]
    return Int4Blocks(codes.contiguous(), d, m)


def unpack_q8_0(raw: np.ndarray) -> Int8Blocks:
    """Split a GGUF Q8_0 tensor's bytes [N, K/32 * 34] (per block: d fp16, then 32 int8 codes)."""
    blocks = torch.from_numpy(np.ascontiguousarray(raw)).view(raw.shape[0], -1, _Q8_0_BLOCK_BYTES)
    n, nb, _ = blocks.shape
    d = blocks[..., 0:2].contiguous().view(torch.float16).view(n, nb).float()
    codes = blocks[..., 2:].contiguous().view(torch.int8).reshape(n, nb * GROUP)  # [N, K]
    return Int8Blocks(codes, d)


def unpack_q4_k(raw: np.ndarray) -> Int4Blocks:
    """Split a GGUF Q4_K tensor's bytes [N, K/256 * 144] into codes, scales d·sc and mins −dmin·m
    per 32-weight sub-block (float32 products, as gguf-py dequantizes them)."""
    blocks = torch.from_numpy(np.ascontiguousarray(raw)).view(raw.shape[0], -1, _Q4_K_BLOCK_BYTES)
    n, nb, _ = blocks.shape
    d = blocks[..., 0:2].contiguous().view(torch.float16).float()  # [N, nb, 1]
    dmin = blocks[..., 2:4].contiguous().view(torch.float16).float()
    packed = blocks[..., 4:16].reshape(n, nb, 3, 4)  # bytes 0-3: sc low 6 bits, 4-7: m, 8-11: the rest
    low_sc, low_m, rest = packed[..., 0, :], packed[..., 1, :], packed[..., 2, :]
    sc = torch.cat([low_sc & 0x3F, (rest & 0x0F) | ((low_sc >> 2) & 0x30)], dim=-1)  # [N, nb, 8]
    m = torch.cat([low_m & 0x3F, (rest >> 4) | ((low_m >> 2) & 0x30)], dim=-1)
    # qs: 4 runs of 32 bytes; run i holds sub-block 2i in its low nibbles, 2i+1 in its high ones
    qs = blocks[..., 16:].reshape(n, nb, 4, 1, 32)
    codes = torch.cat([qs & 0x0F, qs >> 4], dim=3).reshape(n, nb * 256)  # [N, K]
    scales = (d * sc.float()).reshape(n, nb * 8)
    mins = -(dmin * m.float()).reshape(n, nb * 8)
    return Int4Blocks(codes.contiguous(), scales, mins)


def unpack_q5_0(raw: np.ndarray) -> Int8Blocks:
    """Split a GGUF Q5_0 tensor's bytes [N, K/32 * 22] into int8 codes q − 16 and d."""
    blocks = torch.from_numpy(np.ascontiguousarray(raw)).view(raw.shape[0], -1, _Q5_0_BLOCK_BYTES)
    n, nb, _ = blocks.shape
    d = blocks[..., 0:2].contiguous().view(torch.float16).view(n, nb).float()
    high = blocks[..., 2:6].contiguous().view(torch.int32)  # [N, nb, 1], little-endian as shipped
    high_bits = ((high >> torch.arange(32, dtype=torch.int32)) & 1).to(torch.uint8)  # [N, nb, 32]
    qs = blocks[..., 6:]
    low = torch.cat([qs & 0x0F, qs >> 4], dim=-1)  # [N, nb, 32]
    codes = ((low | (high_bits << 4)).to(torch.int16) - 16).to(torch.int8).reshape(n, nb * GROUP)
    return Int8Blocks(codes.contiguous(), d)


def _scales_and_zeros(blocks: Int4Blocks, dtype: torch.dtype) -> torch.Tensor:
    # w = (q - 8)·scale + zero: Q4_1's q·d + m needs zero = m + 8·d; Q4_0's (q - 8)·d needs 0
    zeros = torch.zeros_like(blocks.scales) if blocks.mins is None else blocks.mins + 8 * blocks.scales
    return torch.stack([blocks.scales.t(), zeros.t()], dim=-1).contiguous().to(dtype)  # [K/32, N, 2]


def _pack(codes: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cpu":
        return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
    # tinygemm takes two codes per byte, the even column in the high nibble (torchao's layout),
    # and K in tiles of 16 x innerKTiles (2, 4 or 8): SmolLM2's K = 576 allows 4, not 8.
    paired = (codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8).to(device)
    inner_k_tiles = next(t for t in (8, 4, 2) if codes.shape[1] % (16 * t) == 0)
    return torch.ops.aten._convert_weight_to_int4pack(paired, inner_k_tiles)


class Int4Linear(torch.nn.Linear):
    """A Linear whose single-token calls run the packed int4 codes; longer inputs (prefill)
    run the dense `weight` it still holds (see the module docstring for why both)."""

    def __init__(self, linear: torch.nn.Linear, packed: torch.Tensor, scales_and_zeros: torch.Tensor) -> None:
        torch.nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        device = linear.weight.device
        self.kernel_dtype = scales_and_zeros.dtype  # the int4 kernels run bf16 (or fp16) activations
        self.register_buffer("packed", packed.to(device), persistent=False)
        self.register_buffer("scales_and_zeros", scales_and_zeros.to(device), persistent=False)
        self._mm = (torch.ops.aten._weight_int4pack_mm_for_cpu if device.type == "cpu"
                    else torch.ops.aten._weight_int4pack_mm)

    @classmethod
    def from_blocks(cls, linear: torch.nn.Linear, blocks: Int4Blocks, kernel_dtype: torch.dtype) -> "Int4Linear":
        """Pack `blocks` for the kernel of `linear`'s device (seconds for a whole model on a
        loaded CPU: memrad.engine.model.weights keeps the result)."""
        device = linear.weight.device
        return cls(linear, _pack(blocks.codes, device), _scales_and_zeros(blocks, kernel_dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., T, K]; the packed path only where one token goes through (decode)
        if x.dim() < 2 or x.shape[-2] != 1:
            return F.linear(x, self.weight, self.bias)
        flat = x.reshape(-1, self.in_features).to(self.kernel_dtype)  # [1, K]
        y = self._mm(self.kernel_input(flat), self.packed, GROUP, self.scales_and_zeros).to(x.dtype)  # [1, N]
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def kernel_input(self, flat: torch.Tensor) -> torch.Tensor:
        """What the packed codes multiply: the activation itself here."""
        return flat

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, int4 group {GROUP} ({self.kernel_dtype}) for single tokens"


class Q8Linear(Int4Linear):
    """A Linear whose single-token calls run its Q8_0 blocks, as shipped, through the int4
    kernel: codes [N, 2K] = [hi | lo], input [x, x] (module docstring). Longer inputs run
    the dense `weight` (for a tied head: the embedding's, which stays float)."""

    @classmethod
    def from_blocks(cls, linear: torch.nn.Linear, blocks: Int8Blocks, kernel_dtype: torch.dtype) -> "Q8Linear":
        high, low = blocks.halves()
        codes = torch.cat([high.codes, low.codes], dim=1)  # [N, 2K]
        scales_and_zeros = torch.cat([_scales_and_zeros(high, kernel_dtype),
                                      _scales_and_zeros(low, kernel_dtype)])  # [2K/32, N, 2]
        return cls(linear, _pack(codes, linear.weight.device), scales_and_zeros)

    def kernel_input(self, flat: torch.Tensor) -> torch.Tensor:
        return torch.cat([flat, flat], dim=-1)  # [1, 2K]: x·hi + x·lo in one call

    def extra_repr(self) -> str:
        return (f"{torch.nn.Linear.extra_repr(self)}, Q8_0 as int4 group {GROUP} hi|lo ({self.kernel_dtype}) "
                "for single tokens")


class Int8Linear(torch.nn.Linear):
    """A Linear whose single-token calls run int8 weights with one scale per output row
    (`_weight_int8pack_mm`); longer inputs run the dense `weight`. Quantized from the float
    weights (the kernel has no per-block scales, so a GGUF's Q8_0 blocks cannot map onto it
    exactly): lossy, opt-in only (`--weights int8`)."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        torch.nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        w = linear.weight.detach().float()  # [N, K]
        scales = (w.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)  # [N]
        self.register_buffer("codes", torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8),
                             persistent=False)
        self.register_buffer("scales", scales.to(linear.weight.dtype), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() < 2 or x.shape[-2] != 1:
            return F.linear(x, self.weight, self.bias)
        flat = x.reshape(-1, self.in_features)  # [1, K]
        y = torch.ops.aten._weight_int8pack_mm(flat, self.codes, self.scales)  # [1, N]
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)


def packed_bytes(model: torch.nn.Module) -> int:
    """Bytes of quantized codes and scales the model's Int4Linear / Q8Linear / Int8Linear layers hold."""
    return sum(sum(b.nbytes for b in m.buffers()) for m in model.modules() if isinstance(m, (Int4Linear, Int8Linear)))
