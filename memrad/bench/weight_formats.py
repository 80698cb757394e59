"""`memrad bench weights`: per tensor group of a GGUF model, each candidate weight format's
single-token speed and its error against the float weights transformers made of the GGUF.

    memrad bench weights --model gemma3-270m [--threads 2] [--reps 50]

Candidates, one representative tensor per (role, GGUF type, shape):

    dense bf16   the float weights rounded to bf16, torch's GEMV
    int8         per-channel int8 made from the float weights (`_weight_int8pack_mm`)
    int4 requant Q4_1 blocks made from the float weights (min/max per 32), the int4 kernel
    as shipped   the GGUF's own codes on the int4 kernel: Q4_0/Q4_1/Q4_K direct, Q8_0/Q5_0 hi|lo

Error: ||W_run − W||_F / ||W||_F, with W_run what the kernel multiplies (its bf16 scales
included). The pick is the fastest candidate within MAX_ERROR; memrad.engine.model.formats
documents the rule `auto` follows. Times are per call (median of --reps); with one thread they
are CPU seconds (time.process_time), which a loaded machine disturbs less than wall time.
Never run in CI: numbers go to docs/BENCHMARKS.md with the command and the CPU.
"""

from __future__ import annotations

import argparse
import re
import statistics
import time
from collections.abc import Callable

import torch

from memrad.engine.model.loader import load_model
from memrad.engine.model.quant import (
    GROUP, Int4Blocks, Int4Linear, Int8Blocks, Int8Linear, Q8Linear, quantize_q4_1,
)
from memrad.engine.model.weights import load_int4_cache, load_kinds, load_q8_cache

# The error budget: about what bf16 activations and scales cost anyway (2^-8 is bf16's
# rounding of one value); a candidate past it changes the model, not just its speed.
MAX_ERROR = 2.0 ** -8


def kernel_weights(blocks: Int4Blocks, dtype: torch.dtype) -> torch.Tensor:
    """[N, K] float32: what the int4 kernel multiplies for `blocks` (scale and zero in `dtype`)."""
    n, k = blocks.codes.shape
    zeros = torch.zeros_like(blocks.scales) if blocks.mins is None else blocks.mins + 8 * blocks.scales
    scale, zero = blocks.scales.to(dtype).float(), zeros.to(dtype).float()
    q = blocks.codes.view(n, k // GROUP, GROUP).float()
    return ((q - 8) * scale[..., None] + zero[..., None]).view(n, k)


def _candidates(linear: torch.nn.Linear, shipped: Int4Blocks | Int8Blocks | None
                ) -> dict[str, tuple[torch.nn.Module, torch.Tensor]]:
    """{name: (layer, the weights it multiplies)} for one float32 Linear."""
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="memrad bench weights", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--reps", type=int, default=50)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    clock = time.process_time if args.threads == 1 else time.perf_counter
    loaded = load_model(args.model, device="cpu", dtype="float32", weights="float", progress=lambda _: None)
    folder = loaded.folder
    kinds, blocks = load_kinds(folder), {**load_int4_cache(folder), **load_q8_cache(folder)}
    seen: set[tuple[str, str, tuple[int, ...]]] = set()
    print(f"{args.model}: {args.threads} thread(s), {'CPU' if args.threads == 1 else 'wall'} ms per call, "
          f"error budget {MAX_ERROR:.2e}")
    print(f"{'group':<34} {'type':<5} {'N x K':>13}  " + "  ".join(f"{c:>21}" for c in
          ("dense bf16", "int8", "int4 requant", "as shipped")) + "  pick")
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
            reps = max(3, args.reps // 10) if w.numel() > 50_000_000 else args.reps
            cells = {}
            for cand, (layer, run) in _candidates(module, blocks.get(name)).items():
                error = float((run - w).norm() / w.norm())
                cells[cand] = (_time_ms(lambda: layer(x), reps, clock), error)
            within = {c: v for c, v in cells.items() if v[1] <= MAX_ERROR}
            pick = min(within, key=lambda c: within[c][0]) if within else "none"
            row = "  ".join(f"{cells[c][0]:>7.3f} ms {cells[c][1]:.1e}" if c in cells else f"{'-':>21}"
                            for c in ("dense bf16", "int8", "int4 requant", "as shipped"))
            print(f"{key[0].removeprefix('model.layers.*.'):<34} {key[1]:<5} {key[2][0]:>6} x {key[2][1]:<5} "
                  f"{row}  {pick}", flush=True)
    return 0
