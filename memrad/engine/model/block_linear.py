"""Linear layers whose single-token calls read a GGUF's Q8_0 / Q5_0 / Q4_1 / k-quant blocks as shipped.

torch's int4 kernel can run an 8-bit or 5-bit block only as two 4-bit passes (Q8Linear, hi|lo):
10 bits a weight with its bf16 scale and zero pairs, where the GGUF's blocks are 8.5 (Q8_0) and
5.5 (Q5_0) bits. gemma3-270m's tied 262,144 x 640 Q8_0 head read 210 MB a token that way where
llama.cpp reads 178 MB. memra's kernel (`memra::block_gemv`, memrad.engine.kernels.block_gemv) reads the
blocks themselves:

    Q8_0 block (34 B)  | d fp16 | q[32] int8 |               w = d·q
    Q5_0 block (22 B)  | d fp16 | qh u32 | qs[16] |          w = d·(q − 16), q = nibble + 16·bit
    Q4_1 block (20 B)  | d fp16 | m fp16 | qs[16] |          w = d·q + m, q = nibble
    Q4_K super-block of 256 (144 B): 8 blocks of 32, w = (d·sc)·q − dmin·m, 6-bit sc and m
    Q5_K super-block of 256 (176 B): as Q4_K, q of 5 bits
    Q6_K super-block of 256 (210 B): 16 sub-blocks of 16, w = (d·sc)·(q − 32), int8 sc
    MXFP4 block (17 B) | e uint8 | qs[16] |                  w = 2^(e − 128)·v(q), v: E2M1 doubled, int8
                       (the layouts: memrad.engine.kernels.csrc/block_gemv.cpp, llama.cpp's ggml-quants)

    blocks  [N, K/32 · bytes] uint8, one output row per row, as llama.cpp lays them out
    x [M, K] (bf16 or fp32) -> int16 per block of 32 (AVX512, AVX2) -> int32 products,
                               float32 sums -> out [M, N]

The weights are exactly the shipped ones (fp16 d is exact in float32; hi|lo rounds its scales
to bf16); the activation moves by at most 2^-16 of its block's largest |x|. A layer's codes go
out as Q5_0 blocks when every code fits 5 bits (all of a Q5_0 tensor's do), else as Q8_0. 4-bit
blocks (Int4Blocks) go out as Q4_1 where d and m are fp16 values: all of a Q4_1 or Q4_0 tensor's
(Q4_0's m = −8·d); Q4_K's sub-block scales d·sc and mins −dmin·m are not, so a Q4_K tensor goes
out as its shipped super-blocks (SuperBlocks, kept whole at conversion), as do Q5_K and Q6_K, which
torch's int4 kernel cannot run at all. Each tile of output rows decodes a block's codes once for all
the activation rows (M ≤ the batch), and each output is one fixed sequence of operations: a
request's bits are the same alone or batched, on any thread count.

Which groups of blocks run here and which on torch's int4 kernel, memrad.engine.model.kernel_choice
decides: on AVX512 the head (it streams from memory, where fewer bytes won) and the Q4_0 / Q4_1
layers as the interleaved kind (`interleave`: 16 rows' blocks side by side, made once at load, so
a block's codes are widened once for every activation row and each output sums in its own lane;
the row-major Q4_1 blocks and the Q5_0 unpacking lost to torch's int4 kernel:
docs/BENCHMARKS.md#memras-block-kernel); on AVX2, where torch's int4 kernel has half
the width too, each group as measured at load: interleaved, row-major or torch's int4
(docs/BENCHMARKS.md#avx2-class-cpus). Without a compiler, on other CPUs and on CUDA the blocks
run on torch's int4 kernel and `block_gemv.why_not` says why. Longer inputs (prefill) run the
dense `weight` the layer keeps, as Int4Linear does.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from memrad.engine.model.quant import GROUP, Int4Blocks, Int8Blocks, SuperBlocks

Q8_0, Q5_0, Q4_1 = 8, 5, 4  # the op's `kind`
Q4_K, Q5_K, Q6_K = 12, 13, 14  # the k-quants' kinds: ggml's type numbers
MXFP4 = 39  # ggml's too: gpt-oss's experts (memrad.engine.model.block_experts), kept whole as SuperBlocks
_BLOCK_BYTES = {Q8_0: 34, Q5_0: 22, Q4_1: 20}
FORMATS = {Q8_0: "Q8_0", Q5_0: "Q5_0", Q4_1: "Q4_1", Q4_K: "Q4_K", Q5_K: "Q5_K", Q6_K: "Q6_K",
           MXFP4: "MXFP4"}  # kind -> GGUF type
_KINDS = {name: kind for kind, name in FORMATS.items()}

Q4_1_X16, Q8_0_X16 = 40, 80  # Q4_1 / Q8_0 blocks of 16 output rows side by side (`interleave`)
INTERLEAVED = {Q4_1: Q4_1_X16, Q8_0: Q8_0_X16}  # plain kind -> its interleaved kind
_PLAIN = {v: k for k, v in INTERLEAVED.items()}

Blocks = Int8Blocks | Int4Blocks | SuperBlocks


def _mins(blocks: Int4Blocks) -> torch.Tensor:
    return -8 * blocks.scales if blocks.mins is None else blocks.mins  # Q4_0: (q − 8)·d = q·d − 8·d


def packable(blocks: Blocks) -> bool:
    """Whether the kernel holds the blocks exactly: k-quant super-blocks (their bytes as shipped),
    and blocks whose scales (and mins) are fp16 values, as shipped: Q8_0, Q5_0, Q4_0 and Q4_1
    blocks; not Q4_K's unpacked products d·sc, −dmin·m (its SuperBlocks run instead)."""
    if isinstance(blocks, SuperBlocks):
        return True
    exact = [blocks.scales] if isinstance(blocks, Int8Blocks) else [blocks.scales, _mins(blocks)]
    return all(bool(torch.equal(t.half().float(), t)) for t in exact)


