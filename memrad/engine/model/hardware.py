"""What the hardware is fast at: the activation dtype and the weight format `auto` picks.

Activations: bf16 where the CPU computes bf16 natively (AMX tiles or AVX512-BF16) and torch
and oneDNN are allowed to use those instructions, and on CUDA; fp32 elsewhere. On AVX2-only
CPUs bf16 is emulated and several times slower than fp32 for prefill (measured:
docs/BENCHMARKS.md, Prefill: dtype on an AVX2-only CPU), so the choice must follow the
hardware. Detection reads CPU flags as torch reports them plus
the two environment caps (`ATEN_CPU_CAPABILITY`, `ONEDNN_MAX_CPU_ISA`): it is exact, so
nothing is measured at start and nothing needs caching per machine.

Weights: a GGUF's Q4_0/Q4_1/Q4_K blocks (and Q8_0/Q5_0 as two int4 halves) run as packed
int4 (memrad.engine.model.quant) on every device torch has an int4 kernel for: CUDA
(tinygemm) and x86 CPUs. The CPU kernel is fast only with bf16 inputs (with fp32 inputs it
loses to a dense GEMV; docs/BENCHMARKS.md, Weight formats), so Int4Linear hands it bf16 even
when the activations are fp32; under AVX2-only kernels that still decodes faster than the
fp32 dense model (docs/BENCHMARKS.md, AVX2-class CPUs). Q8_0 / Q5_0 / Q4_0 / Q4_1 blocks run on
memra's block kernel where memrad.engine.model.kernel_choice picks it (the head on AVX512; on
AVX2 each group as measured at load; logits in the activation dtype), else on the int4 kernel
(Q8Linear: logits in bf16 whatever the activations).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

WEIGHT_FORMATS = ("auto", "float", "int4", "int8")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# oneDNN ISA caps below which it has no bf16 instructions (ONEDNN_MAX_CPU_ISA values)
_ONEDNN_WITHOUT_BF16 = ("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX512_CORE", "AVX512_CORE_VNNI")


@dataclass(frozen=True, slots=True)
class Choice:
    """One runtime choice and the human reason for it (log line, /health, `memrad status`)."""

    value: str
    reason: str


def native_bf16(env: dict[str, str] | None = None) -> Choice:
    """Whether this CPU runs bf16 natively, as torch and oneDNN will actually use it."""
    env = os.environ if env is None else env
    caps = torch.cpu.get_capabilities() if hasattr(torch.cpu, "get_capabilities") else {}
    units = [name for name, flag in (("AMX", caps.get("amx_bf16")), ("AVX512-BF16", caps.get("avx512_bf16"))) if flag]
    if not units:
        return Choice("no", "the CPU has neither AMX nor AVX512-BF16")
    capability = torch.backends.cpu.get_cpu_capability()
    if not capability.startswith(("AVX512", "AMX")):
        return Choice("no", f"the CPU has {'+'.join(units)} but torch runs {capability} kernels "
                            "(ATEN_CPU_CAPABILITY)")
    onednn_cap = env.get("ONEDNN_MAX_CPU_ISA", "").upper()
    if onednn_cap in _ONEDNN_WITHOUT_BF16:
        return Choice("no", f"the CPU has {'+'.join(units)} but oneDNN is capped at {onednn_cap}")
    return Choice("yes", f"the CPU has {'+'.join(units)} ({capability} kernels)")


def pick_dtype(requested: str, device: torch.device) -> tuple[torch.dtype, Choice]:
    """The activation dtype for `requested` (auto or a dtype name) on `device`, with why."""
    if requested != "auto":
        return _DTYPES[requested], Choice(requested, "set by model.dtype")
    if device.type == "cuda":
        return torch.bfloat16, Choice("bfloat16", "auto: CUDA computes bf16 natively")
    bf16 = native_bf16()
    if bf16.value == "yes":
        return torch.bfloat16, Choice("bfloat16", f"auto: {bf16.reason}")
    return torch.float32, Choice("float32", f"auto: {bf16.reason}, so bf16 would be emulated (5-6x slower)")


def pick_weights(requested: str, device: torch.device, int4_tensors: int, source: str,
                 q8_head: bool = False, also: tuple[str, ...] = ()) -> Choice:
    """The weight format for `requested`; `int4_tensors` counts the GGUF's Q4_0/Q4_1/Q4_K linear
    weights (0 when the model has no GGUF), `source` names where they come from, `q8_head`
    says its output head's Q8_0 blocks run on the same kernel (memrad.engine.model.quant.Q8Linear),
    `also` names the other blocks it keeps ("16 Q8_0 / Q5_0 layers", "4 layers' MXFP4 experts"):
    a GGUF without 4-bit layers (gpt-oss's: Q8_0 attention, MXFP4 experts) still runs as shipped
    ("int4" names the as-shipped choice; each group's kernel is `memrad status`'s tensors line)."""
    if requested == "float":
        return Choice("float", "set by model.weights")
    if requested == "int8":
        return Choice("int8", "set by model.weights (per-channel int8 from the float weights)")
    head = " and its Q8_0 head" if q8_head else ""
    if requested == "int4":
        return Choice("int4", f"set by model.weights ({int4_tensors} Q4 tensors from {source}{head})")
    if int4_tensors == 0 and not also:
        return Choice("float", f"auto: {source}")
    if int4_tensors == 0:
        return Choice("int4", f"auto: as shipped, {' and '.join(also)} from the GGUF{head} (each group's kernel: "
                              "the tensors line)")
    # On the CPU each group runs memra's block kernel or torch's int4 as measured (kernel_choice),
    # which is decided after this: the tensors line says which.
    kernel = "on tinygemm" if device.type == "cuda" else "(each group's kernel: the tensors line)"
    return Choice("int4", f"auto: as shipped, {int4_tensors} Q4 tensors from {source}{head} {kernel}")
