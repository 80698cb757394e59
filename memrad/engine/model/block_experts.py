"""gpt-oss's routed experts from their MXFP4 blocks, as shipped, on memra's block kernel.

llama.cpp ships gpt-oss's experts as 3-D MXFP4 tensors (per 32 weights an E8M0 scale byte and 16
bytes of E2M1 codes: 17 bytes where bf16 takes 64). Conversion dequantises them into transformers'
`gate_up_proj` / `down_proj` (memrad.engine.model.gguf_gpt_oss) and keeps their bytes beside the
float weights, checked as every block file is: dequantised as gguf-py does, they must equal the
float weights bit for bit, or the layer's experts stay dense.

    memra-expert-blocks.safetensors  {layer}.mlp.experts.gate_up.MXFP4  [E, 2I, H/32 · 17] uint8
                                     {layer}.mlp.experts.down.MXFP4     [E, H, I/32 · 17]  uint8
    gate_up's rows: gate 0, up 0, gate 1, up 1, ... (ffn_gate_exps' and ffn_up_exps' rows, laid as
    transformers interleaves gate_up_proj's columns), so one kernel call gives the layout
    GptOssExperts' own activation takes

At load, where the weights run as shipped and memra's kernel runs here, each such layer's sparse
block becomes a `BlockMoE`: the model's router and experts (the same modules and parameters), and
for one token the chosen experts' blocks on `memra::block_gemv` (kind 39):

    h [1, H] -> router (the model's: logits with bias, top k, softmax over the k) -> ids, weights [k]
             per chosen expert e, in ascending id (the order transformers' loop adds them in):
               gate_up = block_gemv(h, gate_up[e]) + gate_up_proj_bias[e]      [1, 2I]
               act     = experts._apply_gate(gate_up)  (clamps, (up + 1) · gate · σ(α · gate)) [1, I]
               total  += (block_gemv(act, down[e]) + down_proj_bias[e]) · weight   [1, H]

Only the k chosen experts' blocks and biases are read (expert e's blocks a view selected with
`.item()`, as Qwen3-Next's step selects its experts: never a copy). The kernel multiplies the
shipped weights exactly and rounds the activation to int16 per block of 32 (2^-16 of the block's
largest |x|), so a token's experts differ from the dense dequantised ones by that rounding and
float32's (docs/ARCHITECTURE.md; tests/unit/test_gpt_oss.py states the bound), and each output is
one fixed sequence of operations: a row's bits are its own alone or batched, on any thread count.
Prefill (more than one token) runs the dense experts the block keeps, transformers' own forward.
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
from memrad.engine.model.block_linear import MXFP4

log = logging.getLogger("memrad.engine")

EXPERTS_CACHE = "memra-expert-blocks.safetensors"
LAYOUT = "1"  # what the file's contents mean; pull writes it again for a file stamped otherwise
KIND = "MXFP4"
_EXPERTS = re.compile(r"blk\.(?P<layer>\d+)\.ffn_(?P<part>gate|up|down)_exps\.weight")
Parts = dict[str, torch.Tensor]  # {"gate_up": [E, 2I, H/32 · 17], "down": [E, H, I/32 · 17]} uint8


def shipped(gguf_path: Path, model: Any) -> dict[str, Parts]:
    """{experts module name: its blocks} for every layer of `model` (holding the float32 weights the
    GGUF was dequantised into) whose gate, up and down experts ship MXFP4 and dequantise to its
    `gate_up_proj` / `down_proj` bit for bit; a layer that does not match stays dense, with a warning."""
    from gguf import GGUFReader

    found: dict[str, dict[str, torch.Tensor]] = {}
    for tensor in GGUFReader(gguf_path).tensors:
        match = _EXPERTS.fullmatch(tensor.name)
        if match and tensor.tensor_type.name == KIND:  # data: [E, rows, row bytes]
            found.setdefault(f"model.layers.{match['layer']}.mlp.experts", {})[match["part"]] = torch.from_numpy(
                np.array(tensor.data))  # a copy: the reader's memory map is read-only
    modules = dict(model.named_modules())
    kept = {}
    for name, parts in found.items():
        experts = modules.get(name)
        if set(parts) != {"gate", "up", "down"} or not hasattr(experts, "gate_up_proj_bias"):
            continue  # not gpt-oss's experts (Qwen3-MoE's have no biases and join gate, up otherwise)
        blocks = {"gate_up": torch.stack([parts["gate"], parts["up"]], dim=2).flatten(1, 2).contiguous(),
                  "down": parts["down"]}
        if _equal(blocks["gate_up"], experts.gate_up_proj) and _equal(blocks["down"], experts.down_proj):
            kept[name] = blocks
        else:
            log.warning("GGUF experts for %s do not match the float weights: they stay dense", name)
    return kept


def _equal(raw: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether MXFP4 blocks [E, N, K/32 · 17] dequantise to `weight` [E, K, N] (transformers' layout)."""
    from gguf import GGMLQuantizationType, quants

    values = torch.from_numpy(np.ascontiguousarray(quants.dequantize(raw.numpy(), GGMLQuantizationType.MXFP4)))
    target = weight.detach().float().transpose(1, 2)
    return tuple(values.shape) == tuple(target.shape) and torch.equal(values, target)


