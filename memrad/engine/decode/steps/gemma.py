"""One-token decode for Gemma 3 (text), written as one function over the KV slabs and windows.

The llama step (memrad.engine.decode.steps.llama) with Gemma 3's differences, so it compiles and
packages the same way (memrad.engine.decode.package):

    token [1] -> embed (scaled by sqrt(hidden), inside transformers' embedding) -> x [1, 1, hidden]
      per layer:  h = norm(x);  q, k, v = qkv(h)                     (one fused matmul)
                  q, k = q_norm(q), k_norm(k);  rope(q, k) at `position` with the layer
                  kind's base (local 10k, global 1M for 270m)
                  global:  write row `position` of the slab, attend rows [0, position]
                  sliding: write the last row of the window view, attend the view (<= W rows)
                  x += post_attn_norm(o_proj(o))
                  x += post_ff_norm(down(gelu_tanh(gate) * up)) of gate_up(pre_ff_norm(x))
    -> norm -> head -> final soft-cap (where configured) -> logits [V]

Gemma's norms are transformers' own modules (RMSNorm in float32 with the +1 weight), called
as they are. The attention scale is query_pre_attn_scalar^-1/2. The step computes what
transformers' Gemma 3 computes, which soft-caps the final logits where the config says and never
the attention scores (its attention is not handed attn_logit_softcapping), so neither does
the step.

Sliding-window layers hand the step a view of their window in a WindowLayer
(memrad.engine.state.window): [1, H_kv, n, D] with n = min(position + 1, W), the new row
last. Its size n is the graph's second symbolic size (every sliding layer's view has it); no
row of the window is copied. The rope angles are computed in the graph from each kind's
inverse frequencies as transformers computes them (float32, then the model's dtype): two
tables of 256-wide rows for 32k positions would cost more memory than the layers' KV.

`forward_rows` is the same for B requests' tokens at once (the batched step,
memrad.engine.decode.batch): x [B, 1, hidden], each projection one matmul for every row, and
per row its rope, its KV row written into its own slab or window view, attention over those
only, and the final soft-cap. The one-row `forward` is its call at B = 1, so where a matmul's
row does not depend on M (bf16 on the int4 and block kernels, bf16 dense) a lone row is the
one-row step's bits. Gemma 2's step (memrad.engine.decode.steps.gemma2) runs the same rows.
"""

from __future__ import annotations

import itertools

import torch
from torch import nn
from torch.nn import functional as F

from memrad.engine.decode.steps.llama import _Layer, attend, rope
from memrad.engine.model import kv_dtype

_GEMMA = ("Gemma3ForCausalLM",)
_LAYER_KINDS = ("sliding_attention", "full_attention")
_STATIC_ROPE = ("default", "linear")
_STEP_IDS = itertools.count()


def support(model: nn.Module, context_len: int) -> str | None:
    """None if the Gemma step computes `model`'s decode, else why not; a model that is not
    Gemma 3 gets None from `is_gemma` and is not asked."""
    why_not = kinds_and_ropes(model, _STATIC_ROPE)
    if why_not is None and getattr(model.config, "use_bidirectional_attention", False):
        return f"{type(model).__name__} attends bidirectionally"
    return why_not


def kinds_and_ropes(model: nn.Module, ropes: tuple[str, ...]) -> str | None:
    """Why a step of sliding-window and full-attention layers, each kind with its own rope
    (transformers' per-kind rotary module), cannot run `model`, or None where it can: a layer
    of another kind, or a kind's rope outside `ropes` (their tables fixed at any length)."""
    name = type(model).__name__
    kinds = set(getattr(model.config, "layer_types", None) or ())
    if not kinds <= set(_LAYER_KINDS):
        return f"{name} has layers of kinds {sorted(kinds - set(_LAYER_KINDS))}"
    dynamic = {kind: rope for kind, rope in model.model.rotary_emb.rope_type.items() if rope not in ropes}
    if dynamic:
        return f"{name} uses {sorted(dynamic.values())} rope, whose frequencies depend on the sequence length"
    return None


def is_gemma(model: nn.Module) -> bool:
    return type(model).__name__ in _GEMMA


def write_row(position: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_rows: torch.Tensor,
              value_rows: torch.Tensor, window: int | None) -> None:
    """Write one row's k, v [1, H_kv, 1, D]: at `position` [1] of the slab (a full layer's,
    window None), or as the last row of the window view (a sliding layer's)."""
    if window is None:
        key_rows.index_copy_(2, position, k.to(key_rows.dtype))  # a bf16 cache's rows: rounded (copy_ casts)
        value_rows.index_copy_(2, position, v.to(value_rows.dtype))
    else:
        n = key_rows.shape[2]
        key_rows.narrow(2, n - 1, 1).copy_(k)
        value_rows.narrow(2, n - 1, 1).copy_(v)


