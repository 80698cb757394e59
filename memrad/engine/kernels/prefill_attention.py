"""memra's CPU prefill-attention kernel: built once per machine, loaded as `memra::prefill_attention`.

A prefill chunk of T queries attends the whole cache (L rows) at every layer, so past ~8k tokens
attention is most of a chunk's time (docs/BENCHMARKS.md#the-prefill-attention-kernel). torch's SDPA reads
the in-place slabs without copying them, but it is handed a [T, L] mask that it converts to floats
and adds per layer, scores each query head alone, and multiplies in small per-block GEMM calls.
csrc/prefill_attention.cpp needs no mask (the chunk's rows sit at the end of the slab), scores the
query heads of a KV head together against one repacked copy of each key block, and multiplies on
AMX tiles through oneDNN's brgemm (bf16 where the CPU has AMX), on AVX512-BF16's pair dots (bf16
elsewhere on such CPUs), or in float32 FMA tiles of the kernels' vector width (float32, and bf16
widened, on AVX512 or AVX2):

    q [1, H_q, T, D], keys, values [1, H_kv, L, D] (bf16 or fp32) -> memra::prefill_attention -> out [1, T, H_q, D]

It is built as every kernel is (memrad.engine.kernels.build) and checked on a small case against
float64 before it is used; where a model runs it is decided at load (memrad.engine.model.attention).
"""

from __future__ import annotations

import math

import torch

from memrad.engine.kernels.build import CSRC, ProbedKernel, library_path

SOURCE = CSRC / "prefill_attention.cpp"
# The probe's worst difference from float64 attention: bf16 outputs round at ~4e-3 of their size,
# fp32 sums of 600 products at ~1e-6.
_PROBE_TOLERANCE = {torch.bfloat16: 2e-2, torch.float32: 1e-4}

def built(compiler: str) -> bool:
    """Whether an earlier build left this machine's library in the cache."""
    return library_path(compiler, SOURCE).exists()


def path(dtype: torch.dtype) -> str:
    """The loaded kernel's path for `dtype`: "amx", "avx512-bf16", "avx512 fp32", "avx2 fp32",
    "avx2 fp32 (bf16 widened)", ... Requires `load() is None`."""
    return torch.ops.memra.prefill_attention_path(dtype == torch.bfloat16)


def load(build_missing: bool = True) -> str | None:
    """Make `torch.ops.memra.prefill_attention` callable and check it on a small case; None if
    it is, else why not. Never raises. `build_missing=False` only loads an earlier build."""
    return _KERNEL.why_not(build_missing)


def _probe() -> str:
    """"" when the kernel computes attention on this machine (a chunk of 70 queries over 600 rows,
    bf16 and float32, against float64), else what went wrong."""
    for dtype, tolerance in _PROBE_TOLERANCE.items():
        generator = torch.Generator().manual_seed(0)
        q = torch.randn(1, 70, 6, 64, generator=generator).to(dtype).transpose(1, 2)  # [1, H_q, T, D]
        keys, values = (torch.randn(1, 2, 640, 64, generator=generator).to(dtype) for _ in range(2))
        keys, values = keys[:, :, :600], values[:, :, :600]  # slab views with rows past the end
        got = torch.ops.memra.prefill_attention(q, keys, values, 0.125)  # [1, T, H_q, D]
        mask = torch.ones(70, 600, dtype=torch.bool).tril(600 - 70)
        expected = torch.nn.functional.scaled_dot_product_attention(
            q.double(), keys.double(), values.double(), attn_mask=mask, scale=0.125, enable_gqa=True).transpose(1, 2)
        error = (got.double() - expected).abs().max().item()
        if not math.isfinite(error) or error > tolerance:
            return f"the prefill kernel's probe is off by {error:.3g} from float64 attention ({path(dtype)})"
    return ""


_KERNEL = ProbedKernel(SOURCE, "the prefill kernel", _probe)
