"""One-token decode for gpt-oss: sliding-window and full attention with sinks, routed experts.

The llama step (memrad.engine.decode.steps.llama) with gpt-oss's layers, called alike, so the
decoder and the package treat it as they treat Gemma 2's (memrad.engine.decode.steps.gemma2):

    token [1] -> embed -> x [1, 1, hidden]
      per layer:  q, k, v = qkv(norm(x))                   (one fused matmul, biases included)
                  rope(q, k) at `position` (YaRN: its attention factor is in the cos, sin table)
                  full:    write row `position` of the slab, attend rows [0, position]
                  sliding: write the last row of the window view, attend the view (<= W rows)
                  scores = q k^T * scale [1, H, 1, n];  logits = scores | sink (one per head)
                  p = softmax(logits - max) in the model's dtype, the sink's column dropped;  o = p v
                  x += o_proj(o)
                  x += the router's top k experts of post_norm(x)  (the model's own GptOssMLP)
    -> norm -> head -> logits [V]

The sinks are a learned logit per query head in the softmax's denominator only: a head can
put weight on "nothing" (its probabilities over the rows sum to less than 1). Neither torch's
fused attention nor memra's kernel has that term, so the step computes the attention as
transformers' eager_attention_forward for gpt-oss does, op for op and on the same shapes (each
query head against its KV head's rows expanded to one per query head), so the bits in the
step's dtype are the forward's. The expansion copies the attended rows once per layer and step,
as transformers' does.

The feed-forward is the model's own sparse block called on the one token (router with bias,
top k, softmax over the k logits; GptOssExperts: gate and up interleaved in `gate_up_proj`,
gate clamped above and up on both sides at `swiglu_limit`, gate * sigmoid(alpha * gate) *
(up + 1)): its bits are the forward's at one token, and only the chosen experts are read. From a
GGUF the sparse block is memra's BlockMoE (memrad.engine.model.block_experts: the same router and
experts, the chosen experts' MXFP4 blocks on memra's kernel for one token), called the same way.
Rope is gpt-oss's: the two halves of a head rotated by cos, sin tables D/2 wide.

Several requests at once (the batched step, memrad.engine.decode.batch) run `forward_rows`, as
Gemma's steps do: the projections one matmul for every row, attention and experts per row over
the row's own slab or window view; the one-row step is the same call at B = 1.
"""

from __future__ import annotations

import itertools

import torch
from torch import nn
from torch.nn import functional as F

from memrad.engine.decode.steps.gemma import GemmaStep, write_and_attended
from memrad.engine.decode.steps.gemma2 import per_query_head
from memrad.engine.decode.steps.llama import attention_shape, fuse, layers_and_rope, register_rope

_GPT_OSS = ("GptOssForCausalLM",)
_LAYER_KINDS = ("sliding_attention", "full_attention")
_STATIC_ROPE = ("default", "linear", "yarn")
_STEP_IDS = itertools.count()


def is_gpt_oss(model: nn.Module) -> bool:
    return type(model).__name__ in _GPT_OSS


def support(model: nn.Module, context_len: int) -> str | None:
    """None if the gpt-oss step computes `model`'s decode, else why not."""
    return layers_and_rope(model, _LAYER_KINDS, _STATIC_ROPE)


