"""A mixture-of-experts feed-forward on the decode steps: top-k routing, only the chosen experts read.

Qwen3-MoE's layers are Qwen3's with the gated MLP replaced by a sparse block: a router scores
every expert for the token, the top k are kept (their probabilities renormalised: the GGUF
loader's norm_topk_prob), and only those k experts' gate/up and down projections run, their
outputs summed with the router's weights:

    h [1, H] -> router logits [E] -> softmax (float32) -> top k: ids [k], weights [k] (renormalised)
             -> rows sorted by expert id -> grouped matmul over gate_up [E, 2I, H] (only the k
                groups with a row are computed) -> act(gate) * up -> grouped down [E, H, I]
             -> * weights -> sum over the k in float32 -> [1, H]

The step calls the model's own sparse block (transformers' router and its experts forward,
`grouped_mm` on the CPU), one token at a time: the router's choice is the forward's, the same
ids and weights, and the experts' bits are the forward's at one token, because they are the
same ops on the same shapes. The grouped matmul skips the groups no row falls in, so an expert
the token did not choose is never read (a test poisons them with NaN). Per token, the bytes
read are the router's plus k of E experts' (`bytes_per_token`).

Several tokens (the batched step's rows) run one call each: the grouped matmul's bits for a
token depend on how many tokens share its expert in fp32 (measured: a 3-token call differs from
three 1-token calls by 2e-8), so a row batched with others takes exactly the one-row step's
path and its bits never depend on its neighbours' routing.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn


def is_sparse(mlp: nn.Module) -> bool:
    """Whether a decoder layer's `mlp` is a routed mixture of experts (a router `gate` and
    stacked `experts`), not a gated MLP."""
    return hasattr(mlp, "experts") and hasattr(mlp, "gate") and not hasattr(mlp, "gate_proj")


def router_of(mlp: nn.Module) -> nn.Module | None:
    """A routed block's router, with its `top_k`: Qwen3-MoE's `gate`, gpt-oss's `router` (None:
    not a mixture of experts)."""
    if not hasattr(mlp, "experts") or hasattr(mlp, "gate_proj"):
        return None
    return getattr(mlp, "gate", None) or getattr(mlp, "router", None)


def top_k(config: Any) -> int:
    """How many experts a token reads: Qwen3-MoE's and gpt-oss's num_experts_per_tok, Gemma 4's
    top_k_experts."""
    return getattr(config, "num_experts_per_tok", None) or config.top_k_experts


def feed_forward(mlp: Callable[[torch.Tensor], torch.Tensor], h: torch.Tensor) -> torch.Tensor:
    """The sparse block's output for h [B, 1, hidden], each row routed and computed on its own:
    [B, 1, hidden]. `mlp`: the model's block, or a step's call of its router and experts (Gemma 4's
    sit on the decoder layer beside its dense MLP)."""
    if h.shape[0] == 1:
        return mlp(h)
    return torch.cat([mlp(h[r : r + 1]) for r in range(h.shape[0])])


def bytes_per_token(model: nn.Module) -> tuple[int, int]:
    """(bytes the feed-forward layers read per token with top-k routing, bytes a dense model
    reading every expert would): the router's weights plus k of E experts' per sparse layer, and
    every dense MLP's weights in both."""
    routed = dense = 0
    for layer in model.model.layers:
        for gate, experts, weights in _feed_forwards(layer):
            if experts is None:
                routed, dense = routed + weights, dense + weights
                continue
            router = sum(p.numel() * p.element_size() for p in gate.parameters())
            expert_bytes = (weights - router) // experts.num_experts  # gpt-oss: each expert's biases too
            routed += router + (getattr(gate, "top_k", None) or top_k(model.config)) * expert_bytes
            dense += weights
    return routed, dense


def has_experts(model: nn.Module) -> bool:
    """Whether some decoder layer of `model` routes tokens to experts (Qwen3-MoE's and gpt-oss's
    `mlp`, Gemma 4's layer); LFM2's layers name their MLP otherwise and have none."""
    return any(router_of(getattr(layer, "mlp", None)) is not None or getattr(layer, "enable_moe_block", False)
               for layer in model.model.layers)


def _feed_forwards(layer: nn.Module) -> list[tuple[nn.Module | None, nn.Module | None, int]]:
    """(router, experts, bytes of both) of each feed-forward in a decoder layer, (None, None, bytes)
    for a dense MLP: its `mlp`, and Gemma 4's router and experts beside it (enable_moe_block)."""
    size = lambda *modules: sum(p.numel() * p.element_size() for m in modules for p in m.parameters())  # noqa: E731
    mlp, out = layer.mlp, []
    gate = router_of(mlp)
    out.append((gate, mlp.experts, size(mlp)) if gate is not None else (None, None, size(mlp)))
    if getattr(layer, "enable_moe_block", False):
        out.append((layer.router, layer.experts, size(layer.router, layer.experts)))
    return out