def write_and_attended(position: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_rows: torch.Tensor,
                       value_rows: torch.Tensor, length: int, window: int | None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Write one row's k, v [1, H_kv, 1, D] (`write_row`) and return the rows it attends, all of
    them: a full layer's slab [1, H_kv, capacity, D] cut to its first `length` rows, or a
    sliding layer's whole window view [1, H_kv, n, D]."""
    write_row(position, k, v, key_rows, value_rows, window)
    if window is None:
        return key_rows[:, :, :length], value_rows[:, :, :length]
    return key_rows, value_rows


class _GemmaLayer(_Layer):
    """One Gemma3DecoderLayer's decode-step view; `window` is W for a sliding layer. The
    llama layer's projections (fused alike) and q/k norms (Gemma 3's own), with Gemma's feed-forward norms;
    `post_norm` is Gemma's post-attention norm."""

    one_call = True  # with the kernel, every row's attention in one call of memra's op (`attend_rows`)

    def __init__(self, layer: nn.Module, heads: int, kv_heads: int, head_dim: int, window: int | None) -> None:
        super().__init__(layer, heads, kv_heads, head_dim)
        self.window = window
        self.pre_ff_norm, self.post_ff_norm = layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                lengths: list, keys: list[torch.Tensor], values: list[torch.Tensor], kernel: bool) -> torch.Tensor:
        """x [B, 1, hidden] after the layer: the projections and the feed-forward one matmul for
        every row, attention per row, row r at positions[r] writing its KV row into keys[r],
        values[r] and attending only those (its request's slab, or its window view). B = 1 is the
        one-row step; more, the batched step (memrad.engine.decode.batch)."""
        # cos, sin [B, 1, D]; keys[r], values[r]: row r's slab [1, H_kv, capacity, D] (global) or
        # its window view [1, H_kv, n_r, D] whose last row is this token's (sliding)
        batch, d, h_kv = x.shape[0], self.head_dim, self.kv_heads
        q, k, v = self.qkv(self.input_norm(x)).split(self.split, dim=-1)  # [B, 1, *]
        q = rope(self.q_norm(q.view(batch, self.heads, d)), cos, sin)  # [B, H, D]
        k = rope(self.k_norm(k.view(batch, h_kv, d)), cos, sin)  # [B, H_kv, D]
        v = v.view(batch, h_kv, d)
        o = self.attend_rows(q, k, v, positions, lengths, keys, values, kernel)
        x = x + self.post_norm(self.o_proj(o.reshape(batch, 1, self.heads * d)))
        gate, up = self.gate_up(self.pre_ff_norm(x)).chunk(2, dim=-1)
        return x + self.post_ff_norm(self.down_proj(self.act(gate) * up))

    def attend_rows(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, lengths: list,
                    keys: list[torch.Tensor], values: list[torch.Tensor], kernel: bool) -> torch.Tensor:
        """Every row's attention once its k, v are written: q [B, H, D], k, v [B, H_kv, D] ->
        [B, H_kv, G, D] (Gemma 2: [B, H, 1, D]), heads in order. With `kernel` (and `one_call`), one
        call of memra's op for all rows (memrad.engine.kernels.decode_attention: each row the bits
        the one-row op gives it); otherwise `attend_row`, row by row."""
        batch, h_kv, d = q.shape[0], self.kv_heads, self.head_dim
        k, v = k.view(batch, h_kv, 1, d), v.view(batch, h_kv, 1, d)
        if not (kernel and self.one_call):
            out = [self.attend_row(q[r], k[r : r + 1], v[r : r + 1], positions[r : r + 1], lengths[r], keys[r],
                                   values[r], kernel) for r in range(batch)]
            return out[0] if batch == 1 else torch.cat(out)
        seen = [write_and_attended(positions[r : r + 1], k[r : r + 1], v[r : r + 1], keys[r], values[r], lengths[r],
                                   self.window) for r in range(batch)]
        return torch.ops.memra.decode_attention_rows(q.view(batch, h_kv, self.heads // h_kv, d),
                                                     [rows for rows, _ in seen], [rows for _, rows in seen],
                                                     [rows.shape[2] for rows, _ in seen], self.scale)

    def write_row(self, position: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_rows: torch.Tensor,
                  value_rows: torch.Tensor) -> None:
        """Write one row's k, v [1, H_kv, 1, D] into this layer's slab or window view (`write_row`)."""
        write_row(position, k, v, key_rows, value_rows, self.window)

    def attend_row(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, position: torch.Tensor, length: int,
                   key_rows: torch.Tensor, value_rows: torch.Tensor, kernel: bool) -> torch.Tensor:
        """One row's attention: q [H, D] over its own rows once its k, v are written: [1, H_kv, G, D]."""
        self.write_row(position, k, v, key_rows, value_rows)
        q = q.view(1, self.kv_heads, self.heads // self.kv_heads, self.head_dim)  # a KV head's G query heads as rows
        if self.window is None:
            return attend(q, key_rows, value_rows, length, self.scale, kernel)
        if kernel:
            return torch.ops.memra.decode_attention(q, key_rows, value_rows, self.scale)
        return F.scaled_dot_product_attention(q, key_rows.to(q.dtype), value_rows.to(q.dtype), scale=self.scale)


class GemmaStep(nn.Module):
    """The step for a Gemma 3 model `support` accepts; shares every weight with the model.
    Called exactly as memrad.engine.decode.steps.llama.DecodeStep (the decoder and the package
    treat both alike); `keys`, `values` hold a window view for each sliding layer. Its batched
    twin is `forward_rows` (memrad.engine.decode.batch.BatchGraph calls it), of which the one-row
    step is the call at B = 1."""

    def __init__(self, model: nn.Module, max_positions: int) -> None:
        super().__init__()
        self.owner = f"gemma-step-{next(_STEP_IDS)}"  # unique in the process, never reused
        config, body = model.config, model.model
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        head_dim = config.head_dim
        self.embed, self.norm, self.head = body.embed_tokens, body.norm, model.lm_head
        self.final_softcap = config.final_logit_softcapping
        self.kv_dtype = kv_dtype.of(model)  # the slabs' and windows' rows (memrad.engine.model.kv_dtype)
        kinds = list(config.layer_types)
        self.layers = nn.ModuleList(
            _GemmaLayer(layer, heads, kv_heads, head_dim, config.sliding_window if kind == "sliding_attention" else None)
            for layer, kind in zip(body.layers, kinds))
        register_kind_ropes(self, model, kinds, head_dim, head_dim)

    def _angles(self, inv_freq: torch.Tensor, scaling: float, positions: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * inv_freq[None, :]  # [B, D/2], float32 as transformers
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # [B, 1, D]: broadcast over heads
        return (emb.cos() * scaling).to(self.dtype), (emb.sin() * scaling).to(self.dtype)

    def angles(self, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's rope cos, sin [B, 1, D] at positions [B]: its kind's base."""
        local = self._angles(self.local_inv_freq, self.local_scaling, positions)
        full = self._angles(self.global_inv_freq, self.global_scaling, positions)
        return [local if sliding else full for sliding in self.sliding]

    def forward(self, token: torch.Tensor, position: torch.Tensor, rows: torch.Tensor,
                keys: list[torch.Tensor], values: list[torch.Tensor], owner: str, kernel: bool = False) -> torch.Tensor:
        """Logits [V] (model dtype) after `token` [1] at `position` [1]; writes its KV rows.
        `rows`, `owner`, `kernel`: as DecodeStep.forward."""
        assert owner == self.owner, f"{owner} called {self.owner}"
        return self.forward_rows(token, position, [rows.shape[0]], [keys], [values], kernel).view(-1)

    def forward_rows(self, tokens: torch.Tensor, positions: torch.Tensor, lengths: list, keys: list[list[torch.Tensor]],
                     values: list[list[torch.Tensor]], kernel: bool) -> torch.Tensor:
        """Logits [B, V] (model dtype) after tokens [B] at positions [B]: row r attends lengths[r]
        rows of its own keys[r][layer], values[r][layer] (a slab, or a window view) and writes
        its KV rows there, so no row reads another's; every other op is per row but the matmuls."""
        batch = tokens.shape[0]
        x = self.embed(tokens).view(batch, 1, -1)  # [B, 1, hidden]
        for index, (layer, (cos, sin)) in enumerate(zip(self.layers, self.angles(positions))):
            x = layer(x, cos, sin, positions, lengths, [k[index] for k in keys], [v[index] for v in values], kernel)
        return capped_rows(self.head(self.norm(x)).view(batch, -1), self.final_softcap)  # [B, V]


def register_kind_ropes(step: nn.Module, model: nn.Module, kinds: list[str], local_dim: int, global_dim: int) -> None:
    """Give `step` what `GemmaStep.angles` reads: each layer kind's inverse frequencies [D/2]
    and scaling, as transformers' rotary module holds them (D: that kind's head dim), and
    which of the layers (`kinds`, in order) slide."""
    rotary = model.model.rotary_emb
    step.register_buffer("global_inv_freq", rotary.full_attention_inv_freq.detach().clone().float()
                         if "full_attention" in rotary.rope_type else torch.zeros(global_dim // 2), persistent=False)
    step.register_buffer("local_inv_freq", rotary.sliding_attention_inv_freq.detach().clone().float()
                         if "sliding_attention" in rotary.rope_type else torch.zeros(local_dim // 2), persistent=False)
    step.global_scaling = float(getattr(rotary, "full_attention_attention_scaling", 1.0))
    step.local_scaling = float(getattr(rotary, "sliding_attention_attention_scaling", 1.0))
    step.sliding = tuple(kind == "sliding_attention" for kind in kinds)
    step.dtype = next(model.parameters()).dtype


def capped_rows(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """Logits [B, V] soft-capped. Row by row: an elementwise op runs its last few elements on
    another code path (scalar tanh), so a row capped inside [B, V] would not be the one-row
    step's bits."""
    if logits.shape[0] == 1:
        return soft_cap(logits, cap)
    return torch.cat([soft_cap(logits[r : r + 1], cap) for r in range(logits.shape[0])])


def soft_cap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """tanh(logits / cap) * cap, as transformers' Gemma computes it; `logits` as they are without a cap."""
    return logits if cap is None else torch.tanh(logits / cap) * cap
