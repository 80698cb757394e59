"""One-token decode for Gemma 4 (text: Gemma4ForCausalLM), written as one function over the KV slabs and windows.

Gemma 3's step (memrad.engine.decode.steps.gemma) with what Gemma 4 adds:

    token [1] -> embed (scaled by sqrt(hidden)) -> x [1, 1, hidden]
              -> per-layer inputs p [1, 1, L, P]: the token's row of a second embedding (scaled by
                 sqrt(P)) plus a projection of x (scaled by hidden^-1/2, RMS-normed), times 2^-1/2
      per layer:  h = norm(x);  q, k, v = qkv(h)       (one fused matmul; K = V: q, k, and v = k)
                  q, k = q_norm(q), k_norm(k);  v = v_norm(v)  (RMS over the head, no weight)
                  rope(q, k) at `position` with the kind's inverse frequencies (global: the first
                  quarter of the angles turn, "proportional"; the rest have frequency 0)
                  global:  write row `position` of the slab, attend rows [0, position]
                  sliding: write the last row of the window view, attend the view (<= W rows)
                  KV-shared layer: q only; attend its producer's rows, written this step
                  x += post_attn_norm(o_proj(o))            (scale 1: the q/k norms carry it)
                  x += post_ff_norm(down(gelu_tanh(gate) * up)) of gate_up(pre_ff_norm(x))
                  (MoE: x += post_ff_norm(post_ff_norm_1(that MLP) + post_ff_norm_2(the router's top k
                  experts of pre_ff_norm_2(x))), the router reading x itself)
                  x += post_per_layer_norm(proj(gelu_tanh(gate_p(x)) * p[layer]))
                  x *= layer_scalar
    -> norm -> head -> final soft-cap (where configured) -> logits [V]

The two kinds have their own head dims (global layers: `global_head_dim`) and may have their own
KV head counts (`num_global_key_value_heads`); each layer's slab or window is shaped as its own.
A KV-shared layer (the last `num_kv_shared_layers`) has no k/v projections: transformers hands it
the keys and values the last earlier layer of its kind returned from its cache (`kv_sharing_modes`:
"store"), and its cache layer holds nothing (memrad.engine.state.shared.SharedLayer). The step hands
it the producer's slab or window view, which the producer wrote earlier in the same step.

Every norm is transformers' own module (Gemma 4's RMSNorm multiplies by its weight, no +1), called
as it is; the attention, the window views, the final soft-cap and `forward_rows` (the batched
step's rows, memrad.engine.decode.batch) are Gemma 3's. Not covered: bidirectional attention
(`support` says so).

A mixture-of-experts Gemma 4 (`enable_moe_block`, 26B-A4B) keeps the dense MLP in every layer as a
shared expert and adds a router and experts beside it (on the decoder layer, not in `mlp`):

    router(x):  RMS-norm without weight, * scale * hidden^-1/2 -> proj -> softmax (float32) -> top k
                -> renormalised -> * per_expert_scale[ids]                     ids, weights [1, k]
    experts(pre_ff_norm_2(x), ids, weights): gate_up [E, 2I, H] and down [E, H, I], the chosen only

The step calls the model's own router and experts on one row at a time, as Qwen3-MoE's sparse block
(memrad.engine.decode.steps.experts.feed_forward says why): the ids and weights are the forward's,
only the k chosen experts are read, and a row's bits never depend on its neighbours' routing.
"""

from __future__ import annotations

import itertools

import torch
from torch import nn

from memrad.engine.decode.steps import experts
from memrad.engine.decode.steps.gemma import GemmaStep, _GemmaLayer, capped_rows, kinds_and_ropes, register_kind_ropes
from memrad.engine.decode.steps.llama import fuse, rope

_GEMMA4 = ("Gemma4ForCausalLM",)
# "proportional": fixed inverse frequencies, the unrotated angles' at 0
_STATIC_ROPE = ("default", "linear", "proportional")
_STEP_IDS = itertools.count()


def is_gemma4(model: nn.Module) -> bool:
    return type(model).__name__ in _GEMMA4


def support(model: nn.Module, context_len: int) -> str | None:
    """None if the Gemma 4 step computes `model`'s decode, else why not."""
    name, config = type(model).__name__, model.config
    if getattr(config, "use_bidirectional_attention", None) == "all":
        return f"{name} attends bidirectionally"
    if "reuse" in config.kv_sharing_modes[:1]:  # every layer shared: another model's KV is handed in
        return f"{name} reads every layer's keys and values from another model (num_kv_shared_layers = all)"
    return kinds_and_ropes(model, _STATIC_ROPE)


