"""A mixture's routed experts for one token: dense dequantised against their shipped blocks.

One layer's sparse block of a random config (gpt-oss's: router with bias, MXFP4 experts;
Qwen3-MoE's: gate and up Q4_K, down Q6_K, as its Q4_K_M file ships them), E experts of width I,
top k, its experts drawn as random blocks (memrad.engine.model.quant.random_super_blocks: MXFP4
scale bytes 117..124, k-quants' fp16 d small and positive, every other byte random) and
dequantised into transformers' `gate_up_proj` / `down_proj`, so both arms multiply the same
weights: transformers' sparse block on the dense experts in the model's dtype, and memra's
BlockMoE on the blocks (memrad.engine.model.block_experts, the chosen experts' blocks on memra's
kernel). Each is timed on the same tokens (one at a time, each token's own routing), calls
interleaved, the median of `reps`; the bytes a token reads of the experts are counted both ways
(k of E experts' weights, biases left out: the same in both). `memrad bench experts` prints it
(docs/BENCHMARKS.md, gpt-oss and Qwen3-MoE).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True, slots=True)
class Shape:
    arch: str  # "gpt_oss" or "qwen3_moe"
    hidden: int
    width: int  # an expert's intermediate width
    experts: int
    top_k: int
    gate_up: str  # the GGUF types of gate / up and of down
    down: str


SHAPES = {
    "tiny": Shape("gpt_oss", 64, 32, 8, 2, "MXFP4", "MXFP4"),  # tests/unit/tiny.py's build_gpt_oss
    "wide": Shape("gpt_oss", 2880, 2880, 8, 4, "MXFP4", "MXFP4"),  # gpt-oss-20b's widths and top k, 8 of its 32
    "q3-tiny": Shape("qwen3_moe", 256, 256, 8, 2, "Q4_K", "Q6_K"),  # k-quants: rows of whole 256-weight blocks
    "q3-30b": Shape("qwen3_moe", 2048, 768, 16, 8, "Q4_K", "Q6_K"),  # Qwen3-30B-A3B's widths, top 8, 16 of its 128
}


@dataclass(frozen=True, slots=True)
class ExpertSpeed:
    shape: str
    dense_ms: float  # ms a token, transformers' experts on the dense weights
    blocks_ms: float  # ms a token, the chosen experts' blocks on memra's kernel
    dense_bytes: int  # bytes a token reads of the experts, dense in the model's dtype
    shipped_bytes: int  # ... as shipped blocks

    @property
    def ratio(self) -> float:
        return self.dense_ms / self.blocks_ms


def sparse_block(shape: str, dtype: torch.dtype, seed: int = 0):
    """(the model's sparse block in `dtype` with experts from random blocks, its BlockMoE parts
    {"gate_up": (type, blocks), "down": (type, blocks)})."""
    from gguf import GGMLQuantizationType, quants

    from memrad.engine.model.quant import random_super_blocks

    s = SHAPES[shape]
    torch.manual_seed(seed)
    mlp = _block(s).eval()
    generator = torch.Generator().manual_seed(seed)
    gate_up = random_super_blocks(s.gate_up, s.experts * 2 * s.width, s.hidden, generator).raw.view(s.experts, 2 * s.width, -1)
    down = random_super_blocks(s.down, s.experts * s.hidden, s.width, generator).raw.view(s.experts, s.hidden, -1)

    def dense(raw: torch.Tensor, kind: str) -> torch.Tensor:  # [E, N, row bytes] -> [E, N, K]
        return torch.from_numpy(np.ascontiguousarray(quants.dequantize(raw.numpy(), GGMLQuantizationType[kind])))

    with torch.no_grad():
        experts = mlp.experts
        if s.arch == "gpt_oss":  # transformers' layout [E, K, N], gate and up columns interleaved
            experts.gate_up_proj.copy_(dense(gate_up, s.gate_up).transpose(1, 2))
            experts.down_proj.copy_(dense(down, s.down).transpose(1, 2))
            for parameter in (mlp.router.weight, mlp.router.bias, experts.gate_up_proj_bias, experts.down_proj_bias):
                parameter.normal_(0.0, 0.02)
        else:  # Qwen3-MoE's [E, N, K], every gate row then every up row
            experts.gate_up_proj.copy_(dense(gate_up, s.gate_up))
            experts.down_proj.copy_(dense(down, s.down))
            mlp.gate.weight.normal_(0.0, 0.02)
    return mlp.to(dtype), {"gate_up": (s.gate_up, gate_up.contiguous()), "down": (s.down, down.contiguous())}


def _block(s: Shape) -> torch.nn.Module:
    if s.arch == "gpt_oss":
        from transformers import GptOssConfig
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

        config = GptOssConfig(hidden_size=s.hidden, intermediate_size=s.width, num_local_experts=s.experts,
                              num_experts_per_tok=s.top_k)
        config._experts_implementation = "eager"  # transformers' own loop, as a loaded model's
        return GptOssMLP(config)
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = Qwen3MoeConfig(hidden_size=s.hidden, moe_intermediate_size=s.width, num_experts=s.experts,
                            num_experts_per_tok=s.top_k, norm_topk_prob=True)
    config._experts_implementation = "eager"
    return Qwen3MoeSparseMoeBlock(config)


def measure(shape: str, dtype_name: str = "bfloat16", reps: int = 64, threads: int = 1) -> ExpertSpeed:
    """`shape`'s sparse block timed dense and on its blocks for `reps` tokens each."""
    from memrad.engine.kernels import block_gemv
    from memrad.engine.model.block_experts import BlockMoE

    assert block_gemv.why_not() is None, block_gemv.why_not()
    torch.set_num_threads(threads)
    dtype = getattr(torch, dtype_name)
    mlp, parts = sparse_block(shape, dtype)
    on_blocks = BlockMoE(mlp, parts)
    tokens = torch.randn(reps, 1, 1, SHAPES[shape].hidden, generator=torch.Generator().manual_seed(1)).to(dtype)
    times: list[list[float]] = [[], []]
    with torch.no_grad():
        for arm in (mlp, on_blocks):  # warm
            arm(tokens[0])
        for x in tokens:
            for i, arm in enumerate((mlp, on_blocks)):
                started = time.perf_counter()
                arm(x)
                times[i].append(time.perf_counter() - started)
    experts, k = mlp.experts, SHAPES[shape].top_k
    share = lambda total: total * k // experts.num_experts  # noqa: E731: k of E experts a token
    return ExpertSpeed(shape, statistics.median(times[0]) * 1e3, statistics.median(times[1]) * 1e3,
                       share(experts.gate_up_proj.nbytes + experts.down_proj.nbytes),
                       share(sum(raw.nbytes for _, raw in parts.values())))