def save(blocks: dict[str, Parts], folder: Path, source: str) -> None:
    """Store the experts' blocks ({} when the GGUF ships none): the file's presence says they were looked at."""
    from safetensors.torch import save_file

    path = folder / EXPERTS_CACHE
    staging = path.with_name(path.name + ".partial")
    save_file({f"{name}.{part}.{KIND}": raw for name, parts in blocks.items() for part, raw in parts.items()},
              str(staging), metadata={"source": source, "layout": LAYOUT})
    publish(staging, path)


def load(folder: Path) -> dict[str, Parts]:
    """The folder's experts' blocks ({} when it keeps none, or no file: converted before memra kept them)."""
    if not (folder / EXPERTS_CACHE).is_file():
        return {}
    from safetensors.torch import load_file

    out: dict[str, Parts] = {}
    for key, raw in load_file(str(folder / EXPERTS_CACHE)).items():
        name, part, _ = key.rsplit(".", 2)
        out.setdefault(name, {})[part] = raw
    return out


def count(folder: Path) -> int:
    """How many layers' experts the folder keeps as blocks (0 without the file), read from its header."""
    if not (folder / EXPERTS_CACHE).is_file():
        return 0
    from safetensors import safe_open

    with safe_open(str(folder / EXPERTS_CACHE), "pt") as f:
        return len({key.rsplit(".", 2)[0] for key in f.keys()})


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
        setattr(model.get_submodule(owner), attribute, BlockMoE(mlp, parts["gate_up"], parts["down"]))
        installed += 1
    return installed


def _fits(experts: nn.Module, parts: Parts) -> bool:
    e, hidden, double = experts.gate_up_proj.shape  # [E, H, 2I]
    return (tuple(parts["gate_up"].shape) == (e, double, hidden // 32 * 17)
            and tuple(parts["down"].shape) == (e, hidden, double // 2 // 32 * 17))


class BlockMoE(nn.Module):
    """gpt-oss's sparse block (the model's router and experts, shared) whose one-token calls run
    the chosen experts' MXFP4 blocks on memra's kernel (module docstring); longer inputs (prefill)
    run the dense experts. Returns what GptOssMLP returns: (out [B, T, H], router scores [B·T, k])."""

    def __init__(self, mlp: nn.Module, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        super().__init__()
        self.router, self.experts = mlp.router, mlp.experts
        self.register_buffer("gate_up_blocks", gate_up, persistent=False)  # [E, 2I, H/32 · 17]
        self.register_buffer("down_blocks", down, persistent=False)  # [E, H, I/32 · 17]

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        batch, length, hidden = hidden_states.shape
        flat = hidden_states.reshape(-1, hidden)  # [T, H]
        _, scores, ids = self.router(flat)  # [T, k] each
        if flat.shape[0] == 1:
            out = self.chosen(flat, ids[0], scores[0])
        else:
            out = self.experts(flat, ids, scores)
        return out.reshape(batch, length, hidden), scores

    def chosen(self, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The k experts `ids` [k] of one token h [1, H] on their blocks, summed with `weights` [k]: [1, H]."""
        experts = self.experts
        ids, at = torch.sort(ids)  # ascending expert id, as transformers' loop over the hit experts
        weights = weights.index_select(0, at)  # [k], in that order
        total = torch.zeros_like(h)
        for j in range(ids.shape[0]):
            e = ids[j].item()
            torch._check(e >= 0)  # so export may index with it (a data-dependent size)
            torch._check(e < self.gate_up_blocks.shape[0])
            gate_up = torch.ops.memra.block_gemv(h, self.gate_up_blocks.select(0, e), MXFP4)  # [1, 2I]
            act = experts._apply_gate(gate_up + experts.gate_up_proj_bias.select(0, e))  # [1, I]
            out = torch.ops.memra.block_gemv(act, self.down_blocks.select(0, e), MXFP4)  # [1, H]
            out = out + experts.down_proj_bias.select(0, e)
            total = total + (out * weights[j]).to(h.dtype)
        return total

    def extra_repr(self) -> str:
        return f"{KIND} expert blocks on memra's kernel for single tokens"

