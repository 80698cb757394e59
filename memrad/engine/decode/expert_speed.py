"""gpt-oss's routed experts for one token: dense dequantised against their MXFP4 blocks.

One layer's sparse block of a random gpt-oss config (router with bias, E experts of width I,
top k), its experts drawn as random MXFP4 blocks (memrad.engine.model.quant.random_super_blocks:
scale bytes 117..124, random codes) and dequantised into transformers' `gate_up_proj` /
`down_proj`, so both arms multiply the same weights: transformers' GptOssMLP on the dense
experts in the model's dtype, and memra's BlockMoE on the blocks (memrad.engine.model.block_experts,
the chosen experts' blocks on memra's kernel). Each is timed on the same tokens (one at a time,
each token's own routing), calls interleaved, the median of `reps`; the bytes a token reads of
the experts are counted both ways (k of E experts' weights, biases left out: the same in both).
`memrad bench experts` prints it (docs/BENCHMARKS.md, gpt-oss).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import numpy as np
import torch

SHAPES = {  # name -> (hidden, expert width, experts, top k)
    "tiny": (64, 32, 8, 2),  # tests/unit/tiny.py's build_gpt_oss
    "wide": (2880, 2880, 8, 4),  # gpt-oss-20b's widths and top k, 8 of its 32 experts (one layer)
}


@dataclass(frozen=True, slots=True)
class ExpertSpeed:
    shape: str
    dense_ms: float  # ms a token, transformers' experts on the dense weights
    blocks_ms: float  # ms a token, the chosen experts' MXFP4 blocks on memra's kernel
    dense_bytes: int  # bytes a token reads of the experts, dense in the model's dtype
    shipped_bytes: int  # ... as MXFP4 blocks

    @property
    def ratio(self) -> float:
        return self.dense_ms / self.blocks_ms


def sparse_block(shape: str, dtype: torch.dtype, seed: int = 0):
    """(GptOssMLP in `dtype` with experts from random MXFP4 blocks, {"gate_up": blocks, "down": blocks})."""
    from gguf import GGMLQuantizationType, quants
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    from memrad.engine.model.quant import random_super_blocks

    hidden, width, count, top_k = SHAPES[shape]
    torch.manual_seed(seed)
    config = GptOssConfig(hidden_size=hidden, intermediate_size=width, num_local_experts=count,
                          num_experts_per_tok=top_k)
    config._experts_implementation = "eager"  # transformers' own loop, as a loaded model's
    mlp = GptOssMLP(config).eval()
    generator = torch.Generator().manual_seed(seed)
    gate_up = random_super_blocks("MXFP4", count * 2 * width, hidden, generator).raw.view(count, 2 * width, -1)
    down = random_super_blocks("MXFP4", count * hidden, width, generator).raw.view(count, hidden, -1)

    def dense(raw: torch.Tensor) -> torch.Tensor:  # [E, N, K/32 · 17] -> [E, K, N], transformers' layout
        values = quants.dequantize(raw.numpy(), GGMLQuantizationType.MXFP4)
        return torch.from_numpy(np.ascontiguousarray(values)).transpose(1, 2)

    with torch.no_grad():
        mlp.experts.gate_up_proj.copy_(dense(gate_up))
        mlp.experts.down_proj.copy_(dense(down))
        experts = mlp.experts
        for parameter in (mlp.router.weight, mlp.router.bias, experts.gate_up_proj_bias, experts.down_proj_bias):
            parameter.normal_(0.0, 0.02)
    return mlp.to(dtype), {"gate_up": gate_up.contiguous(), "down": down.contiguous()}


def measure(shape: str, dtype_name: str = "bfloat16", reps: int = 64, threads: int = 1) -> ExpertSpeed:
    """`shape`'s sparse block timed dense and on its blocks for `reps` tokens each."""
    from memrad.engine.kernels import block_gemv
    from memrad.engine.model.block_experts import BlockMoE

    assert block_gemv.why_not() is None, block_gemv.why_not()
    torch.set_num_threads(threads)
    dtype = getattr(torch, dtype_name)
    mlp, blocks = sparse_block(shape, dtype)
    on_blocks = BlockMoE(mlp, blocks["gate_up"], blocks["down"])
    tokens = torch.randn(reps, 1, 1, SHAPES[shape][0], generator=torch.Generator().manual_seed(1)).to(dtype)
    times: list[list[float]] = [[], []]
    with torch.no_grad():
        for arm in (mlp, on_blocks):  # warm
            arm(tokens[0])
        for x in tokens:
            for i, arm in enumerate((mlp, on_blocks)):
                started = time.perf_counter()
                arm(x)
                times[i].append(time.perf_counter() - started)
    experts, k = mlp.experts, mlp.router.top_k
    share = lambda total: total * k // experts.num_experts  # noqa: E731: k of E experts a token
    return ExpertSpeed(shape, statistics.median(times[0]) * 1e3, statistics.median(times[1]) * 1e3,
                       share(experts.gate_up_proj.nbytes + experts.down_proj.nbytes),
                       share(blocks["gate_up"].nbytes + blocks["down"].nbytes))
