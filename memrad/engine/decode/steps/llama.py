"""One-token decode for llama-shaped models, written as one function over the KV slabs.

Llama-shaped: Llama, Mistral, Qwen2; Qwen3 dense (the same layers with an RMSNorm over each
query and key head before rope: `q_norm`, `k_norm`, identities elsewhere); Phi-3 (q/k/v and
gate/up shipped fused as `qkv_proj`, `gate_up_proj`: the step runs them as they are); Qwen3-MoE
(Qwen3's attention, the gated MLP replaced by top-k routed experts: memrad.engine.decode.steps.experts).

transformers' forward spends most of a one-token step outside the kernels (masks, cache
hooks, per-call dispatch over 30 layers), and its CPU attention for one query with grouped
KV heads (`enable_gqa`) is the slowest way to ask: the same attention with the query heads of
each KV head laid out as query rows is several times faster (measured: docs/BENCHMARKS.md,
Decode: the step's parts; why: docs/ARCHITECTURE.md, "The decode step"). This step does only
the work:

    token [1] -> embed -> x [1, 1, hidden]
      per layer:  h = norm(x);  q, k, v = qkv(h)            (one fused matmul)
                  q, k = q_norm(q), k_norm(k) per head       (Qwen3; identity elsewhere)
                  rope(q, k) at `position`;  write k, v into row `position` of the slab
                  o = attend(q as [1, H_kv, G, D], rows [0, position] of the slab)
                  x += o_proj(o);  x += down(act(gate) * up) of gate_up(norm(x))
                                   (Qwen3-MoE: x += the top-k experts' sum of norm(x))
    -> norm -> head -> logits [V]

    slab keys [1, H_kv, capacity, D]:  | rows 0 .. position-1 (prompt, earlier steps) | k | unused |
                                        |<-------------------- length ------------------->|

Shapes are static except `length` (= position + 1), so one compiled graph serves every
step with memra's attention kernel, two (short and split attention) with torch's
(memrad.engine.decode.decoder). The step's bits differ from transformers' forward, which is
fine: decoded KV is never reused in exact mode (DESIGN: Exactness), and cold and resumed
runs decode through the same step, so they stay identical.

`support(model)` says which models this covers and why not others; they keep the
transformers forward.
"""

from __future__ import annotations

import itertools

import torch
from torch import nn
from torch.nn import functional as F

from memrad.engine.decode.steps import experts
from memrad.engine.model import kv_dtype
from memrad.engine.model.block_linear import BlockLinear
from memrad.engine.model.quant import Int4Linear, Q8Linear

# Model classes whose layers are exactly llama's: pre-norm RMSNorm, q/k/v/o, gated MLP, rope
# (Qwen3: with per-head q/k RMSNorms; Phi-3: with q/k/v and gate/up fused as shipped; Qwen3-MoE:
# Qwen3's attention, routed experts for the MLP).
_LLAMA_SHAPED = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Phi3ForCausalLM",
                 "Qwen3MoeForCausalLM")
# The classes whose attention norms each query and key head (over head_dim) before rope.
_QK_NORMED = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
# Rope variants whose frequencies do not depend on how long the sequence is. YaRN's attention
# factor scales cos and sin, and the rotary module folds it into the table DecodeStep reads.
_STATIC_ROPE = ("default", "linear", "llama3", "yarn")
# From this many rows on, attention on the CPU splits the rows in two halves run side by side
# (torch's kernel parallelises over KV heads only: 3 of them on 2 threads leave one idle a third
# of the time). At 4k rows the split wins, at 2,048 it still loses, and more parts than 2 are no
# better (measured: docs/BENCHMARKS.md, Decode: the step's parts).
SPLIT_ROWS = 3072
_STEP_IDS = itertools.count()


def support(model: nn.Module, context_len: int) -> str | None:
    """None if the step computes `model`'s decode, else why not (a log and /health reason)."""
    name = type(model).__name__
    if name not in _LLAMA_SHAPED:
        return f"{name} is not llama-shaped (the step covers {', '.join(_LLAMA_SHAPED)})"
    config = model.config
    window = getattr(config, "sliding_window", None)
    if window is not None and (getattr(config, "use_sliding_window", True) and window < context_len):
        return f"{name} uses a sliding window of {window} tokens"
    layer_types = getattr(config, "layer_types", None) or ()
    if any(kind != "full_attention" for kind in layer_types):
        return f"{name} has layers that are not full attention"
    rope_type = getattr(model.model.rotary_emb, "rope_type", "default")
    if rope_type not in _STATIC_ROPE:
        return f"{name} uses {rope_type} rope, whose frequencies depend on the sequence length"
    if getattr(config, "partial_rotary_factor", 1.0) != 1.0:
        return f"{name} rotates part of each head (partial_rotary_factor {config.partial_rotary_factor})"
    attention = model.model.layers[0].self_attn
    if (hasattr(attention, "q_norm") and name not in _QK_NORMED) or not (
            hasattr(attention, "q_proj") or hasattr(attention, "qkv_proj")):
        return f"{name}'s attention is not plain q/k/v/o projections"
    return None


