"""One-token decode for FalconH1: a Mamba-2 mixer beside attention in every layer, one graph.

The llama step (memrad.engine.decode.steps.llama) with FalconH1's layer, called alike, so it
compiles and packages the same way (memrad.engine.decode.package):

    token [1] -> embed * embedding_multiplier -> x [1, 1, hidden]
      per layer:  h = norm(x)
                  m = mamba2(h) * ssm_out          (memrad.engine.decode.steps.mamba2; conv and SSM
                                                    state rewritten in place)
                  a = attention(h * attention_in) * attention_out
                      (q, k * key_multiplier, v = qkv;  rope at `position`;  write row
                       `position` of the slab, attend rows [0, position])
                  x += m + a;  x += mlp(norm(x))    (transformers' FalconH1MLP, muP multipliers)
    -> final norm -> head * lm_head_multiplier -> logits [V]

Each layer's cache (memrad.engine.state.recurrent.HybridSlabLayer) hands the step its rows
and its state as two pairs: keys[i] = (key slab, value slab), values[i] = (conv state,
SSM state).
"""

from __future__ import annotations

import itertools

import torch
from torch import nn

from memrad.engine.decode.steps.mamba2 import Mamba2Mixer
from memrad.engine.decode.steps.llama import attend, attention_shape, fuse, rope, rope_tables

_FALCON_H1 = ("FalconH1ForCausalLM",)
_STEP_IDS = itertools.count()


def is_falcon_h1(model: nn.Module) -> bool:
    return type(model).__name__ in _FALCON_H1


def support(model: nn.Module, context_len: int) -> str | None:
    """None if the FalconH1 step computes `model`'s decode, else why not."""
    name = type(model).__name__
    rope_type = getattr(model.model.rotary_emb, "rope_type", "default")
    if rope_type not in ("default", "linear", "llama3", "yarn"):
        return f"{name} uses {rope_type} rope, whose frequencies depend on the sequence length"
    return None


class _Attention(nn.Module):
    """FalconH1Attention for one token over a slab: llama's, with the key multiplier."""

    def __init__(self, attention: nn.Module, heads: int, kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.scale, self.key_multiplier = float(attention.scaling), attention.key_multiplier
        self.qkv = fuse([attention.q_proj, attention.k_proj, attention.v_proj])
        self.split = (heads * head_dim, kv_heads * head_dim, kv_heads * head_dim)
        self.o_proj = attention.o_proj

    def forward(self, h, cos, sin, position, length, key_rows, value_rows, kernel):
        # h [1, 1, hidden]; cos, sin [1, D]; slabs [1, H_kv, capacity, D]
        d, h_kv = self.head_dim, self.kv_heads
        q, k, v = self.qkv(h).split(self.split, dim=-1)
        q = rope(q.view(self.heads, d), cos, sin)
        k = rope(k.view(h_kv, d) * self.key_multiplier, cos, sin)
        key_rows.index_copy_(2, position, k.view(1, h_kv, 1, d))
        value_rows.index_copy_(2, position, v.view(1, h_kv, 1, d))
        o = attend(q.view(1, h_kv, self.heads // h_kv, d), key_rows, value_rows, length, self.scale, kernel)
        return self.o_proj(o.reshape(1, 1, self.heads * d))


class _Layer(nn.Module):
    """One FalconH1DecoderLayer: Mamba-2 and attention side by side, then the MLP."""

    recurrent = True  # its keys/values are (rows, state) pairs (memrad.engine.decode.steps.recurrent)

    def __init__(self, layer: nn.Module, heads: int, kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.mamba = Mamba2Mixer(layer.mamba)
        self.attention = _Attention(layer.self_attn, heads, kv_heads, head_dim)
        self.input_norm, self.pre_ff_norm, self.mlp = layer.input_layernorm, layer.pre_ff_layernorm, layer.feed_forward
        self.attention_in, self.attention_out = layer.attention_in_multiplier, layer.attn_out_multiplier
        self.ssm_out = layer.ssm_out_multiplier

    def state_shapes(self, dtype: torch.dtype, capacity: int) -> list[list[tuple[tuple[int, ...], torch.dtype]]]:
        """[[key slab, value slab], [conv state, SSM state]] as (shape, dtype), as the cache
        makes them for a model of `dtype`, the SSM state in float32
        (memrad.engine.decode.package.example_buffers)."""
        m, a = self.mamba, self.attention
        slab = ((1, a.kv_heads, capacity, a.head_dim), dtype)
        return [[slab, slab], [((1, m.conv_dim, m.conv_weight.shape[-1]), dtype),
                               ((1, m.heads, m.head_dim, m.state_size), torch.float32)]]

    def forward(self, x, cos, sin, position, length, rows, state, kernel):
        h = self.input_norm(x)
        m = self.mamba(h, *state) * self.ssm_out
        a = self.attention(h * self.attention_in, cos, sin, position, length, *rows, kernel) * self.attention_out
        x = x + (m + a)
        return x + self.mlp(self.pre_ff_norm(x))


class FalconH1Step(nn.Module):
    """The step for a FalconH1 model; shares every weight with the model. Called exactly as
    memrad.engine.decode.steps.llama.DecodeStep, with keys[i] = (key slab, value slab) and
    values[i] = (conv state, SSM state) per layer (memrad.engine.state.recurrent)."""

    def __init__(self, model: nn.Module, max_positions: int) -> None:
        super().__init__()
        self.owner = f"falcon-h1-step-{next(_STEP_IDS)}"  # unique in the process, never reused
        config, body = model.config, model.model
        heads, kv_heads, head_dim = attention_shape(config)
        self.embed, self.norm, self.head = body.embed_tokens, body.final_layernorm, model.lm_head
        self.embedding_multiplier, self.lm_head_multiplier = body.embedding_multiplier, body.lm_head_multiplier
        self.layers = nn.ModuleList(_Layer(layer, heads, kv_heads, head_dim) for layer in body.layers)
        cos, sin = rope_tables(model, max_positions)
        self.register_buffer("cos", cos, persistent=False)  # [P, D]
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, token: torch.Tensor, position: torch.Tensor, rows: torch.Tensor,
                keys: list, values: list, owner: str, kernel: bool = False) -> torch.Tensor:
        """Logits [V] (model dtype) after `token` [1] at `position` [1]; writes each layer's KV
        row and state. `rows`, `owner`, `kernel`: as DecodeStep.forward."""
        assert owner == self.owner, f"{owner} called {self.owner}"
        length = rows.shape[0]
        x = self.embed(token).view(1, 1, -1) * self.embedding_multiplier  # [1, 1, hidden]
        cos, sin = self.cos.index_select(0, position), self.sin.index_select(0, position)  # [1, D]
        for layer, slabs, state in zip(self.layers, keys, values):
            x = layer(x, cos, sin, position, length, slabs, state, kernel)
        return (self.head(self.norm(x)) * self.lm_head_multiplier).view(-1)
