"""One-token decode for LFM2: gated short convolutions beside full attention, one graph.

The llama step (memrad.engine.decode.steps.llama) with LFM2's layers, called alike, so it
compiles and packages the same way (memrad.engine.decode.package):

    token [1] -> embed -> x [1, 1, hidden]
      per layer:  h = operator_norm(x)
        conv:     B | C | x' = in_proj(h);  Bx = B * x'         [1, hidden, 1]
                  conv state [1, hidden, L]:  window = cat(state, Bx)  [1, hidden, L + 1]
                                              state <- window[..., 1:]      (in place)
                  x += out_proj(C * depthwise conv1d(window)[..., -1])
        full:     q, k, v = qkv(h);  q, k = q_layernorm(q), k_layernorm(k) per head;  rope at
                  `position`;  write row `position` of the slab, attend rows [0, position];
                  x += out_proj(o)
      x += w2(silu(w1(h')) * w3(h')),  h' = ffn_norm(x)     (w1 | w3 one fused matmul)
    -> embedding_norm -> head -> logits [V]

The conv layers' cache is a RecurrentLayer (memrad.engine.state.recurrent) holding conv state
only: it hands the step (conv state, an empty tensor) as keys[i], values[i], and the step
rewrites the conv state in place, so snapshots and the disk tier find it where transformers
keeps it. The convolution is transformers' causal_conv1d_update, op for op: its bits are the
forward's.
"""

from __future__ import annotations

import itertools

import torch
from torch import nn
from torch.nn import functional as F

from memrad.engine.decode.steps.llama import DecodeStep, _Layer, attention_shape, fuse, layers_and_rope, register_rope

_LFM2 = ("Lfm2ForCausalLM",)
_LAYER_KINDS = ("conv", "full_attention")
_STATIC_ROPE = ("default", "linear", "llama3", "yarn")
_STEP_IDS = itertools.count()


def is_lfm2(model: nn.Module) -> bool:
    return type(model).__name__ in _LFM2


def support(model: nn.Module, context_len: int) -> str | None:
    """None if the LFM2 step computes `model`'s decode, else why not."""
    return layers_and_rope(model, _LAYER_KINDS, _STATIC_ROPE)


class _ShortConv(nn.Module):
    """Lfm2ShortConv for one cached token per row: the gated depthwise convolution, each row's
    state rewritten in place."""

    def __init__(self, conv: nn.Module) -> None:
        super().__init__()
        self.in_proj, self.out_proj = conv.in_proj, conv.out_proj
        self.weight, self.bias = conv.conv.weight, conv.conv.bias  # [hidden, 1, L]
        self.hidden, self.kernel_size = conv.conv.in_channels, conv.conv_kernel_size

    def forward(self, h: torch.Tensor, conv_states: list[torch.Tensor]) -> torch.Tensor:
        # h [B, 1, hidden] (normed); conv_states[r]: row r's state [1, hidden, L] (model dtype)
        projected = self.in_proj(h)  # [B, 1, 3 hidden]: one matmul for every row
        out = []
        for r, conv_state in enumerate(conv_states):  # per row, as transformers' causal_conv1d_update
            b, c, x = projected[r : r + 1].transpose(-1, -2).chunk(3, dim=-2)  # [1, hidden, 1] each
            bx = b * x
            window = torch.cat([conv_state, bx], dim=-1).to(self.weight.dtype)  # [1, hidden, L + 1]
            conv_state.copy_(window[:, :, -conv_state.shape[-1]:])
            mixed = F.conv1d(window, self.weight, self.bias, padding=0, groups=self.hidden)[:, :, -1:]
            out.append(c * mixed.to(bx.dtype))  # [1, hidden, 1]
        return self.out_proj(torch.cat(out).transpose(-1, -2).contiguous())  # [B, 1, hidden]


class _Lfm2Layer(_Layer):
    """The llama step's layer (memrad.engine.decode.steps.llama) over LFM2's norms and gated MLP
    (w1 | w3 fused, w2): its feed-forward as llama's, so the batched step runs it as it runs
    llama's (memrad.engine.decode.batch)."""

    def __init__(self, layer: nn.Module) -> None:
        nn.Module.__init__(self)
        mlp = layer.feed_forward
        self.input_norm, self.post_norm = layer.operator_norm, layer.ffn_norm
        self.sparse, self.gate_up, self.down_proj, self.act = None, fuse([mlp.w1, mlp.w3]), mlp.w2, nn.SiLU()


class _AttentionLayer(_Lfm2Layer):
    """An LFM2 attention layer: llama's, with per-head q/k RMSNorms (Qwen3's) under other names."""

    recurrent = False

    def __init__(self, layer: nn.Module, heads: int, kv_heads: int, head_dim: int) -> None:
        super().__init__(layer)
        attention = layer.self_attn
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.scale = float(attention.scaling)
        self.qkv = fuse([attention.q_proj, attention.k_proj, attention.v_proj])
        self.q_norm, self.k_norm, self.o_proj = attention.q_layernorm, attention.k_layernorm, attention.out_proj
        self.split = (heads * head_dim, kv_heads * head_dim, kv_heads * head_dim)


class _ConvLayer(_Lfm2Layer):
    """An LFM2 conv layer: the short convolution where llama's has attention; its keys are its
    conv state, its values an empty tensor."""

    recurrent = True

    def __init__(self, layer: nn.Module) -> None:
        super().__init__(layer)
        self.mixer = _ShortConv(layer.conv)

    def state_shapes(self, dtype: torch.dtype, capacity: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """(shape, dtype) of what it is handed, for a model of `dtype`: its conv state and the
        empty tensor in the recurrent state's place (memrad.engine.decode.package.example_buffers)."""
        return [((1, self.mixer.hidden, self.mixer.kernel_size), dtype), ((0,), dtype)]

    def forward(self, x, cos, sin, position, length, conv_state, nothing, kernel):
        # x [1, 1, hidden]: one row of `rows`
        return self.rows(x, [conv_state])

    def rows(self, x: torch.Tensor, conv_states: list[torch.Tensor]) -> torch.Tensor:
        """x [B, 1, hidden] after the layer, row r's conv state conv_states[r] rewritten: the
        one-row step's call at B = 1 and the batched step's (memrad.engine.decode.batch)."""
        x = x + self.mixer(self.input_norm(x), conv_states)
        return x + self.feed_forward(self.post_norm(x))


class Lfm2Step(nn.Module):
    """The step for an LFM2 model `support` accepts; shares every weight with the model.
    Called exactly as memrad.engine.decode.steps.llama.DecodeStep; for a conv layer `keys[i]`
    is its conv state [1, hidden, L], rewritten in place, and `values[i]` an empty tensor
    (memrad.engine.state.recurrent.RecurrentLayer.step_buffers)."""

    def __init__(self, model: nn.Module, max_positions: int) -> None:
        super().__init__()
        self.owner = f"lfm2-step-{next(_STEP_IDS)}"  # unique in the process, never reused
        config, body = model.config, model.model
        heads, kv_heads, head_dim = attention_shape(config)
        self.embed, self.norm, self.head = body.embed_tokens, body.embedding_norm, model.lm_head
        self.layers = nn.ModuleList(_AttentionLayer(layer, heads, kv_heads, head_dim) if layer.is_attention_layer
                                    else _ConvLayer(layer) for layer in body.layers)
        register_rope(self, model, max_positions)  # cos, sin [P, D]

    # Logits [V] after `token` at `position`, every layer's KV row and conv state written: the
    # llama step's forward over these layers (the same embed, norm, head and `through_layers`).
    forward = DecodeStep.forward