def kind_of(blocks: Blocks) -> int:
    """The op's kind `pack` lays `blocks` out as: a k-quant's own; Q4_1 for 4-bit blocks, Q5_0 where
    every code fits 5 bits, else Q8_0."""
    if isinstance(blocks, SuperBlocks):
        return _KINDS[blocks.kind]
    if isinstance(blocks, Int4Blocks):
        return Q4_1
    return Q5_0 if int(blocks.codes.min()) >= -16 and int(blocks.codes.max()) <= 15 else Q8_0


def interleaved_kind(blocks: Blocks) -> int | None:
    """The kind `blocks` run as laid out 16 rows side by side (`interleave`): Q4_1 x16 for 4-bit
    blocks, Q8_0 x16 for the 8- and 5-bit ones (a Q5_0 code q - 16 is an int8, so its block is a
    Q8_0 block of the same weights: 34 bytes where 22 are shipped, read with no bits to unpack);
    None for super-blocks."""
    if isinstance(blocks, SuperBlocks):
        return None
    return Q4_1_X16 if isinstance(blocks, Int4Blocks) else Q8_0_X16


def pack(blocks: Blocks, widen: bool = False) -> tuple[int, torch.Tensor]:
    """(kind, bytes [N, K/32 · block bytes]): the GGUF block layout of `blocks`: a k-quant's
    super-blocks as they are; Q4_1 for 4-bit blocks, Q5_0 where every 8-bit code fits 5 bits
    (unless `widen`: the same codes as Q8_0, `interleaved_kind`), else Q8_0. Requires
    `packable(blocks)`."""
    if isinstance(blocks, SuperBlocks):
        return _KINDS[blocks.kind], blocks.raw.contiguous()
    n, k = blocks.codes.shape
    nb = k // GROUP
    d = blocks.scales.half().contiguous().view(torch.uint8).view(n, nb, 2)
    codes = blocks.codes.view(n, nb, GROUP)
    if isinstance(blocks, Int4Blocks):
        m = _mins(blocks).half().contiguous().view(torch.uint8).view(n, nb, 2)
        qs = (codes[..., :16] | (codes[..., 16:] << 4)).to(torch.uint8)  # weight j low, j + 16 high
        return Q4_1, torch.cat([d, m, qs], dim=-1).reshape(n, nb * _BLOCK_BYTES[Q4_1]).contiguous()
    if kind_of(blocks) == Q5_0 and not widen:
        q = (codes.to(torch.int16) + 16).to(torch.int32)  # 0..31
        bits = (q >> 4) & 1  # [N, nb, 32]: the high bit of weight j is bit j of qh
        qh = (bits << torch.arange(GROUP, dtype=torch.int32)).sum(-1, dtype=torch.int64).to(torch.int32)
        nibbles = q & 15
        qs = (nibbles[..., :16] | (nibbles[..., 16:] << 4)).to(torch.uint8)  # [N, nb, 16]
        raw = torch.cat([d, qh.contiguous().view(torch.uint8).view(n, nb, 4), qs], dim=-1)
        return Q5_0, raw.reshape(n, nb * _BLOCK_BYTES[Q5_0]).contiguous()
    raw = torch.cat([d, codes.contiguous().view(torch.uint8)], dim=-1)
    return Q8_0, raw.reshape(n, nb * _BLOCK_BYTES[Q8_0]).contiguous()