def producers(config) -> list[int]:
    """The layer whose keys and values each layer attends: its own, or for a KV-shared layer the
    last earlier layer of its kind that keeps its rows (transformers' `kv_sharing_modes`)."""
    out, last = [], {}
    for index, (kind, mode) in enumerate(zip(config.layer_types, config.kv_sharing_modes)):
        if mode != "reuse":
            last[kind] = index
        out.append(last[kind] if mode == "reuse" else index)
    return out


class _Gemma4Layer(_GemmaLayer):
    """One Gemma4TextDecoderLayer's decode-step view: Gemma 3's layer with a v norm, K = V on
    global layers where configured, no k/v projections where KV-shared (`shared`), the per-layer
    input's residual and the layer scalar, and where the model has them its router and experts
    beside the MLP (`moe`). Its head dim and KV heads are its kind's."""

    def __init__(self, layer: nn.Module, heads: int, window: int | None) -> None:
        nn.Module.__init__(self)  # not _Layer's: the projections differ (K = V, shared layers)
        attention, mlp = layer.self_attn, layer.mlp
        self.window, self.shared = window, attention.is_kv_shared_layer
        self.heads, self.head_dim = heads, attention.head_dim
        self.kv_heads = heads // attention.num_key_value_groups
        self.scale = float(attention.scaling)
        self.input_norm, self.post_norm = layer.input_layernorm, layer.post_attention_layernorm
        self.pre_ff_norm, self.post_ff_norm = layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm
        self.q_norm, self.o_proj = attention.q_norm, attention.o_proj
        self.keys_are_values = not self.shared and attention.v_proj is None
        kv = self.kv_heads * self.head_dim
        if self.shared:
            self.qkv, self.split = attention.q_proj, (heads * self.head_dim,)
        else:
            self.k_norm, self.v_norm = attention.k_norm, attention.v_norm
            projections = [attention.q_proj, attention.k_proj, *(() if self.keys_are_values else (attention.v_proj,))]
            self.qkv, self.split = fuse(projections), (heads * self.head_dim, *(kv,) * (len(projections) - 1))
        self.gate_up, self.down_proj, self.act = fuse([mlp.gate_proj, mlp.up_proj]), mlp.down_proj, mlp.act_fn
        self.moe = layer.enable_moe_block
        if self.moe:
            self.router, self.experts = layer.router, layer.experts
            self.post_ff_norm_1 = layer.post_feedforward_layernorm_1
            self.post_ff_norm_2 = layer.post_feedforward_layernorm_2
            self.pre_ff_norm_2 = layer.pre_feedforward_layernorm_2
        self.per_layer = getattr(layer, "per_layer_input_gate", None) is not None
        if self.per_layer:
            self.per_layer_gate, self.per_layer_projection = layer.per_layer_input_gate, layer.per_layer_projection
            self.per_layer_norm, self.per_layer_act = layer.post_per_layer_input_norm, layer.act_fn
        self.register_buffer("layer_scalar", layer.layer_scalar, persistent=False)

    def forward(self, x: torch.Tensor, per_layer_input: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                positions: torch.Tensor, lengths: list, keys: list[torch.Tensor], values: list[torch.Tensor],
                kernel: bool) -> torch.Tensor:
        """x [B, 1, hidden] after the layer, as _GemmaLayer.forward; keys[r], values[r]: row r's
        rows this layer attends (its own, or its producer's: `shared`); per_layer_input [B, 1, P]."""
        batch, d, h_kv = x.shape[0], self.head_dim, self.kv_heads
        parts = self.qkv(self.input_norm(x)).split(self.split, dim=-1)  # [B, 1, *]
        q = rope(self.q_norm(parts[0].view(batch, self.heads, d)), cos, sin)  # [B, H, D]
        k = v = [None] * batch
        if not self.shared:
            raw = parts[1].view(batch, h_kv, d)
            k = rope(self.k_norm(raw), cos, sin).view(batch, 1, h_kv, 1, d)  # [B][1, H_kv, 1, D]
            v = self.v_norm(raw if self.keys_are_values else parts[2].view(batch, h_kv, d)).view(batch, 1, h_kv, 1, d)
        out = [self.attend_row(q[r], k[r], v[r], positions[r : r + 1], lengths[r], keys[r], values[r], kernel)
               for r in range(batch)]
        o = out[0] if batch == 1 else torch.cat(out)  # [B, H_kv, G, D]
        x = x + self.post_norm(self.o_proj(o.reshape(batch, 1, self.heads * d)))
        gate, up = self.gate_up(self.pre_ff_norm(x)).chunk(2, dim=-1)
        ff = self.down_proj(self.act(gate) * up)  # [B, 1, hidden]
        if self.moe:
            ff = self.post_ff_norm_1(ff) + self.post_ff_norm_2(experts.feed_forward(self.routed, x))
        x = x + self.post_ff_norm(ff)
        if self.per_layer:
            gated = self.per_layer_act(self.per_layer_gate(x)) * per_layer_input
            x = x + self.per_layer_norm(self.per_layer_projection(gated))
        return x * self.layer_scalar

    def routed(self, x: torch.Tensor) -> torch.Tensor:
        """The experts' output for one row x [1, 1, hidden] (the attention's residual), as
        Gemma4TextDecoderLayer computes it on a flat [tokens, hidden]: [1, 1, hidden]."""
        flat = x.reshape(-1, x.shape[-1])  # [1, hidden]
        _, weights, ids = self.router(flat)  # [1, k] each
        return self.experts(self.pre_ff_norm_2(flat), ids, weights).reshape(x.shape)

    def write_row(self, position: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                  key_rows: torch.Tensor, value_rows: torch.Tensor) -> None:
        """Gemma 3's, except a KV-shared layer writes nothing: its producer has written the row."""
        if not self.shared:
            super().write_row(position, k, v, key_rows, value_rows)