def rope_halves(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate heads x [.., H, D] by cos, sin [.., 1, D/2] as gpt-oss does (first and second halves)."""
    first, second = torch.chunk(x, 2, dim=-1)
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)


def sink_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, sinks: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """Attention of one token's queries q [1, H, 1, D] over keys, values [1, H_kv, n, D] (every
    row attended) with a sink logit per head, sinks [H], as transformers' eager attention for
    gpt-oss computes it: [1, H, 1, D]."""
    keys, values = per_query_head(keys, q.shape[1]), per_query_head(values, q.shape[1])
    scores = torch.matmul(q, keys.transpose(2, 3)) * scale  # [1, H, 1, n]
    logits = torch.cat([scores, sinks.reshape(1, -1, 1, 1)], dim=-1)  # [1, H, 1, n + 1]
    logits = logits - logits.max(dim=-1, keepdim=True).values
    weights = F.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1].to(values.dtype)  # the sink dropped
    return torch.matmul(weights, values)  # [1, H, 1, D]


class _GptOssLayer(nn.Module):
    """One GptOssDecoderLayer's decode-step view; `window` is W for a sliding layer."""

    def __init__(self, layer: nn.Module, heads: int, kv_heads: int, head_dim: int, window: int | None) -> None:
        super().__init__()
        attention = layer.self_attn
        self.heads, self.kv_heads, self.head_dim, self.window = heads, kv_heads, head_dim, window
        self.scale = float(attention.scaling)
        self.input_norm, self.post_norm = layer.input_layernorm, layer.post_attention_layernorm
        self.qkv = fuse([attention.q_proj, attention.k_proj, attention.v_proj])
        self.o_proj, self.sinks, self.mlp = attention.o_proj, attention.sinks, layer.mlp
        self.split = (heads * head_dim, kv_heads * head_dim, kv_heads * head_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                lengths: list, keys: list[torch.Tensor], values: list[torch.Tensor], kernel: bool) -> torch.Tensor:
        """x [B, 1, hidden] after the layer, row r's KV written into keys[r], values[r] (its slab
        or window view) at positions[r]: the projections one matmul for every row, attention and
        the experts row by row. cos, sin [B, 1, D/2]. `kernel`: unused (no kernel has the
        sinks), accepted so the decoder calls every step alike."""
        batch, d, h_kv, heads = x.shape[0], self.head_dim, self.kv_heads, self.heads
        q, k, v = self.qkv(self.input_norm(x)).split(self.split, dim=-1)  # [B, 1, *]
        q = rope_halves(q.view(batch, heads, d), cos, sin)  # [B, H, D]
        k = rope_halves(k.view(batch, h_kv, d), cos, sin)  # [B, H_kv, D]
        v = v.view(batch, h_kv, d)
        out = []
        for r in range(batch):
            key_rows, value_rows = write_and_attended(positions[r : r + 1], k[r].view(1, h_kv, 1, d),
                                                      v[r].view(1, h_kv, 1, d), keys[r], values[r], lengths[r],
                                                      self.window)
            out.append(sink_attention(q[r].view(1, heads, 1, d), key_rows, value_rows, self.sinks, self.scale))
        x = x + self.o_proj(torch.cat(out).reshape(batch, 1, heads * d))
        h = self.post_norm(x)
        # GptOssMLP returns (out [1, 1, hidden], router scores): each row routed on its own, as Qwen3-MoE's.
        return x + torch.cat([self.mlp(h[r : r + 1])[0] for r in range(batch)])


class GptOssStep(nn.Module):
    """The step for a gpt-oss model `support` accepts; shares every weight with the model.
    Called exactly as memrad.engine.decode.steps.llama.DecodeStep; `keys`, `values` hold a
    window view for each sliding layer. Its batched twin is `forward_rows`, as Gemma's."""

    def __init__(self, model: nn.Module, max_positions: int) -> None:
        super().__init__()
        self.owner = f"gpt-oss-step-{next(_STEP_IDS)}"  # unique in the process, never reused
        config, body = model.config, model.model
        heads, kv_heads, head_dim = attention_shape(config)
        self.embed, self.norm, self.head = body.embed_tokens, body.norm, model.lm_head
        self.layers = nn.ModuleList(
            _GptOssLayer(layer, heads, kv_heads, head_dim, config.sliding_window if kind == "sliding_attention" else None)
            for layer, kind in zip(body.layers, config.layer_types))
        register_rope(self, model, max_positions)  # cos, sin [P, D/2]

    # Logits [V] after `token` at `position`, every layer's KV row written: forward_rows at B = 1.
    forward = GemmaStep.forward

    def forward_rows(self, tokens: torch.Tensor, positions: torch.Tensor, lengths: list, keys: list[list[torch.Tensor]],
                     values: list[list[torch.Tensor]], kernel: bool) -> torch.Tensor:
        """Logits [B, V] (model dtype) after tokens [B] at positions [B]: row r attends lengths[r]
        rows of its own keys[r][layer], values[r][layer] (a slab, or a window view) and writes
        its KV rows there."""
        batch = tokens.shape[0]
        x = self.embed(tokens).view(batch, 1, -1)  # [B, 1, hidden]
        cos, sin = self.cos.index_select(0, positions)[:, None], self.sin.index_select(0, positions)[:, None]
        for index, layer in enumerate(self.layers):
            x = layer(x, cos, sin, positions, lengths, [k[index] for k in keys], [v[index] for v in values], kernel)
        return self.head(self.norm(x)).view(batch, -1)