def interleave(kind: int, raw: torch.Tensor) -> tuple[int, torch.Tensor]:
    """(kind, bytes) with the Q4_1 / Q8_0 blocks `pack` made laid out for the kernel's AVX512 and
    AVX2 paths: each 16 output rows' blocks side by side (memrad.engine.kernels.csrc/block_gemv.cpp,
    the interleaved kinds), made once at load. The same shape and bytes a row; rows cut at a
    multiple of 16 stay their own. Other kinds, and rows not in sixteens, as they are."""
    n = raw.shape[0]
    if kind not in INTERLEAVED or n % 16:
        return kind, raw
    size = _BLOCK_BYTES[kind]
    nb = raw.shape[1] // size
    blocks = raw.view(n // 16, 16, nb, size).transpose(1, 2)  # [G, nb, 16 rows, B]
    d = blocks[..., :2].reshape(n // 16, nb, 32)  # [G, nb, 16 x fp16]
    if kind == Q8_0:
        q = blocks[..., 2:].reshape(n // 16, nb, 16, 16, 2).transpose(2, 3)  # [G, nb, pair p, row, 2]
        parts = [d, q.reshape(n // 16, nb, 512)]
    else:
        m = blocks[..., 2:4].reshape(n // 16, nb, 32)
        qs = blocks[..., 4:]  # [G, nb, 16, 16]: weight j low, j + 16 high
        codes = torch.cat([qs & 15, qs >> 4], dim=-1)  # [G, nb, row, 32]
        pairs = codes.view(n // 16, nb, 16, 2, 8, 2).permute(0, 1, 3, 4, 2, 5)  # [G, nb, half, j, row, 2]
        parts = [d, m, (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(n // 16, nb, 256)]
    return INTERLEAVED[kind], torch.cat(parts, dim=-1).reshape(n, nb * size).contiguous()


class BlockLinear(torch.nn.Linear):
    """A Linear whose single-token calls run `blocks` on memra's kernel; longer inputs (prefill)
    run the dense `weight` it keeps (for a tied head: the embedding's)."""

    def __init__(self, linear: torch.nn.Linear, blocks: torch.Tensor, kind: int) -> None:
        torch.nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.kind = kind
        self.register_buffer("blocks", blocks, persistent=False)  # [N, K/32 · bytes] (k-quants: K/256) uint8

    @classmethod
    def from_blocks(cls, linear: torch.nn.Linear, blocks: Blocks, interleaved: bool = False) -> "BlockLinear":
        """`interleaved`: lay the blocks out 16 rows side by side as `interleaved_kind` (Q5_0's as
        Q8_0): where the loaded kernel runs them (`memrad.engine.kernels.block_gemv.interleaves()`:
        AVX512, AVX2)."""
        kind, raw = pack(blocks, widen=interleaved)
        if interleaved:
            kind, raw = interleave(kind, raw)
        return cls(linear, raw, kind)

    @property
    def format(self) -> str:
        return FORMATS[_PLAIN.get(self.kind, self.kind)]

    @property
    def interleaved(self) -> bool:
        """Whether its blocks are laid out 16 rows side by side (`interleave`)."""
        return self.kind in _PLAIN

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., T, K]; the blocks only where one token goes through (decode)
        if x.dim() < 2 or x.shape[-2] != 1:
            return F.linear(x, self.weight, self.bias)
        flat = x.reshape(-1, self.in_features)  # [M, K]
        y = torch.ops.memra.block_gemv(flat, self.blocks, self.kind)  # [M, N]
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, {self.format} blocks on memra's kernel for single tokens"