class Gemma4Step(nn.Module):
    """The step for a Gemma 4 text model `support` accepts; shares every weight with the model.
    Called exactly as memrad.engine.decode.steps.llama.DecodeStep; `keys`, `values` hold a window
    view for each sliding layer and an empty pair for each KV-shared one. Its batched twin is
    `forward_rows`, as Gemma 3's."""

    def __init__(self, model: nn.Module, max_positions: int) -> None:
        super().__init__()
        self.owner = f"gemma4-step-{next(_STEP_IDS)}"  # unique in the process, never reused
        config, body = model.config, model.model
        self.embed, self.norm, self.head = body.embed_tokens, body.norm, model.lm_head
        self.final_softcap = config.final_logit_softcapping
        kinds = list(config.layer_types)
        self.layers = nn.ModuleList(
            _Gemma4Layer(layer, config.num_attention_heads,
                         config.sliding_window if kind == "sliding_attention" else None)
            for layer, kind in zip(body.layers, kinds))
        self.producers = producers(config)
        dims = {kind: layer.head_dim for kind, layer in zip(kinds, self.layers)}  # config.head_dim: per layer
        register_kind_ropes(self, model, kinds, *(dims.get(kind, max(dims.values()))
                                                  for kind in ("sliding_attention", "full_attention")))
        self.per_layer_dim = config.hidden_size_per_layer_input or 0
        if self.per_layer_dim:
            self.per_layer_embed = body.embed_tokens_per_layer
            self.per_layer_model_projection, self.per_layer_projection_norm = (
                body.per_layer_model_projection, body.per_layer_projection_norm)
            self.per_layer_projection_scale = body.per_layer_model_projection_scale
            self.per_layer_input_scale = body.per_layer_input_scale

    # Gemma 3's: each layer's rope cos, sin [B, 1, D] at positions [B], its kind's D and base.
    _angles = GemmaStep._angles
    angles = GemmaStep.angles
    forward = GemmaStep.forward  # logits [V] after one token: `forward_rows` at B = 1

    def per_layer_inputs(self, tokens: torch.Tensor, x: torch.Tensor) -> torch.Tensor | None:
        """[B, 1, L, P]: what transformers' Gemma4TextModel computes (get_per_layer_inputs, then
        project_per_layer_inputs) for tokens [B] embedded as x [B, 1, hidden]; None without them."""
        if not self.per_layer_dim:
            return None
        shape = (tokens.shape[0], 1, len(self.layers), self.per_layer_dim)
        own = self.per_layer_embed(tokens.view(-1, 1)).reshape(shape)
        projected = self.per_layer_model_projection(x) * self.per_layer_projection_scale
        projected = self.per_layer_projection_norm(projected.reshape(shape))
        return (projected + own) * self.per_layer_input_scale

    def forward_rows(self, tokens: torch.Tensor, positions: torch.Tensor, lengths: list, keys: list[list[torch.Tensor]],
                     values: list[list[torch.Tensor]], kernel: bool) -> torch.Tensor:
        """Logits [B, V] (model dtype) after tokens [B] at positions [B], as GemmaStep.forward_rows;
        a KV-shared layer attends keys[r][its producer], values[r][its producer]."""
        batch = tokens.shape[0]
        x = self.embed(tokens).view(batch, 1, -1)  # [B, 1, hidden]
        per_layer = self.per_layer_inputs(tokens, x)
        for index, (layer, (cos, sin)) in enumerate(zip(self.layers, self.angles(positions))):
            source = self.producers[index]
            x = layer(x, None if per_layer is None else per_layer[:, :, index], cos, sin, positions, lengths,
                      [k[source] for k in keys], [v[source] for v in values], kernel)
        return capped_rows(self.head(self.norm(x)).view(batch, -1), self.final_softcap)  # [B, V]
