"""The KV cache's dtype: bf16 rows under fp32 activations where the decode step reads them on memra's kernel.

A long context's decode step is bound by reading its KV rows: at 4k the default model's fp32
cache is 180 MiB a token against ~80 MiB of int4 weights. llama.cpp keeps its cache in f16 by
default; memra keeps it in bf16 wherever the activations are fp32 and every attention layer of
the model's decode step runs memra's decode kernel (memrad.engine.kernels.decode_attention),
which widens a bf16 row to fp32 exactly (a shift) as it reads it:

    prefill   k, v [1, H_kv, T, D] fp32 -> the slab, rounded to bf16 (memrad.engine.state.kv)
              attention reads the slab's rows widened back to fp32: every row as decode reads it
    decode    the step writes its row rounded to bf16, the kernel scores fp32 queries against
              the bf16 rows (the products in fp32)

Every token attends rounded rows, whichever chunk or step wrote them, so resumed == cold,
batched == alone and any thread count keep their bits; what changes is the cache's precision
(8 significant bits, fp32's range), as it already is where the activations are bf16. Chosen
once at load and named in the disk tier's key and the step package's key.

    model.kv_dtype   auto         bf16 where the above holds, else the activations' dtype (the reason says why)
                     activations  the activations' dtype (the A/B baseline)
                     bfloat16     bf16 wherever the step reads it on the kernel, as auto
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from memrad.engine.model.hardware import Choice

MODES = ("auto", "activations", "bfloat16")


def choose(model, mode: str = "auto", step_why_not: str | None = None) -> Choice:
    """The cache's dtype for `model` under `mode` (`decide`), recorded on the model for `of`.
    `step_why_not`: why the model's decode step does not run every attention layer on memra's
    kernel, or None where it does (memrad.engine.decode.steps.attends_on_kernel). A model keeps
    its first choice."""
    made = getattr(model, "_memra_kv", None)
    if made is not None:
        if made[0] != mode:
            raise ValueError(f"this model's KV dtype was set to {made[0]!r}; load it again for {mode!r}")
        return made[1]
    choice = decide(mode, model.dtype, model.device.type, step_why_not, _kernel_why_not)
    model._memra_kv = (mode, choice)
    return choice


def decide(mode: str, activations: torch.dtype, device_type: str, step_why_not: str | None,
           kernel_why_not: Callable[[], str | None]) -> Choice:
    """The rows' dtype under `mode` (the table above): value "bfloat16", or the activations' dtype
    name, and why. `kernel_why_not()`: why memra's decode kernel does not run here, or None (asked
    only where the answer decides)."""
    if mode not in MODES:
        raise ValueError(f"kv dtype must be one of {', '.join(MODES)}, got {mode!r}")
    name = str(activations).removeprefix("torch.")
    said = "auto" if mode == "auto" else "set by model.kv_dtype"
    if mode == "activations":
        return Choice(name, f"{said}: the activations' dtype")
    if activations == torch.bfloat16:
        return Choice(name, f"{said}: the activations are bf16")
    why_not = (f"the cache is on {device_type}, where transformers decodes" if device_type != "cpu" else
               f"the activations are {name}" if activations != torch.float32 else
               step_why_not or kernel_why_not())
    if why_not is not None:
        return Choice(name, f"{said}: the activations' dtype ({why_not})")
    return Choice("bfloat16", f"{said}: bf16 rows widened to fp32 by memra's decode kernel (half the bytes a long "
                              "context's step reads)")


def of(model) -> torch.dtype:
    """The dtype `model`'s cache rows are kept in (the activations' where `choose` never ran)."""
    made = getattr(model, "_memra_kv", None)
    return torch.bfloat16 if made is not None and made[1].value == "bfloat16" else model.dtype


def _kernel_why_not() -> str | None:
    from memrad.engine.kernels import decode_attention
    from memrad.engine.kernels.build import cxx_compiler

    why_not = decode_attention.load(cxx_compiler())
    return None if why_not is None else f"memra's decode kernel: {why_not}"
