"""A mixture's routed experts from their GGUF blocks, as shipped, on memra's block kernel.

llama.cpp ships a mixture's experts as 3-D block tensors (`ffn_gate_exps`, `ffn_up_exps`,
`ffn_down_exps`, [E, rows, row bytes]): gpt-oss's MXFP4 (per 32 weights an E8M0 scale byte and 16
bytes of E2M1 codes: 17 bytes where bf16 takes 64), Qwen3-MoE's as its file's quant mixes them
(Q4_K_M: gate and up Q4_K, down Q6_K or Q4_K; Q8_0 files Q8_0). Conversion dequantises them into
transformers' `gate_up_proj` / `down_proj` (gpt-oss: memrad.engine.model.gguf_gpt_oss; Qwen3-MoE:
transformers' GGUF loader) and keeps their bytes beside the float weights, checked as every block
file is: dequantised as gguf-py does, they must equal the float weights bit for bit, or the
layer's experts stay dense. Kept are the kinds memra's kernel runs as ggml lays them out (RUNS:
Q8_0, Q5_0, Q4_1, Q4_K, Q5_K, Q6_K, MXFP4); a layer of another kind (Q4_0, ...), or whose gate and
up differ in kind, stays dequantised, and `memrad status` says so.

    memra-expert-blocks.safetensors  {layer}.mlp.experts.gate_up.{KIND}  [E, 2I, H/w · b] uint8
                                     {layer}.mlp.experts.down.{KIND}     [E, H, I/w · b]  uint8
    (w weights in b bytes: MXFP4 32 in 17, Q4_K 256 in 144, Q6_K 256 in 210, Q8_0 32 in 34, ...)
    gate_up's rows: gpt-oss gate 0, up 0, gate 1, up 1, ... (as transformers interleaves
    gate_up_proj's columns); Qwen3-MoE every gate row, then every up row (its gate_up_proj's rows),
    so one kernel call gives the layout each model's own activation takes

At load, where the weights run as shipped and memra's kernel runs here, each such layer's sparse
block becomes a `BlockMoE`: the model's router and experts (the same modules and parameters), and
for one token the chosen experts' blocks on `memra::block_gemv` (the blocks' own kind):

    h [1, H] -> router (the model's own: gpt-oss logits with bias, top k, softmax over the k;
                Qwen3-MoE softmax in float32, top k, renormalised) -> ids, weights [k]
             per chosen expert e, in ascending id (the order transformers' loop adds them in):
               gate_up = block_gemv(h, gate_up[e])                                       [1, 2I]
               gpt-oss:   act = experts._apply_gate(gate_up + gate_up_proj_bias[e])      [1, I]
                          out = block_gemv(act, down[e]) + down_proj_bias[e]             [1, H]
               Qwen3-MoE: gate, up = gate_up.chunk(2);  out = block_gemv(act_fn(gate) · up, down[e])
               total  += out · weight

Only the k chosen experts' blocks (and biases) are read (expert e's blocks a view selected with
`.item()`, as Qwen3-Next's step selects its experts: never a copy). The kernel multiplies the
shipped weights exactly and rounds the activation to int16 per block of 32 (2^-16 of the block's
largest |x|), so a token's experts differ from the dense dequantised ones by that rounding and
float32's (docs/ARCHITECTURE.md; tests/unit/test_gpt_oss.py and test_qwen3_moe_blocks.py state the
bounds), and each output is one fixed sequence of operations: a row's bits are its own alone or
batched, on any thread count. Prefill (more than one token) runs the dense experts the block
keeps, transformers' own forward. Gemma 4's experts (on the decoder layer, beside its dense MLP)
are not kept: they run dequantised.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from memrad.durable import publish
from memrad.engine.model.block_linear import FORMATS, MXFP4

log = logging.getLogger("memrad.engine")

EXPERTS_CACHE = "memra-expert-blocks.safetensors"
LAYOUT = "2"  # what the file's contents mean (1: gpt-oss's MXFP4 only); pull writes it again for a file stamped otherwise
KIND = FORMATS[MXFP4]  # gpt-oss's
RUNS = {name: kind for kind, name in FORMATS.items()}  # GGUF type -> the kernel's kind, for the types it runs as shipped
# A mixture's 3-D expert tensors as llama.cpp names them (gate and up apart, or joined as gate_up);
# memrad.engine.model.weights and preflight find them by this too.
EXPERT_TENSORS = re.compile(r"blk\.(?P<layer>\d+)\.ffn_(?P<part>gate_up|gate|up|down)_exps\.weight")
Parts = dict[str, tuple[str, torch.Tensor]]  # {"gate_up": (GGUF type, [E, 2I, row bytes]), "down": (..., [E, H, ...])} uint8


def shipped(gguf_path: Path, model: Any) -> dict[str, Parts]:
    """{experts module name: its blocks} for every layer of `model` (holding the float32 weights the
    GGUF was dequantised into) whose gate, up and down experts ship in kinds the kernel runs (gate's
    and up's the same) and dequantise to its `gate_up_proj` / `down_proj` bit for bit; a layer that
    does not match stays dense, with a warning (a kind the kernel does not run: said at start)."""
    from gguf import GGUFReader

    found: dict[str, dict[str, tuple[str, torch.Tensor]]] = {}
    for tensor in GGUFReader(gguf_path).tensors:
        match = EXPERT_TENSORS.fullmatch(tensor.name)
        if match and tensor.tensor_type.name in RUNS:  # data: [E, rows, row bytes]
            found.setdefault(f"model.layers.{match['layer']}.mlp.experts", {})[match["part"]] = (
                tensor.tensor_type.name, torch.from_numpy(np.array(tensor.data)))  # a copy: the map is read-only
    modules = dict(model.named_modules())
    kept = {}
    for name, parts in found.items():
        experts = modules.get(name)
        if set(parts) != {"gate", "up", "down"} or parts["gate"][0] != parts["up"][0] or experts is None:
            continue
        interleaved = hasattr(experts, "gate_up_proj_bias")  # gpt-oss: gate and up columns interleaved, [E, K, N]
        (kind, gate), (_, up) = parts["gate"], parts["up"]
        gate_up = (torch.stack([gate, up], dim=2).flatten(1, 2) if interleaved else torch.cat([gate, up], dim=1))
        blocks = {"gate_up": (kind, gate_up.contiguous()), "down": parts["down"]}
        if all(_equal(*blocks[part], getattr(experts, f"{part}_proj"), interleaved) for part in ("gate_up", "down")):
            kept[name] = blocks
        else:
            log.warning("GGUF experts for %s do not match the float weights: they stay dense", name)
    return kept


def _equal(kind: str, raw: torch.Tensor, weight: torch.Tensor, transposed: bool) -> bool:
    """Whether blocks of `kind` [E, N, row bytes] dequantise to `weight`: [E, K, N] where
    `transposed` (gpt-oss's layout), else [E, N, K] (Qwen3-MoE's)."""
    from gguf import GGMLQuantizationType, quants

    values = torch.from_numpy(np.ascontiguousarray(quants.dequantize(raw.numpy(), GGMLQuantizationType[kind])))
    target = weight.detach().float()
    target = target.transpose(1, 2) if transposed else target
    return tuple(values.shape) == tuple(target.shape) and torch.equal(values, target)


def save(blocks: dict[str, Parts], folder: Path, source: str) -> None:
    """Store the experts' blocks ({} when the GGUF ships none): the file's presence says they were looked at."""
    from safetensors.torch import save_file

    path = folder / EXPERTS_CACHE
    staging = path.with_name(path.name + ".partial")
    save_file({f"{name}.{part}.{kind}": raw for name, parts in blocks.items() for part, (kind, raw) in parts.items()},
              str(staging), metadata={"source": source, "layout": LAYOUT})
    publish(staging, path)


def load(folder: Path) -> dict[str, Parts]:
    """The folder's experts' blocks ({} when it keeps none, or no file: converted before memra kept them)."""
    if not (folder / EXPERTS_CACHE).is_file():
        return {}
    from safetensors.torch import load_file

    out: dict[str, Parts] = {}
    for key, raw in load_file(str(folder / EXPERTS_CACHE)).items():
        name, part, kind = key.rsplit(".", 2)
        out.setdefault(name, {})[part] = (kind, raw)
    return out


def kept_kinds(folder: Path) -> tuple[int, tuple[str, ...]]:
    """(how many layers' experts the folder keeps as blocks, their GGUF types), read from its
    header ((0, ()) without the file)."""
    if not (folder / EXPERTS_CACHE).is_file():
        return 0, ()
    from safetensors import safe_open

    with safe_open(str(folder / EXPERTS_CACHE), "pt") as f:
        keys = [key.rsplit(".", 2) for key in f.keys()]
    return len({name for name, _, _ in keys}), tuple(sorted({kind for _, _, kind in keys}))


def install(model: Any, folder: Path) -> int:
    """Make every sparse block whose experts the folder keeps as blocks a BlockMoE (in place);
    returns how many. Requires memra's block kernel (memrad.engine.kernels.block_gemv.why_not() is None)."""
    installed = 0
    for name, parts in load(folder).items():
        parent_name = name.removesuffix(".experts")
        mlp = model.get_submodule(parent_name)
        if not _fits(mlp.experts, parts):
            log.warning("the kept expert blocks of %s do not fit its experts: they stay dense", name)
            continue
        owner, _, attribute = parent_name.rpartition(".")
        setattr(model.get_submodule(owner), attribute, BlockMoE(mlp, parts))
        installed += 1
    return installed


def _fits(experts: nn.Module, parts: Parts) -> bool:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    def row_bytes(kind: str, k: int) -> int:
        weights, size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
        return k // weights * size

    biased = hasattr(experts, "gate_up_proj_bias")
    e, a, b = experts.gate_up_proj.shape  # gpt-oss [E, H, 2I], Qwen3-MoE [E, 2I, H]
    (up_kind, gate_up), (down_kind, down) = parts["gate_up"], parts["down"]
    hidden, double = (a, b) if biased else (b, a)
    return (tuple(gate_up.shape) == (e, double, row_bytes(up_kind, hidden))
            and tuple(down.shape) == (e, hidden, row_bytes(down_kind, double // 2)))


class BlockMoE(nn.Module):
    """A sparse block (the model's router and experts, shared) whose one-token calls run the
    chosen experts' blocks on memra's kernel (module docstring); longer inputs (prefill) run the
    dense experts. Returns what the model's block returns: gpt-oss's GptOssMLP (out [B, T, H],
    router scores [B·T, k]), Qwen3-MoE's sparse block out [B, T, H]. Its router keeps the
    model's name (`router`, `gate`), so the steps find it as they find the model's."""

    def __init__(self, mlp: nn.Module, parts: Parts) -> None:
        super().__init__()
        self.router_name = "router" if hasattr(mlp, "router") else "gate"
        setattr(self, self.router_name, getattr(mlp, self.router_name))
        self.experts = mlp.experts
        self.biased = hasattr(mlp.experts, "gate_up_proj_bias")  # gpt-oss: biases, its own activation, scores out
        (self.gate_up_kind, gate_up), (self.down_kind, down) = parts["gate_up"], parts["down"]
        self.register_buffer("gate_up_blocks", gate_up, persistent=False)  # [E, 2I, row bytes]
        self.register_buffer("down_blocks", down, persistent=False)  # [E, H, row bytes]

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        batch, length, hidden = hidden_states.shape
        flat = hidden_states.reshape(-1, hidden)  # [T, H]
        _, scores, ids = getattr(self, self.router_name)(flat)  # [T, k] each
        if flat.shape[0] == 1:
            out = self.chosen(flat, ids[0], scores[0])
        else:
            out = self.experts(flat, ids, scores)
        out = out.reshape(batch, length, hidden)
        return (out, scores) if self.biased else out

    def chosen(self, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The k experts `ids` [k] of one token h [1, H] on their blocks, summed with `weights` [k]: [1, H]."""
        ids, at = torch.sort(ids)  # ascending expert id, as transformers' loop over the hit experts
        weights = weights.index_select(0, at)  # [k], in that order
        total = torch.zeros_like(h)
        for j in range(ids.shape[0]):
            e = ids[j].item()
            torch._check(e >= 0)  # so export may index with it (a data-dependent size)
            torch._check(e < self.gate_up_blocks.shape[0])
            total = total + (self.expert(h, e) * weights[j]).to(h.dtype)
        return total

    def expert(self, h: torch.Tensor, e: int) -> torch.Tensor:
        """Expert e of one token h [1, H] on its blocks, as the model's experts compute it: [1, H]."""
        experts, gemv = self.experts, torch.ops.memra.block_gemv
        gate_up = gemv(h, self.gate_up_blocks.select(0, e), RUNS[self.gate_up_kind])  # [1, 2I]
        if self.biased:  # gpt-oss: clamps, (up + 1) · gate · σ(α · gate), biases
            act = experts._apply_gate(gate_up + experts.gate_up_proj_bias.select(0, e))  # [1, I]
            return gemv(act, self.down_blocks.select(0, e), RUNS[self.down_kind]) + experts.down_proj_bias.select(0, e)
        gate, up = gate_up.chunk(2, dim=-1)  # Qwen3-MoE: act(gate) · up
        return gemv(experts.act_fn(gate) * up, self.down_blocks.select(0, e), RUNS[self.down_kind])

    def extra_repr(self) -> str:
        return f"{self.gate_up_kind} / {self.down_kind} expert blocks on memra's kernel for single tokens"
