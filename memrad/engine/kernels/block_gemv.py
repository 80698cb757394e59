"""memra's block GEMV kernel: built once per machine, loaded as `memra::block_gemv` and probed.

csrc/block_gemv.cpp multiplies activations by a GGUF's Q8_0 / Q5_0 / Q4_1 blocks as shipped
(the layout and why: memrad.engine.model.block_linear, which packs the blocks and calls the op
by name). It is built as every kernel is (memrad.engine.kernels.build), only where torch's CPU
capability is AVX512 (the only one it was measured on), and checked against float64 on each
block kind before it is used.
"""

from __future__ import annotations

import threading

import torch

from memrad.engine.kernels.build import CSRC, capability, checked_load, cxx_compiler, library_path, unavailable

SOURCE = CSRC / "block_gemv.cpp"
OP_NAME = "memra::block_gemv"
_PROBE_TOLERANCE = 1e-4  # float32 sums of 64 products against float64: ~1e-6 relative

_lock = threading.Lock()
_why_not: str | None = None
_checked = False


def built(compiler: str) -> bool:
    """Whether an earlier build left this machine's library in the cache."""
    return library_path(compiler, SOURCE).exists()


def why_not(build_missing: bool = True) -> str | None:
    """None when `torch.ops.memra.block_gemv` runs here (built, loaded and probed), else why
    not. Never raises. `build_missing=False` only loads a library an earlier build left."""
    global _why_not, _checked
    with _lock:
        if _checked:
            return _why_not
        if capability() != "AVX512":
            return f"the CPU kernels are {capability()} (memra's block kernel is measured on AVX512 only)"
        compiler = cxx_compiler()
        untried = unavailable(compiler, SOURCE, "memra's block kernel", build_missing)
        if untried is not None:
            return untried
        _why_not = checked_load(compiler, SOURCE, _registered_and_probed)
        _checked = True
        return _why_not


def _registered_and_probed() -> str | None:
    torch.library.register_fake(OP_NAME)(_shape_of_output)
    return _probe()


def _shape_of_output(x: torch.Tensor, blocks: torch.Tensor, kind: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], blocks.shape[0])  # [M, N]: what torch.compile traces the op as


def _probe() -> str | None:
    """None when every block kind multiplies like float64 on a small case, else what went wrong."""
    from memrad.engine.model.block_linear import FORMATS, pack
    from memrad.engine.model.quant import Int4Blocks, Int8Blocks

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, 64, generator=generator)
    scales = (torch.rand(20, 2, generator=generator) / 50).half().float()
    cases = [Int8Blocks(torch.randint(-127, 128, (20, 64), generator=generator).to(torch.int8), scales),
             Int8Blocks(torch.randint(-16, 16, (20, 64), generator=generator).to(torch.int8), scales),
             Int4Blocks(torch.randint(0, 16, (20, 64), generator=generator).to(torch.uint8), scales, -8 * scales)]
    for blocks in cases:
        kind, raw = pack(blocks)
        got = torch.ops.memra.block_gemv(x, raw, kind).double()
        expected = x.double() @ blocks.dequantize().double().t()
        error = ((got - expected).abs().max() / expected.abs().max()).item()
        if not error <= _PROBE_TOLERANCE:
            return f"memra's block kernel is off by {error:.3g} from float64 on its {FORMATS[kind]} probe"
    return None