def layers_and_rope(model: nn.Module, kinds: tuple[str, ...], ropes: tuple[str, ...]) -> str | None:
    """Why a step whose layers are of `kinds` and whose rope tables are fixed for `ropes` cannot
    run `model`, or None where it can (an architecture's `support` asks it first)."""
    name = type(model).__name__
    found = set(getattr(model.config, "layer_types", None) or ())
    if not found <= set(kinds):
        return f"{name} has layers of kinds {sorted(found - set(kinds))}"
    rope_type = getattr(model.model.rotary_emb, "rope_type", "default")
    if rope_type not in ropes:
        return f"{name} uses {rope_type} rope, whose frequencies depend on the sequence length"
    return None


def attention_shape(config) -> tuple[int, int, int]:
    """(query heads, KV heads, head dim) of a transformers attention config."""
    heads = config.num_attention_heads
    return heads, config.num_key_value_heads, getattr(config, "head_dim", None) or config.hidden_size // heads


PACKED_ROW_BLOCK = 64  # rows torch's CPU int4 packing lays out together (a multiple of tinygemm's 8)


def fuse(linears: list[nn.Linear]) -> nn.Linear:
    """One Linear whose output is the concatenated outputs of `linears` (same input).

    Memory is shared, not copied: each original's weight (and packed int4 codes) becomes a
    view of the fused tensor, so prefill, which calls the originals, reads the same bytes.
    Returns a module that calls them one by one where their kinds differ.
    """
    if all(type(layer) is nn.Linear for layer in linears):
        return _fuse_dense(linears)
    kinds = {type(layer) for layer in linears}
    if kinds == {BlockLinear} and len({layer.kind for layer in linears}) == 1:  # GGUF blocks: rows are independent
        dense = _fuse_dense(linears)
        blocks = torch.cat([layer.blocks for layer in linears])  # [N, K/32 * block bytes]
        for layer, rows in zip(linears, _row_ranges(linears)):
            layer.blocks = blocks[rows]
        return BlockLinear(dense, blocks, linears[0].kind)
    # The CPU packing interleaves rows in blocks of 64: packed parts join only at a block's edge.
    aligned = all(layer.out_features % PACKED_ROW_BLOCK == 0 for layer in linears[:-1])
    if len(kinds) == 1 and kinds <= {Int4Linear, Q8Linear} and aligned:  # Q8Linear: codes [N, 2K] (hi|lo)
        dense = _fuse_dense(linears)
        packed = torch.cat([layer.packed for layer in linears])  # [N, K/2] rows are independent
        scales_and_zeros = torch.cat([layer.scales_and_zeros for layer in linears], dim=1)  # [K/32, N, 2]
        for layer, rows in zip(linears, _row_ranges(linears)):
            layer.packed = packed[rows]
        return kinds.pop()(dense, packed, scales_and_zeros)
    return _Concatenated(linears)


def _row_ranges(linears: list[nn.Linear]) -> list[slice]:
    out, start = [], 0
    for layer in linears:
        out.append(slice(start, start + layer.out_features))
        start += layer.out_features
    return out


def _fuse_dense(linears: list[nn.Linear]) -> nn.Linear:
    has_bias = [layer.bias is not None for layer in linears]
    assert all(has_bias) or not any(has_bias), "fused projections either all have a bias or none"
    weight = torch.cat([layer.weight.detach() for layer in linears])  # [N, K]
    bias = torch.cat([layer.bias.detach() for layer in linears]) if all(has_bias) else None
    for layer, rows in zip(linears, _row_ranges(linears)):
        layer.weight = nn.Parameter(weight[rows], requires_grad=False)
        if bias is not None:
            layer.bias = nn.Parameter(bias[rows], requires_grad=False)
    fused = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    fused.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        fused.bias = nn.Parameter(bias, requires_grad=False)
    return fused


