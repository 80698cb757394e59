"""The one-token update of a Mamba-2 mixer (FalconH1's), in place.

transformers' FalconH1Mixer at one cached token: the input projection (muP-scaled), a short
causal convolution over x|B|C, one selective-state step, the gated RMSNorm, the output
projection. This module computes the same operations in the same order (so its bits are
transformers') and rewrites the layer's two state tensors in place:

    h [1, 1, hidden] -> z | xBC | dt = in_proj(h * ssm_in) * mup
       conv state [1, C, K]:  window = cat(state, xBC)  [1, C, K + 1];  state <- window[..., 1:]
                              xBC = silu(depthwise conv1d(window))[..., -1]
       x | B | C = xBC;   dt = softplus(dt + dt_bias);  dA = exp(dt * A)
       state S [1, H, P, N]:  S <- S * dA + (dt * B) x;   y = S C + D x
       out = out_proj(gated_rmsnorm(y, z))                (or y * silu(z) without the norm)

The states are the cache's own tensors (memrad.engine.state.recurrent.HybridSlabLayer).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class Mamba2Mixer(nn.Module):
    """The decode-step view of one FalconH1Mixer; shares its weights and buffers."""

    def __init__(self, mixer: nn.Module) -> None:
        super().__init__()
        self.in_proj, self.out_proj, self.norm = mixer.in_proj, mixer.out_proj, mixer.norm
        self.conv_weight, self.conv_bias = mixer.conv1d.weight, mixer.conv1d.bias  # [C, 1, K]
        self.A_log, self.D, self.dt_bias = mixer.A_log, mixer.D, mixer.dt_bias
        self.register_buffer("mup", mixer.mup_vector, persistent=False)  # [1, 1, projection]
        self.ssm_in = mixer.ssm_in_multiplier
        self.inner, self.conv_dim, self.heads = mixer.intermediate_size, mixer.conv_dim, mixer.num_heads
        self.groups, self.state_size, self.head_dim = mixer.n_groups, mixer.ssm_state_size, mixer.head_dim
        self.rms_norm, self.act = mixer.mamba_rms_norm, mixer.act  # transformers' decode ignores time_step_limit too

    def forward(self, h: torch.Tensor, conv_state: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        # h [1, 1, hidden]; conv_state [1, C, K]; state [1, H, P, N]
        dtype = h.dtype
        projected = self.in_proj(h * self.ssm_in) * self.mup
        A = -torch.exp(self.A_log.float())
        gate, xbc, dt = projected.split([self.inner, self.conv_dim, self.heads], dim=-1)

        window = torch.cat([conv_state, xbc.transpose(1, 2)], dim=-1).to(self.conv_weight.dtype)  # [1, C, K + 1]
        conv_state.copy_(window[:, :, -conv_state.shape[-1]:])
        xbc = F.conv1d(window, self.conv_weight, self.conv_bias, padding=0, groups=self.conv_dim)[:, :, -1:]
        xbc = self.act(xbc).to(dtype).transpose(1, 2)  # [1, 1, C]
        n = self.groups * self.state_size
        x, B, C = torch.split(xbc, [self.inner, n, n], dim=-1)

        p, s = self.head_dim, self.state_size
        x = x.view(1, self.heads, p)
        dt = dt.transpose(1, 2).expand(-1, -1, p)  # [1, H, P]
        A = A[:, None, None].expand(-1, p, s).to(dtype=torch.float32)  # [H, P, N]
        B, C = B.view(1, self.groups, s), C.view(1, self.groups, s)
        D = self.D[:, None].expand(-1, p)
        dt_bias = self.dt_bias[:, None].expand(-1, p)
        z = None if self.rms_norm else gate.view(1, self.heads, p)
        y = self._selective_update(state, x, dt, A, B, C, D, dt_bias, z).view(1, 1, self.heads * p)
        if self.rms_norm:
            y = self.norm(y, gate)
        return self.out_proj(y.to(dtype))

    def _selective_update(self, state, x, dt, A, B, C, D, dt_bias, z):
        """transformers' mamba2_selective_state_update (dt_softplus), writing `state`."""
        heads, groups, s = self.heads, self.groups, self.state_size
        dt = F.softplus(dt + dt_bias.to(dt.dtype))[..., None]  # [1, H, P, 1]
        dA = torch.exp(dt.float() * A.float())
        B = B.reshape(1, groups, 1, s).expand(1, groups, heads // groups, s).contiguous().reshape(1, heads, 1, s)
        dBx = dt * B * x[..., None]
        ssm = state * dA + dBx
        state.copy_(ssm.to(state.dtype))
        C = C.reshape(1, groups, 1, s).expand(1, groups, heads // groups, s).contiguous().reshape(1, heads, s)
        ssm = ssm.to(dtype=C.dtype)
        out = torch.bmm(ssm.view(heads, self.head_dim, s), C.view(heads, s, 1)).view(1, heads, self.head_dim)
        out = (out + x * D).to(out.dtype)
        if z is not None:
            out = out * F.silu(z)
        return out.to(x.dtype)
