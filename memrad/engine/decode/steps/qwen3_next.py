"""One-token decode for Qwen3-Next: gated delta nets beside gated full attention, one graph.

The llama step (memrad.engine.decode.steps.llama) with Qwen3-Next's layers, called alike, so it
compiles and packages the same way (memrad.engine.decode.package):

    token [1] -> embed -> x [1, 1, hidden]
      per layer:  h = norm(x)                        (Qwen3-Next's RMSNorm: (1 + w), float32)
        linear:   x += gated delta net(h), its conv and recurrent state rewritten in place
                  (memrad.engine.decode.steps.gated_delta; keys[i], values[i] are those states)
        full:     q|gate, k, v = qkv(h);  q, k = q_norm(q), k_norm(k);  rope on the first
                  rotary dims at `position`;  write row `position` of the slab, attend rows
                  [0, position];  x += o_proj(o * sigmoid(gate))
      x += moe(norm(x)): top-k experts of the router's softmax (renormalised where configured)
           plus the shared expert scaled by sigmoid(shared gate); or the dense MLP
    -> norm -> head -> logits [V]

The experts' weights are views of transformers' fused [E, 2I, H] / [E, H, I] tensors: each
chosen expert is selected by index (no copy of its weights), k static matmuls per token.
"""

from __future__ import annotations

import itertools

import torch
from torch import nn
from torch.nn import functional as F

from memrad.engine.decode.steps.gated_delta import GatedDeltaMixer
from memrad.engine.decode.steps.llama import attend, attention_shape, fuse, rope, rope_tables

_QWEN3_NEXT = ("Qwen3NextForCausalLM",)
_LAYER_KINDS = ("linear_attention", "full_attention")
_STEP_IDS = itertools.count()


def is_qwen3_next(model: nn.Module) -> bool:
    return type(model).__name__ in _QWEN3_NEXT


def support(model: nn.Module, context_len: int) -> str | None:
    """None if the Qwen3-Next step computes `model`'s decode, else why not."""
    name = type(model).__name__
    config = model.config
    kinds = set(config.layer_types)
    if not kinds <= set(_LAYER_KINDS):
        return f"{name} has layers of kinds {sorted(kinds - set(_LAYER_KINDS))}"
    rope_type = model.model.rotary_emb.rope_type
    if rope_type not in ("default", "linear", "yarn"):
        return f"{name} uses {rope_type} rope, whose frequencies depend on the sequence length"
    if config.hidden_act != "silu":
        return f"{name}'s linear attention uses {config.hidden_act}, the step covers silu"
    return None


