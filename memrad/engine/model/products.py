"""Prefill whose bits do not depend on the intra-op thread count, so its team may follow the CPU.

A prefill chunk's bits moved with the thread count only in its dense products: oneDNN's bf16
GEMM rounds the default model's down projection (256 x 1,536 -> 576) differently at 1 and 2
threads; its other products, the attention (memra's kernel and torch's), the norms and the
rotations gave the same bits at either count (measured: docs/BENCHMARKS.md, Shared machine;
pinned by tests/integration/test_threads_default_model.py). While a chunk runs, `Invariant`
sends every `F.linear` of more than one row (the dense path of Int4Linear, Q8Linear,
BlockLinear and plain Linear layers alike) to `memra::sliced_linear` (memrad.engine.kernels
.sliced_linear): the output columns in `slices` fixed spans, each one single-threaded GEMM.
A span's cut depends only on N and `slices`, never on the team, so the chunk has the same
bits at any count; `slices` (the CPUs the process may run on when the model loads, at least
2, so that a team of that size has a span each) is fixed for the process and is part of the
disk tier's compatibility key. Measured at 2 threads quiet: no slower than torch's own
products (1,145 vs 996 tok/s on a 2,048-token prefill, docs/BENCHMARKS.md, Shared machine).

Single rows (decode steps, the head's last position) pass through: their kernels already
give the same bits at any count.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

from memrad.engine.model.hardware import Choice


class Invariant(TorchFunctionMode):
    """Inside it, every dense product of more than one row runs as `slices` fixed spans."""

    def __init__(self, slices: int) -> None:
        super().__init__()
        self.slices = slices

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, weight = args[0], args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if x.dim() >= 2 and x.shape[-2] > 1 and x.device.type == "cpu":
                return torch.ops.memra.sliced_linear(x, weight, bias, self.slices)
        return func(*args, **kwargs)


@dataclass(frozen=True, slots=True)
class Products:
    """How a prefill chunk's dense products run: `slices` fixed spans (the same bits at any
    thread count), or None: torch's own, whose bits follow the count (which then stays fixed)."""

    slices: int | None
    choice: Choice  # value "sliced x2" or "torch": /health, `memrad status`, the disk tier's key

    def context(self) -> contextlib.AbstractContextManager:
        """What a prefill chunk runs under."""
        return contextlib.nullcontext() if self.slices is None else Invariant(self.slices)


TORCH = Products(None, Choice("torch", "set by the caller"))


def attention_only(config) -> bool:
    """Whether every decoder layer is attention (full or sliding window) and a dense MLP: the
    models whose prefill was measured to move only in its dense products with the count.
    Hybrids' scans and convolutions (Mamba-2, gated delta nets, short convolutions) and mixtures
    of experts' grouped products (not `F.linear`) were not."""
    kinds = set(getattr(config, "layer_types", None) or ("full_attention",))
    return kinds <= {"full_attention", "sliding_attention"} and not any(
        hasattr(config, key) for key in ("mamba_d_ssm", "state_size", "ssm_state_size", "linear_num_key_heads",
                                         "conv_L_cache", "num_experts", "num_local_experts"))


def choose(config, ceiling_cpus: int) -> Products:
    """Sliced products where memra::sliced_linear loads and the model is attention-only, cut
    into the CPUs the process may run on (at least 2); else torch's, and why."""
    if not attention_only(config):
        return Products(None, Choice("torch", "the model has non-attention layers or experts, whose prefill was not "
                                              "shown to give the same bits at any thread count"))
    from memrad.engine.kernels import sliced_linear

    why_not = sliced_linear.load()
    if why_not is not None:
        return Products(None, Choice("torch", f"memra's sliced product is unavailable ({why_not})"))
    slices = max(2, ceiling_cpus)
    return Products(slices, Choice(f"sliced x{slices}", f"dense products in {slices} fixed column spans, one "
                                                         "thread each: the same bits at any thread count"))
