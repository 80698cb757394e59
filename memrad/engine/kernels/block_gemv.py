"""memra's block GEMV kernel: built once per machine, loaded as `memra::block_gemv` and probed.

csrc/block_gemv.cpp multiplies activations by a GGUF's Q8_0 / Q5_0 / Q4_1 / MXFP4 blocks and Q4_K /
Q5_K / Q6_K super-blocks as shipped (the layout and why: memrad.engine.model.block_linear, which packs the blocks and calls the op
by name). It is built as every kernel is (memrad.engine.kernels.build), where the kernels' ISA
is AVX512 or AVX2 (int16 activations and integer multiply-adds on both, 16 or 8 lanes;
`MEMRA_KERNEL_ISA=avx2` forces the AVX2 path on an AVX-512 machine), and checked against float64
on each block kind, within its activation's rounding, before it is used.
"""

from __future__ import annotations

from pathlib import Path

import torch

from memrad.engine.kernels.build import CSRC, ProbedKernel, capability, cxx_compiler, library_path

SOURCE = CSRC / "block_gemv.cpp"
OP_NAME = "memra::block_gemv"
_PROBE_TOLERANCE = 1e-4  # float32 sums of 256 products against float64: ~1e-6 relative



def built(compiler: str) -> bool:
    """Whether an earlier build left this machine's library in the cache."""
    return library_path(compiler, SOURCE).exists()


def library() -> Path:
    """This machine's build of the kernel (named by its source, flags and torch)."""
    return library_path(cxx_compiler() or "g++", SOURCE)


def why_not(build_missing: bool = True) -> str | None:
    """None when `torch.ops.memra.block_gemv` runs here (built, loaded and probed), else why
    not. Never raises. `build_missing=False` only loads a library an earlier build left."""
    if capability() not in ("AVX512", "AVX2"):
        return f"the CPU kernels are {capability()} (memra's block kernel runs on AVX2 or AVX512)"
    return _KERNEL.why_not(build_missing)


def _registered_and_probed() -> str | None:
    torch.library.register_fake(OP_NAME)(_shape_of_output)
    return _probe()


def _shape_of_output(x: torch.Tensor, blocks: torch.Tensor, kind: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], blocks.shape[0])  # [M, N]: what torch.compile traces the op as


def path() -> str:
    """The loaded kernel's path: "avx2 int16 avx-vnni", "avx512 int16", ... (ISA, how the activation is
    rounded, the dot instruction where it is not the ISA's own). Requires `why_not() is None`."""
    return torch.ops.memra.block_gemv_path()


def interleaves() -> bool:
    """Whether the loaded kernel runs the interleaved kinds (40: Q4_1 x16, 80: Q8_0 x16: its AVX512
    and AVX2 builds, the same bits on both; memrad.engine.model.block_linear.interleave). Requires
    `why_not() is None`."""
    return bool(torch.ops.memra.block_gemv_interleaves())


def activation_step(path_name: str) -> float:
    """The activation's rounding as a fraction of its block's largest |x|: half a step of int16
    (1/65534); 0 for float32 (no rounding)."""
    return {"int16": 1 / 65534}.get(path_name.split()[1], 0.0)


def _probe() -> str | None:
    """None when every block kind multiplies like float64 on a small case, within the activation's
    rounding, else what went wrong."""
    from memrad.engine.model.block_linear import FORMATS, interleave, pack
    from memrad.engine.model.quant import Int4Blocks, Int8Blocks, random_super_blocks

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, 256, generator=generator)  # K = 256: one k-quant super-block a row
    scales = (torch.rand(20, 8, generator=generator) / 50).half().float()
    cases = [Int8Blocks(torch.randint(-127, 128, (20, 256), generator=generator).to(torch.int8), scales),
             Int8Blocks(torch.randint(-16, 16, (20, 256), generator=generator).to(torch.int8), scales),
             Int4Blocks(torch.randint(0, 16, (20, 256), generator=generator).to(torch.uint8), scales, -8 * scales),
             *(random_super_blocks(kind, 20, 256, generator) for kind in ("Q4_K", "Q5_K", "Q6_K", "MXFP4"))]
    step = activation_step(path())
    packed = [(blocks, *pack(blocks)) for blocks in cases]
    if interleaves():  # the interleaved kinds (Q8_0 x16, Q4_1 x16) on 16 of the rows
        packed += [(blocks, *interleave(kind, raw[:16])) for blocks, kind, raw in (packed[0], packed[2])]
    for blocks, kind, raw in packed:
        got = torch.ops.memra.block_gemv(x, raw, kind).double()
        w = blocks.dequantize().double()[:raw.shape[0]]
        expected = x.double() @ w.t()
        bound = rounding_bound(x, w, step) + _PROBE_TOLERANCE * expected.abs().max()
        error = (got - expected).abs()
        if not bool((error <= bound).all()):
            worst = (error / expected.abs().max()).max().item()
            name = FORMATS.get(kind) or f"{FORMATS[kind // 10]} x16"
            return f"memra's block kernel is off by {worst:.3g} from float64 on its {name} probe"
    return None


def rounding_bound(x: torch.Tensor, w: torch.Tensor, step: float) -> torch.Tensor:
    """[M, N] float64: how far the kernel may lie from x @ w.t() in float64 by rounding x per block
    of 32 (each entry by at most `step` of its block's largest |x|), before float32's own rounding."""
    m, k = x.shape
    block_max = x.double().view(m, k // 32, 32).abs().amax(-1)  # [M, K/32]
    return (block_max * step) @ w.abs().double().view(w.shape[0], k // 32, 32).sum(-1).t()


_KERNEL = ProbedKernel(SOURCE, "memra's block kernel", _registered_and_probed)
