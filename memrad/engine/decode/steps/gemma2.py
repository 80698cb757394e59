"""One-token decode for Gemma 2, written as one function over the KV slabs and windows.

Gemma 3's step (memrad.engine.decode.steps.gemma) without the q/k norms and with one rope for
every layer, plus what Gemma 2 has and Gemma 3 does not: soft-capped attention logits.

    token [1] -> embed (scaled by sqrt(hidden), inside transformers' embedding) -> x [1, 1, hidden]
      per layer:  q, k, v = qkv(norm(x));  rope(q, k) at `position`
                  global:  write row `position` of the slab, attend rows [0, position]
                  sliding: write the last row of the window view, attend the view (<= W rows)
                  scores = tanh(q k^T * scale / cap) * cap;  softmax in float32;  o = p v
                  x += post_attn_norm(o_proj(o))
                  x += post_ff_norm(down(gelu_tanh(gate) * up)) of gate_up(pre_ff_norm(x))
    -> norm -> head -> final soft-cap -> logits [V]

Soft-capping sits between the scores and the softmax, so neither torch's fused attention nor
memra's kernel computes it (transformers runs Gemma 2 on its eager attention for the same
reason): the step computes the scores as transformers' eager attention does, each query head
against its KV head's rows expanded to one per query head ([1, H, 1, D] x [1, H, D, n]), the same
shapes, so the same bits in the step's dtype. The expansion copies the attended rows once per
layer and step, as transformers' does; the step saves what the forward spends around it.
"""

from __future__ import annotations

import itertools

import torch
from torch import nn

from memrad.engine.decode.steps.gemma import GemmaStep, _GemmaLayer, soft_cap, write_and_attended
from memrad.engine.decode.steps.llama import layers_and_rope, register_rope

_GEMMA2 = ("Gemma2ForCausalLM",)
_LAYER_KINDS = ("sliding_attention", "full_attention")
_STATIC_ROPE = ("default", "linear", "yarn")
_STEP_IDS = itertools.count()


def is_gemma2(model: nn.Module) -> bool:
    return type(model).__name__ in _GEMMA2


def support(model: nn.Module, context_len: int) -> str | None:
    """None if the Gemma 2 step computes `model`'s decode, else why not."""
    return layers_and_rope(model, _LAYER_KINDS, _STATIC_ROPE)


def capped_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                     softcap: float | None) -> torch.Tensor:
    """Attention of one token's queries q [1, H, 1, D] over keys, values [1, H_kv, n, D] (every
    row attended), the scores soft-capped, as transformers' eager attention: [1, H, 1, D]."""
    keys, values = per_query_head(keys, q.shape[1]), per_query_head(values, q.shape[1])
    scores = torch.matmul(q, keys.transpose(2, 3)) * scale  # [1, H, 1, n]
    scores = soft_cap(scores, softcap)
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(weights, values)  # [1, H, 1, D]


def per_query_head(rows: torch.Tensor, heads: int) -> torch.Tensor:
    """A KV head's rows [1, H_kv, n, D] repeated for each of its query heads: [1, H, n, D] (a
    copy, as transformers' repeat_kv makes)."""
    _, kv_heads, n, d = rows.shape
    return rows[:, :, None].expand(1, kv_heads, heads // kv_heads, n, d).reshape(1, heads, n, d)


class _Gemma2Layer(_GemmaLayer):
    """One Gemma2DecoderLayer's decode-step view: Gemma 3's layer, no q/k norms, capped scores."""

    one_call = False  # no kernel soft-caps: `attend_row`, row by row

    def __init__(self, layer: nn.Module, heads: int, kv_heads: int, head_dim: int, window: int | None,
                 softcap: float | None) -> None:
        super().__init__(layer, heads, kv_heads, head_dim, window)  # q_norm, k_norm: identities (none in Gemma 2)
        self.softcap = softcap

    def attend_row(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, position: torch.Tensor, length: int,
                   key_rows: torch.Tensor, value_rows: torch.Tensor, kernel: bool) -> torch.Tensor:
        """One row's capped attention: q [H, D] over its own rows once its k, v are written:
        [1, H, 1, D]. `kernel`: unused (no kernel soft-caps), accepted so every step is called alike."""
        key_rows, value_rows = write_and_attended(position, k, v, key_rows, value_rows, length, self.window)
        return capped_attention(q.view(1, self.heads, 1, self.head_dim), key_rows, value_rows, self.scale,
                                self.softcap)


class Gemma2Step(nn.Module):
    """The step for a Gemma 2 model `support` accepts; shares every weight with the model.
    Called exactly as memrad.engine.decode.steps.llama.DecodeStep; `keys`, `values` hold a
    window view for each sliding layer. Its batched twin is `forward_rows`, as Gemma 3's."""

    def __init__(self, model: nn.Module, max_positions: int) -> None:
        super().__init__()
        self.owner = f"gemma2-step-{next(_STEP_IDS)}"  # unique in the process, never reused
        config, body = model.config, model.model
        heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.embed, self.norm, self.head = body.embed_tokens, body.norm, model.lm_head
        self.final_softcap = config.final_logit_softcapping
        self.layers = nn.ModuleList(
            _Gemma2Layer(layer, heads, kv_heads, head_dim,
                         config.sliding_window if kind == "sliding_attention" else None, config.attn_logit_softcapping)
            for layer, kind in zip(body.layers, config.layer_types))
        register_rope(self, model, max_positions)  # cos, sin [P, D]

    def angles(self, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's rope cos, sin [B, 1, D] at positions [B]: one table for every layer."""
        cos, sin = self.cos.index_select(0, positions)[:, None], self.sin.index_select(0, positions)[:, None]
        return [(cos, sin)] * len(self.layers)

    # Gemma 3's, over these layers and angles: logits [V] after one token, and the batched rows.
    forward = GemmaStep.forward
    forward_rows = GemmaStep.forward_rows
