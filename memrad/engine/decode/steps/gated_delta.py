"""The one-token update of a gated delta net (Qwen3-Next's linear attention), in place.

transformers' Qwen3NextGatedDeltaNet at one cached token is a short causal convolution over
the projected q, k, v and one step of the gated delta rule. This module computes the same
operations in the same order (so in float32 its bits are transformers'), and rewrites the
layer's two state tensors in place instead of handing new ones to the cache:

    x [1, 1, hidden] -> qkvz, ba = in_proj(x)                      (one fused matmul)
       mixed = q|k|v  [1, C, 1]
       conv state [1, C, K]:  window = cat(state, mixed)  [1, C, K + 1]
                              state <- window[..., 1:]     (in place)
                              mixed = silu(depthwise conv1d(window))[..., -1]
       recurrent state S [1, H_v, D_k, D_v] (float32):
                              S <- S * exp(g);  S <- S + k (x) (v - S^T k) * beta   (in place)
                              o = S^T q / sqrt(D_k)     (q, k l2-normalised, k heads repeated)
       out = out_proj(gated_rmsnorm(o, z))

The states are the cache's own tensors (memrad.engine.state.recurrent.RecurrentLayer), so a
compiled graph that takes them as inputs writes them where snapshots and the disk tier look.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from memrad.engine.decode.steps.llama import fuse


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    # transformers' qwen3_next.l2norm, as the FLA kernels compute it
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


class GatedDeltaMixer(nn.Module):
    """The decode-step view of one Qwen3NextGatedDeltaNet; shares its weights."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net  # for fix_query_key_value_ordering (pure reshapes) and the gated norm
        self.in_proj = fuse([net.in_proj_qkvz, net.in_proj_ba])
        self.split = (net.in_proj_qkvz.out_features, net.in_proj_ba.out_features)
        self.conv_weight = net.conv1d.weight  # [C, 1, K]
        self.conv_bias = net.conv1d.bias
        self.norm, self.out_proj = net.norm, net.out_proj
        self.A_log, self.dt_bias = net.A_log, net.dt_bias
        self.key_dim, self.value_dim = net.key_dim, net.value_dim
        self.k_heads, self.v_heads = net.num_k_heads, net.num_v_heads
        self.k_dim, self.v_dim = net.head_k_dim, net.head_v_dim
        assert net.activation == "silu", net.activation

    def forward(self, x: torch.Tensor, conv_state: torch.Tensor, recurrent_state: torch.Tensor) -> torch.Tensor:
        # x [1, 1, hidden]; conv_state [1, C, K] (model dtype); recurrent_state [1, H_v, D_k, D_v]
        qkvz, ba = self.in_proj(x).split(self.split, dim=-1)
        query, key, value, z, b, a = self.net.fix_query_key_value_ordering(qkvz, ba)
        query, key, value = (t.reshape(1, 1, -1) for t in (query, key, value))
        mixed = torch.cat((query, key, value), dim=-1).transpose(1, 2)  # [1, C, 1]

        window = torch.cat([conv_state, mixed], dim=-1).to(self.conv_weight.dtype)  # [1, C, K + 1]
        conv_state.copy_(window[:, :, -conv_state.shape[-1]:])
        mixed = F.conv1d(window, self.conv_weight, self.conv_bias, padding=0, groups=window.shape[1])[:, :, -1:]
        mixed = F.silu(mixed).to(x.dtype).transpose(1, 2)  # [1, 1, C]
        query, key, value = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        query = query.reshape(1, 1, self.k_heads, self.k_dim)
        key = key.reshape(1, 1, self.k_heads, self.k_dim)
        value = value.reshape(1, 1, self.v_heads, self.v_dim)

        beta = b.sigmoid()  # [1, 1, H_v]
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)  # [1, 1, H_v]
        out = self._delta_rule(query, key, value, g, beta, recurrent_state)  # [1, 1, H_v, D_v]

        out = self.norm(out.reshape(-1, self.v_dim), z.reshape(-1, self.v_dim))  # [H_v, D_v]
        return self.out_proj(out.reshape(1, 1, -1))

    def _delta_rule(self, query, key, value, g, beta, state):
        """transformers' torch_recurrent_gated_delta_rule for one token, writing `state`."""
        dtype = query.dtype
        if self.k_heads != self.v_heads:  # each q/k head serves H_v / H_k consecutive value heads
            query = query.repeat_interleave(self.v_heads // self.k_heads, dim=2)
            key = key.repeat_interleave(self.v_heads // self.k_heads, dim=2)
        query, key, value, beta, g = [t.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format)
                                      for t in (query, key, value, beta, g)]
        query, key = _l2norm(query), _l2norm(key)
        query = query / (query.shape[-1] ** 0.5)
        q_t, k_t, v_t = query[:, :, 0], key[:, :, 0], value[:, :, 0]  # [1, H_v, D]
        last = state.to(value) * g[:, :, 0].exp()[..., None, None]
        kv_mem = (last * k_t.unsqueeze(-1)).sum(dim=-2)
        delta = (v_t - kv_mem) * beta[:, :, 0].unsqueeze(-1)
        last = last + k_t.unsqueeze(-1) * delta.unsqueeze(-2)
        state.copy_(last)
        out = (last * q_t.unsqueeze(-1)).sum(dim=-2)  # [1, H_v, D_v]
        return out.unsqueeze(1).to(dtype)  # [1, 1, H_v, D_v]