class _Moe(nn.Module):
    """Qwen3NextSparseMoeBlock for one token, as transformers computes it: router softmax in
    float32, top-k, the experts' outputs weighted and summed in top-k order, shared expert."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.router, self.experts = block.gate.weight, block.experts  # router [E, H]
        self.top_k, self.norm_topk = block.gate.top_k, block.gate.norm_topk_prob
        self.shared, self.shared_gate = block.shared_expert, block.shared_expert_gate
        self.num_experts = block.experts.num_experts

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        # h [1, 1, H]
        h = h.view(1, -1)  # [1, H]
        shared = self.shared(h)
        logits = F.linear(h, self.router)  # [1, E]
        probs = torch.softmax(logits, dtype=torch.float, dim=-1)
        top, chosen = torch.topk(probs, self.top_k, dim=-1)  # [1, k]
        if self.norm_topk:
            top = top / top.sum(dim=-1, keepdim=True)
        top = top.to(logits.dtype)
        experts = self.experts
        outs = []
        for j in range(self.top_k):
            e = chosen[0, j].item()
            torch._check(e >= 0)  # so export may index with it (a data-dependent size)
            torch._check(e < self.num_experts)
            gate, up = F.linear(h, experts.gate_up_proj.select(0, e)).chunk(2, dim=-1)  # [1, I] each
            out = F.linear(experts.act_fn(gate) * up, experts.down_proj.select(0, e))  # [1, H]
            outs.append(out * top[:, j : j + 1])
        routed = torch.stack(outs, dim=1).sum(dim=1).to(h.dtype)  # [1, H]
        return (routed + torch.sigmoid(self.shared_gate(h)) * shared).view(1, 1, -1)


class _Attention(nn.Module):
    """Qwen3NextAttention for one token over a slab: output gate, q/k norms, partial rope."""

    def __init__(self, attention: nn.Module, heads: int, kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.scale = float(attention.scaling)
        self.qkv = fuse([attention.q_proj, attention.k_proj, attention.v_proj])
        self.split = (2 * heads * head_dim, kv_heads * head_dim, kv_heads * head_dim)
        self.q_norm, self.k_norm, self.o_proj = attention.q_norm, attention.k_norm, attention.o_proj

    def forward(self, h, cos, sin, position, length, key_rows, value_rows, kernel):
        # h [1, 1, hidden]; cos, sin [1, R] (R rotary dims <= D); slabs [1, H_kv, capacity, D]
        d, h_kv, r = self.head_dim, self.kv_heads, cos.shape[-1]
        qg, k, v = self.qkv(h).split(self.split, dim=-1)
        q, gate = qg.view(self.heads, 2 * d).chunk(2, dim=-1)  # [H, D] each
        q, k = self.q_norm(q), self.k_norm(k.view(h_kv, d))
        q = torch.cat((rope(q[:, :r], cos, sin), q[:, r:]), dim=-1)
        k = torch.cat((rope(k[:, :r], cos, sin), k[:, r:]), dim=-1)
        key_rows.index_copy_(2, position, k.view(1, h_kv, 1, d))
        value_rows.index_copy_(2, position, v.view(1, h_kv, 1, d))
        o = attend(q.reshape(1, h_kv, self.heads // h_kv, d), key_rows, value_rows, length, self.scale, kernel)
        return self.o_proj(o.reshape(1, 1, -1) * torch.sigmoid(gate.reshape(1, 1, -1)))


class _Layer(nn.Module):
    """One Qwen3NextDecoderLayer; `recurrent` says its keys/values are conv/recurrent state."""

    def __init__(self, layer: nn.Module, heads: int, kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.recurrent = layer.block_type == "linear_attention"
        self.mixer = GatedDeltaMixer(layer.linear_attn) if self.recurrent else _Attention(
            layer.self_attn, heads, kv_heads, head_dim)
        self.input_norm, self.post_norm = layer.input_layernorm, layer.post_attention_layernorm
        self.mlp = _Moe(layer.mlp) if hasattr(layer.mlp, "experts") else layer.mlp

    def state_shapes(self, dtype: torch.dtype, capacity: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """(shape, dtype) of the conv and recurrent state a recurrent layer is handed, for a
        model of `dtype`: as transformers' cache makes them (the recurrent state in float32;
        memrad.engine.decode.package.example_buffers)."""
        net = self.mixer
        conv = (1, 2 * net.key_dim + net.value_dim, self.mixer.conv_weight.shape[-1])
        return [(conv, dtype), ((1, net.v_heads, net.k_dim, net.v_dim), torch.float32)]

    def forward(self, x, cos, sin, position, length, keys, values, kernel):
        h = self.input_norm(x)
        if self.recurrent:
            x = x + self.mixer(h, keys, values)
        else:
            x = x + self.mixer(h, cos, sin, position, length, keys, values, kernel)
        return x + self.mlp(self.post_norm(x))


class Qwen3NextStep(nn.Module):
    """The step for a Qwen3-Next model `support` accepts; shares every weight with the model.
    Called exactly as memrad.engine.decode.steps.llama.DecodeStep; for a linear-attention layer
    `keys[i]`, `values[i]` are its conv state [1, C, K] and recurrent state [1, H_v, D_k, D_v]
    (memrad.engine.state.recurrent), rewritten in place."""

    def __init__(self, model: nn.Module, max_positions: int) -> None:
        super().__init__()
        self.owner = f"qwen3-next-step-{next(_STEP_IDS)}"  # unique in the process, never reused
        config, body = model.config, model.model
        heads, kv_heads, head_dim = attention_shape(config)
        self.embed, self.norm, self.head = body.embed_tokens, body.norm, model.lm_head
        self.layers = nn.ModuleList(_Layer(layer, heads, kv_heads, head_dim) for layer in body.layers)
        cos, sin = rope_tables(model, max_positions)
        self.register_buffer("cos", cos, persistent=False)  # [P, R]
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, token: torch.Tensor, position: torch.Tensor, rows: torch.Tensor,
                keys: list[torch.Tensor], values: list[torch.Tensor], owner: str, kernel: bool = False) -> torch.Tensor:
        """Logits [V] (model dtype) after `token` [1] at `position` [1]; writes its KV rows and
        the recurrent layers' state. `rows`, `owner`, `kernel`: as DecodeStep.forward."""
        assert owner == self.owner, f"{owner} called {self.owner}"
        length = rows.shape[0]
        x = self.embed(token).view(1, 1, -1)  # [1, 1, hidden]
        cos, sin = self.cos.index_select(0, position), self.sin.index_select(0, position)  # [1, R]
        for layer, key_rows, value_rows in zip(self.layers, keys, values):
            x = layer(x, cos, sin, position, length, key_rows, value_rows, kernel)
        return self.head(self.norm(x)).view(-1)