class _Concatenated(nn.Module):
    """Projections of different kinds (e.g. one layer left float): run each, join outputs."""

    def __init__(self, linears: list[nn.Linear]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(linears)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts], dim=-1)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate heads x [H, D] by cos, sin [1, D] (transformers' rotate_half convention)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, length: int, scale: float,
           kernel: bool = False) -> torch.Tensor:
    """Attention of one token's queries q [1, H_kv, G, D] over the first `length` rows of
    keys, values [1, H_kv, capacity, D] (capacity > length: `SlabLayer.step_buffers`).

    With `kernel`, memra's CPU decode-attention op (memrad.engine.kernels.decode_attention) reads the
    rows once, chunked over the threads. Otherwise torch's attention, with the G query heads
    that share a KV head as the rows of one query block, so no KV head is copied; on the
    CPU, long contexts split the rows into two halves computed as a batch of 2 and merged by
    their log-sum-exp (see SPLIT_ROWS). Both halves have ceil(length/2) rows: for an odd
    length the second one reaches one row past the end, masked out, so odd and even lengths
    run the same graph.

        rows  | 0 ......... half-1 | half ......... length-1 | (length: masked) |
              |<---- batch 0 ----->|<------------ batch 1 ----------------->|
    """
    if kernel:
        return torch.ops.memra.decode_attention(q, keys[:, :, :length], values[:, :, :length], scale)
    if keys.dtype != q.dtype:  # a bf16 cache without the kernel: torch's attention takes one dtype
        rows = min(keys.shape[2], 2 * ((length + 1) // 2))  # what the split below reads
        keys, values = keys[:, :, :rows].to(q.dtype), values[:, :, :rows].to(q.dtype)
    if q.device.type != "cpu" or length < SPLIT_ROWS:
        return F.scaled_dot_product_attention(q, keys[:, :, :length], values[:, :, :length], scale=scale)
    half = (length + 1) // 2
    _, heads, _, dim = keys.shape
    k2 = keys[:, :, : 2 * half].reshape(heads, 2, half, dim).transpose(0, 1)  # [2, H_kv, half, D]
    v2 = values[:, :, : 2 * half].reshape(heads, 2, half, dim).transpose(0, 1)
    visible = torch.arange(2 * half, device=q.device) < length  # [2 * half]
    mask = torch.where(visible, 0.0, float("-inf")).to(q.dtype).view(2, 1, 1, half)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.expand(2, -1, -1, -1), k2, v2, attn_mask=mask, scale=scale)[:2]  # [2, H_kv, G, D], [2, H_kv, G]
    weights = torch.softmax(lse.float(), dim=0)  # [2, H_kv, G]
    merged = (out.float() * weights[..., None]).sum(0, keepdim=True)  # [1, H_kv, G, D]
    return merged.to(q.dtype)


class _Layer(nn.Module):
    """One decoder layer's decode-step view of a transformers LlamaDecoderLayer."""

    def __init__(self, layer: nn.Module, heads: int, kv_heads: int, head_dim: int) -> None:
        super().__init__()
        attention, mlp = layer.self_attn, layer.mlp
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.scale = float(attention.scaling)
        self.input_norm, self.post_norm = layer.input_layernorm, layer.post_attention_layernorm
        # Phi-3 ships q/k/v and gate/up fused: the model's own modules, as they are.
        self.qkv = getattr(attention, "qkv_proj", None) or fuse([attention.q_proj, attention.k_proj, attention.v_proj])
        self.q_norm = getattr(attention, "q_norm", None) or nn.Identity()  # [.., D] per head (Qwen3)
        self.k_norm = getattr(attention, "k_norm", None) or nn.Identity()
        self.o_proj = attention.o_proj
        self.sparse = mlp if experts.is_sparse(mlp) else None  # Qwen3-MoE: the model's routed block
        if self.sparse is None:
            self.gate_up = getattr(mlp, "gate_up_proj", None) or fuse([mlp.gate_proj, mlp.up_proj])
            self.down_proj, self.act = mlp.down_proj, getattr(mlp, "act_fn", None) or mlp.activation_fn
        self.split = (heads * head_dim, kv_heads * head_dim, kv_heads * head_dim)

    def feed_forward(self, h: torch.Tensor) -> torch.Tensor:
        """The MLP of h [B, 1, hidden] (normed): the gated MLP, one matmul per projection for every
        row, or the routed experts, each row on its own (memrad.engine.decode.steps.experts)."""
        if self.sparse is not None:
            return experts.feed_forward(self.sparse, h)
        gate, up = self.gate_up(h).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, position: torch.Tensor,
                length: int, key_rows: torch.Tensor, value_rows: torch.Tensor, kernel: bool) -> torch.Tensor:
        # x [1, 1, hidden]; key_rows, value_rows: this layer's slab [1, H_kv, capacity, D]
        d, h_kv = self.head_dim, self.kv_heads
        q, k, v = self.qkv(self.input_norm(x)).split(self.split, dim=-1)
        q = rope(self.q_norm(q.view(self.heads, d)), cos, sin)  # [H, D]
        k = rope(self.k_norm(k.view(h_kv, d)), cos, sin)  # [H_kv, D]
        key_rows.index_copy_(2, position, k.view(1, h_kv, 1, d).to(key_rows.dtype))  # bf16 rows: rounded
        value_rows.index_copy_(2, position, v.view(1, h_kv, 1, d).to(value_rows.dtype))
        q = q.view(1, h_kv, self.heads // h_kv, d)  # the G query heads of a KV head as rows
        o = attend(q, key_rows, value_rows, length, self.scale, kernel)  # [1, H_kv, G, D]
        x = x + self.o_proj(o.reshape(1, 1, self.heads * d))
        return x + self.feed_forward(self.post_norm(x))


class DecodeStep(nn.Module):
    """The step for a model `support` accepts; shares every weight with the model."""

    def __init__(self, model: nn.Module, max_positions: int) -> None:
        super().__init__()
        self.owner = f"decode-step-{next(_STEP_IDS)}"  # unique in the process, never reused
        config, body = model.config, model.model
        heads, kv_heads, head_dim = attention_shape(config)
        self.embed, self.norm, self.head = body.embed_tokens, body.norm, model.lm_head
        self.layers = nn.ModuleList(_Layer(layer, heads, kv_heads, head_dim) for layer in body.layers)
        self.kv_dtype = kv_dtype.of(model)  # the slabs' rows (memrad.engine.model.kv_dtype)
        register_rope(self, model, max_positions)

    def forward(self, token: torch.Tensor, position: torch.Tensor, rows: torch.Tensor,
                keys: list[torch.Tensor], values: list[torch.Tensor], owner: str, kernel: bool = False) -> torch.Tensor:
        """Logits [V] (model dtype) after `token` [1] at `position` [1]; writes its KV row.

        `rows` [position + 1, 0] holds no data: its first size is the attended length, so
        torch.compile keeps that one size symbolic (marked dynamic) and every other size static.
        `owner` must be this step's `owner`: a compiled graph is guarded on it (the compiled
        decoder skips the guards on weights), so it never runs another step's weights.
        `kernel`: attend with memra's CPU kernel (loaded by memrad.engine.kernels.decode_attention).
        """
        assert owner == self.owner, f"{owner} called {self.owner}"
        return self.head(self.norm(through_layers(self, token, position, rows, keys, values, kernel))).view(-1)


def through_layers(step: nn.Module, token: torch.Tensor, position: torch.Tensor, rows: torch.Tensor,
                   keys: list[torch.Tensor], values: list[torch.Tensor], kernel: bool) -> torch.Tensor:
    """x [1, 1, hidden] after `token` [1] at `position` [1] through every layer of `step` (one
    with `embed`, per-position `cos`, `sin` tables and layers called as _Layer is), each
    writing its KV row: a one-row step's forward up to the final norm."""
    length = rows.shape[0]
    x = step.embed(token).view(1, 1, -1)  # [1, 1, hidden]
    cos, sin = step.cos.index_select(0, position), step.sin.index_select(0, position)  # [1, D]
    for layer, key_rows, value_rows in zip(step.layers, keys, values):
        x = layer(x, cos, sin, position, length, key_rows, value_rows, kernel)
    return x


def register_rope(step: nn.Module, model: nn.Module, max_positions: int) -> None:
    """Give `step` the `cos`, `sin` buffers [P, D] `through_layers` reads (`rope_tables`), kept
    out of its state dict."""
    cos, sin = rope_tables(model, max_positions)
    step.register_buffer("cos", cos, persistent=False)
    step.register_buffer("sin", sin, persistent=False)


def rope_tables(model: nn.Module, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [P, D] for every position, as the model's rotary module computes them (D: the
    rotated dims, fewer than the head's where the model rotates part of it)."""
    param = next(model.parameters())
    positions = torch.arange(max_positions, device=param.device)[None]  # [1, P]
    with torch.no_grad():
        cos, sin = model.model.rotary_emb(torch.zeros(1, dtype=param.dtype, device=param.device), positions)
    return cos[0], sin[0]


def attended_rows(length: int, device: torch.device) -> torch.Tensor:
    """The `rows` argument of DecodeStep.forward for `length` attended rows (no storage)."""
    return torch.empty(length, 0, device=device)
