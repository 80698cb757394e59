"""What each group of a model's linear weights runs as, and why (`memrad status`, /health).

A GGUF mixes block types by tensor (gemma3-270m's Q4_K_M: Q4_K, Q5_0, Q6_K and Q8_0), so one
word for "the weights" hides what decodes how. After memrad.engine.model.weights has packed the
layers, each Linear is named by its role (its module path with the layer number taken out), the
GGUF type it was shipped as (conversion keeps every Linear's type in the Q8 block file's header)
and what it runs as now:

    int4          Int4Linear: the shipped 4-bit codes (Q4_0 / Q4_1 / Q4_K) on the int4 kernel
    int4 hi|lo    Q8Linear: the shipped 8-bit or 5-bit codes (Q8_0 / Q5_0) as two int4 halves
    Q8_0 blocks   BlockLinear: the shipped blocks themselves on memra's kernel (Q8_0, Q5_0, Q4_1
                  blocks, a Q4_0 tensor's as Q4_1; Q4_K, Q5_K, Q6_K super-blocks); "Q4_1 x16
                  blocks": the same blocks, 16 output rows side by side (the AVX512 and AVX2
                  builds' interleaved kinds, memrad.engine.model.block_linear.interleave)
    int8          Int8Linear: per-channel int8 made from the float weights (opt-in)
    dense DTYPE   the float weights transformers made of the blocks, in the model's dtype

A mixture of experts (Qwen3-MoE, gpt-oss) ships its experts as 3-D tensors (`ffn_gate_exps`,
`ffn_up_exps`, `ffn_down_exps`, transformers' `experts.gate_up_proj` and `experts.down_proj`;
gpt-oss's in MXFP4): no Linear. gpt-oss's and Qwen3-MoE's experts run from their blocks on
memra's kernel where it runs and runs their kind ("MXFP4 blocks", "Q4_K blocks":
memrad.engine.model.block_experts); other experts run dense, dequantised at conversion. Their
group says which, with the bytes a token reads of them (its top k of E experts, every layer), as
shipped and dense.

The dense ones carry a reason (why no packed form was used), and so does a Q8_0 head that runs
hi|lo where memra's block kernel would run its blocks themselves (why it does not here), and
every group whose kernel was chosen between memra's and torch's int4 ("memra block kernel,
avx2 int16 avx-vnni, 1.9x torch int4 hi|lo (measured at load, one row)").

The choices themselves were measured per shape on the int4 kernel (docs/BENCHMARKS.md, "GGUF
k-quants as shipped"): a packed form is used when it is exact as shipped, i.e. its error is only
the bf16 rounding of the kernel's scales (memrad.engine.model.quant.Int4Blocks.kernel_error_bound);
requantising a tensor to fewer bits is never picked by `auto`.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch

from memrad.engine.decode.steps.experts import router_of, top_k
from memrad.engine.kernels import block_gemv
from memrad.engine.model.block_experts import BlockMoE
from memrad.engine.model.block_linear import BlockLinear
from memrad.engine.model.quant import Int4Linear, Int8Linear, Q8Linear

# Why a tensor of this GGUF type stays dense.
_DENSE_WHY = {
    "Q6_K": "16-weight sub-blocks with their own scales: no exact form in torch's int4 kernel's 32-weight groups",
    "Q5_K": "5-bit codes: no exact form in torch's int4 kernel",
    "Q5_1": "no packed form yet", "Q3_K": "no packed form yet",
    "Q2_K": "no packed form yet", "Q8_K": "no packed form yet",
    "F32": "shipped unquantized", "F16": "shipped unquantized", "BF16": "shipped unquantized",
}
_PACKED_KINDS = ("Q4_0", "Q4_1", "Q4_K", "Q8_0", "Q5_0")


@dataclass(frozen=True, slots=True)
class TensorGroup:
    """Linear weights alike in role, shipped type and what they run as."""

    role: str  # "model.layers.*.mlp.down_proj", "lm_head"
    kind: str  # the GGUF type ("Q4_K"); "float" from no GGUF; "GGUF" packed, type unrecorded
    runs: str  # "int4", "int4 hi|lo", "int8", "dense bfloat16"
    count: int
    why: str | None  # for a dense group: why no packed form; for a hi|lo head: why not its GGUF blocks


def runs_as(module: torch.nn.Module) -> str:
    if isinstance(module, BlockLinear):
        return f"{module.format}{' x16' if module.interleaved else ''} blocks"
    if isinstance(module, Q8Linear):
        return "int4 hi|lo"
    if isinstance(module, Int4Linear):
        return "int4"
    if isinstance(module, Int8Linear):
        return "int8"
    return f"dense {str(module.weight.dtype).removeprefix('torch.')}"


def _why_dense(kind: str, module: torch.nn.Module) -> str:
    if kind in _PACKED_KINDS:
        if module.out_features % 16:
            return f"the int4 kernel packs rows in sixteens and it has {module.out_features}"
        return "its blocks did not match the float weights at conversion, or --weights float"
    if kind == "float":
        return "the model is not a GGUF"
    return _DENSE_WHY.get(kind, f"{kind} has no packed form")


def groups(model: Any, kinds: dict[str, str], head_why: str | None = None,
           reasons: dict[str, str] | None = None) -> tuple[TensorGroup, ...]:
    """The model's Linear weights grouped; `kinds` is {module name: GGUF type} (empty: no GGUF);
    `head_why`: why memra's block kernel does not run a hi|lo head (None: not asked); `reasons`:
    {module name: which kernel runs its blocks and why} where that was chosen (memrad.engine.model.kernel_choice)."""
    reasons = reasons or {}
    head = model.get_output_embeddings()
    counted: Counter = Counter()
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        runs = runs_as(module)
        # a packed layer of a folder converted before memra kept the types: from a GGUF, type unrecorded
        kind = kinds.get(name, "float" if runs.startswith("dense") else "GGUF")
        why = (reasons.get(name) or _why_dense(kind, module) if runs.startswith("dense") else reasons.get(name)
               or (head_why if runs == "int4 hi|lo" and module is head else None))
        counted[(re.sub(r"\.\d+\.", ".*.", name), kind, runs, why)] += 1
    for role, kind, runs, why, count in _expert_groups(model, kinds):
        counted[(role, kind, runs, why)] += count
    return tuple(TensorGroup(role, kind, runs, count, why) for (role, kind, runs, why), count in sorted(counted.items()))


def _expert_groups(model: Any, kinds: dict[str, str]) -> list[tuple[str, str, str, str, int]]:
    """(role, GGUF type, runs, why, count) of the routed experts' 3-D weights, with the bytes a
    token reads of them (top k of E per layer, summed over the layers): on their MXFP4 blocks
    (memrad.engine.model.block_experts.BlockMoE, in their own kind), or dense, dequantised."""
    found: dict[tuple[str, str, str], list[int]] = {}  # (role, kind, runs) -> [count, bytes a token, as shipped]
    for name, block in model.named_modules():
        # Qwen3-MoE's `gate`, gpt-oss's `router` (each with its top_k); Gemma 4's layer `router` (the config's)
        experts, router = getattr(block, "experts", None), router_of(block)
        if experts is None or router is None or not hasattr(experts, "num_experts"):
            continue
        k = getattr(router, "top_k", None) or top_k(model.config)
        for attribute in ("gate_up_proj", "down_proj"):
            weight = getattr(experts, attribute, None)
            if not isinstance(weight, torch.Tensor) or weight.dim() != 3:
                continue
            full = f"{name}.experts.{attribute}"
            dense = f"dense {str(weight.dtype).removeprefix('torch.')}"
            blocks = getattr(block, attribute.replace("_proj", "_blocks"), None) if isinstance(block, BlockMoE) else None
            key = (re.sub(r"\.\d+\.", ".*.", full), kinds.get(full, "float"),
                   dense if blocks is None else f"{getattr(block, attribute.replace('_proj', '_kind'))} blocks")
            entry = found.setdefault(key, [0, 0, 0])
            entry[0] += 1
            entry[1] += weight.numel() * weight.element_size() * k // experts.num_experts
            entry[2] += (shipped_bytes(key[1], weight.numel()) if blocks is None else blocks.nbytes) * k \
                // experts.num_experts
    out = []
    for (role, kind, runs), (count, total, shipped) in found.items():
        if runs.startswith("dense"):
            why = (f"3-D expert tensors, dequantised: no packed form; a token reads {total:,} B of them"
                   + (f" ({shipped:,} B as shipped)" if shipped else ""))
        else:
            why = (f"memra block kernel, {block_gemv.path()}, the chosen experts only; a token reads {shipped:,} B "
                   f"of them as shipped ({total:,} B dense {str(model.dtype).removeprefix('torch.')})")
        out.append((role, kind, runs, why, count))
    return out


def shipped_bytes(kind: str, num_weights: int) -> int:
    """The bytes `num_weights` weights take as GGUF type `kind` ships them (0: not a GGUF type,
    or types mixed in one tensor, "Q4_K+Q6_K")."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    if kind not in GGMLQuantizationType.__members__:
        return 0
    block_weights, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    return num_weights // block_weights * block_bytes


def describe(found: tuple[TensorGroup, ...]) -> str:
    """One line: each group as `role kind xN: runs (why)`."""
    return "; ".join(f"{g.role.removeprefix('model.layers.*.')} {g.kind} x{g.count}: {g.runs}"
                     + (f" ({g.why})" if g.why else "") for g in found)


def kernels(model: Any, runs: str) -> str:
    """Which kernels a token's products run on, as the disk tier keys parked state by: `runs`
    (`summary`'s line) and memra's block kernel's path where any layer or expert runs on it."""
    if not any(isinstance(m, (BlockLinear, BlockMoE)) for m in model.modules()):
        return runs
    return f"{runs}; memra block kernel {block_gemv.path()}"


def summary(found: tuple[TensorGroup, ...]) -> str:
    """How many weight matrices run each way: "int4 27, int4 hi|lo 91, dense bfloat16 9"."""
    totals: Counter = Counter()
    for group in found:
        totals[group.runs] += group.count
    return ", ".join(f"{runs} {count}" for runs, count in totals.items())
