"""What each candidate weight format costs per tensor group of a GGUF model: its single-token
speed and its error against the float weights transformers made of the GGUF
(`memrad bench weights` prints it; docs/BENCHMARKS.md records it).

Candidates, one representative tensor per (role, GGUF type, shape):

    dense bf16   the float weights rounded to bf16, torch's GEMV
    int8         per-channel int8 made from the float weights (`_weight_int8pack_mm`)
    int4 requant Q4_1 blocks made from the float weights (min/max per 32), the int4 kernel
    as shipped   the GGUF's own codes on the int4 kernel: Q4_0/Q4_1/Q4_K direct, Q8_0/Q5_0 hi|lo
    blocks       Q8_0/Q5_0 and the k-quants (Q4_K, Q5_K, Q6_K super-blocks): the GGUF's blocks
                 themselves on memra's kernel (where it runs: memrad.engine.model.block_linear);
                 its weights are exact (error 0 below), its activation is rounded to int16 per
                 32 (2^-16 of the block's largest |x|)

Error: ||W_run − W||_F / ||W||_F, with W_run what the kernel multiplies (its bf16 scales
included). The pick is the fastest candidate within MAX_ERROR (memrad.engine.model.formats
documents the rule `auto` follows). Times are per call (median); with one thread they are CPU
seconds (time.process_time), which a loaded machine disturbs less than wall time.
"""

from __future__ import annotations

import re
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from memrad.engine.kernels import block_gemv
from memrad.engine.model import block_linear
from memrad.engine.model.block_linear import BlockLinear
from memrad.engine.model.loader import load_model
from memrad.engine.model.quant import (
    GROUP, Int4Blocks, Int4Linear, Int8Blocks, Int8Linear, Q8Linear, SuperBlocks, quantize_q4_1,
)
from memrad.engine.model.weights import load_int4_cache, load_kinds, load_q8_cache, load_super_cache

# The error budget: about what bf16 activations and scales cost anyway (2^-8 is bf16's
# rounding of one value); a candidate past it changes the model, not just its speed.
MAX_ERROR = 2.0 ** -8
CANDIDATES = ("dense bf16", "int8", "int4 requant", "as shipped", "blocks")


@dataclass(frozen=True, slots=True)
class FormatCost:
    """One tensor group's candidates: {candidate: (ms per call, relative error)} and the pick."""

    role: str
    kind: str
    shape: tuple[int, int]  # (N, K)
    cells: dict[str, tuple[float, float]]
    pick: str  # "none" when no candidate is within MAX_ERROR


def kernel_weights(blocks: Int4Blocks, dtype: torch.dtype) -> torch.Tensor:
    """[N, K] float32: what the int4 kernel multiplies for `blocks` (scale and zero in `dtype`)."""
    n, k = blocks.codes.shape
    zeros = torch.zeros_like(blocks.scales) if blocks.mins is None else blocks.mins + 8 * blocks.scales
    scale, zero = blocks.scales.to(dtype).float(), zeros.to(dtype).float()
    q = blocks.codes.view(n, k // GROUP, GROUP).float()
    return ((q - 8) * scale[..., None] + zero[..., None]).view(n, k)


def _candidates(linear: torch.nn.Linear, shipped: Int4Blocks | Int8Blocks | None, whole: SuperBlocks | None = None
                ) -> dict[str, tuple[torch.nn.Module, torch.Tensor]]:
    """{name: (layer, the weights it multiplies)} for one float32 Linear; `whole`: its k-quant
    super-blocks, as shipped, where the GGUF has them."""
    w = linear.weight.detach().float()
    dense = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=torch.bfloat16)
    with torch.no_grad():
        dense.weight.copy_(w)
    int8 = Int8Linear(dense)
    out = {"dense bf16": (dense, dense.weight.float()),
           "int8": (int8, int8.codes.float() * int8.scales.float()[:, None])}
    requant = quantize_q4_1(w)
    out["int4 requant"] = (Int4Linear.from_blocks(dense, requant, torch.bfloat16), kernel_weights(requant, torch.bfloat16))
    if isinstance(shipped, Int4Blocks):
        out["as shipped"] = (Int4Linear.from_blocks(dense, shipped, torch.bfloat16),
                             kernel_weights(shipped, torch.bfloat16))
    elif isinstance(shipped, Int8Blocks):
        high, low = shipped.halves()
        out["as shipped"] = (Q8Linear.from_blocks(dense, shipped, torch.bfloat16),
                             kernel_weights(high, torch.bfloat16) + kernel_weights(low, torch.bfloat16))
        if block_gemv.why_not() is None and block_linear.packable(shipped):
            out["blocks"] = (BlockLinear.from_blocks(dense, shipped, block_gemv.interleaves()), shipped.dequantize())
    if whole is not None and block_gemv.why_not() is None:
        out["blocks"] = (BlockLinear.from_blocks(dense, whole, block_gemv.interleaves()), whole.dequantize())
    return out


def _time_ms(fn: Callable[[], object], reps: int, clock: Callable[[], float]) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        started = clock()
        fn()
        times.append(clock() - started)
    return statistics.median(times) * 1e3


def measure(model: str, threads: int, reps: int) -> Iterator[FormatCost]:
    """Each tensor group's costs, one group at a time (slow: the head's candidates take seconds)."""
    torch.set_num_threads(threads)
    clock = time.process_time if threads == 1 else time.perf_counter
    loaded = load_model(model, device="cpu", dtype="float32", weights="float", progress=lambda _: None)
    kinds = load_kinds(loaded.folder)
    blocks = {**load_int4_cache(loaded.folder), **load_q8_cache(loaded.folder)}
    whole = load_super_cache(loaded.folder)
    seen: set[tuple[str, str, tuple[int, ...]]] = set()
    with torch.inference_mode():
        for name, module in loaded.model.named_modules():
            if not isinstance(module, torch.nn.Linear) or name not in kinds:
                continue
            key = (re.sub(r"\.\d+\.", ".*.", name), kinds[name], tuple(module.weight.shape))
            if key in seen:
                continue
            seen.add(key)
            w = module.weight.detach().float()
            x = torch.randn(1, 1, w.shape[1], dtype=torch.bfloat16)
            calls = max(3, reps // 10) if w.numel() > 50_000_000 else reps
            cells = {}
            for candidate, (layer, run) in _candidates(module, blocks.get(name), whole.get(name)).items():
                cells[candidate] = (_time_ms(lambda: layer(x), calls, clock), float((run - w).norm() / w.norm()))
            within = {c: v for c, v in cells.items() if v[1] <= MAX_ERROR}
            yield FormatCost(key[0], key[1], key[2], cells,
                             min(within, key=lambda c: within[c][0]) if within else "none")
