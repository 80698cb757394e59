"""memra's sliced dense product: built once per machine, loaded as `memra::sliced_linear`.

A prefill chunk's GEMMs are where its bits depended on the thread count (oneDNN blocks, and
for some shapes splits the reduction, by the threads it may use): csrc/sliced_linear.cpp cuts
the output columns into fixed spans, one single-threaded GEMM each, shared out over torch's
threads, so the product is the same at any count (memrad.engine.model.products uses it).

    x [..., K], weight [N, K], bias [N] | None, slices  -> memra::sliced_linear -> [..., N]

It is built as every kernel is (memrad.engine.kernels.build) and checked at load: the same
bits at 1 and 2 threads, and within rounding of float64.
"""

from __future__ import annotations

import math

import torch

from memrad.engine.kernels.build import CSRC, ProbedKernel, library_path

SOURCE = CSRC / "sliced_linear.cpp"
# The probe's worst difference from float64, relative to the output's scale (bf16 rounds at 2^-8).
_PROBE_TOLERANCE = 2e-2

def built(compiler: str) -> bool:
    """Whether an earlier build left this machine's library in the cache."""
    return library_path(compiler, SOURCE).exists()


def load(build_missing: bool = True) -> str | None:
    """Make `torch.ops.memra.sliced_linear` callable and check it; None if it is, else why
    not. Never raises. `build_missing=False` only loads an earlier build."""
    return _KERNEL.why_not(build_missing)


def _probe() -> str:
    """"" when the product has the same bits at 1 and 2 threads in bf16 and float32 and is
    within rounding of float64 (a 70 x 1,536 -> 600 product with a bias), else what went wrong."""
    generator = torch.Generator().manual_seed(0)
    x, weight, bias = torch.randn(70, 1536, generator=generator), torch.randn(600, 1536, generator=generator), \
        torch.randn(600, generator=generator)
    expected = torch.nn.functional.linear(x.double(), weight.double(), bias.double())
    before = torch.get_num_threads()
    try:
        for dtype in (torch.bfloat16, torch.float32):
            args = (x.to(dtype), weight.to(dtype), bias.to(dtype), 2)
            torch.set_num_threads(1)
            one = torch.ops.memra.sliced_linear(*args)
            torch.set_num_threads(2)
            two = torch.ops.memra.sliced_linear(*args)
            if not torch.equal(one, two):
                return f"the sliced product gives other bits at 1 and 2 threads ({dtype})"
            error = ((one.double() - expected).abs().max() / expected.abs().max()).item()
            if not math.isfinite(error) or error > _PROBE_TOLERANCE:
                return f"the sliced product's probe is off by {error:.3g} from float64 ({dtype})"
    finally:
        torch.set_num_threads(before)
    return ""


_KERNEL = ProbedKernel(SOURCE, "the sliced product", _probe)
