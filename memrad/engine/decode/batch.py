"""One decode step for several requests at once, with bits that do not depend on the others.

The llama-shaped step (memrad.engine.decode.step) decodes one token of one request. Here the
same layers run B requests' tokens as the rows of one matrix, so each projection reads its
weights once for all of them, while attention stays per row, over that request's own slab:

    tokens [B] -> embed -> x [B, 1, hidden]
      per layer:  q, k, v = qkv(norm(x))                     one matmul, M = B rows
                  rope per row at its own position
                  row r: write k_r, v_r into row positions[r] of request r's slab;
                         o_r = attend(q_r, rows [0, positions[r]] of that slab)
                  x += o_proj(o);  x += down(act(gate) * up) of gate_up(norm(x))
    -> norm -> head -> logits [B, V]

Batch invariance (a request's tokens are the same bits alone or beside any others): every
op but the matmuls is per row, and attention reads only the row's own slab with the call the
one-row step makes. A matmul's row, measured on this machine's torch (docs/BENCHMARKS.md,
Many requests at once): the int4 weight-only kernel and bf16 give every row the same bits at any
M; fp32 takes another path at M = 1 (and for small shapes at M = 2) than at M = 4, but at one
M a row never depends on its neighbours. So the step always runs `rows` rows (max_batch):
rows without a request are dummies (token 0 at position 0, no attention, output dropped),
and a request running alone computes exactly what it computes in a full batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from memrad.engine.decode.step import DecodeStep, attend, rope


class BatchStep:
    """Feeds up to `rows` requests one token each in one step of exactly `rows` rows.

    Wraps an eager `DecodeStep` and shares all its weights; `kernel`: attend with memra's
    CPU kernel. A request keeps one BatchStep from its first token to its last."""

    def __init__(self, step: DecodeStep, rows: int, kernel: bool) -> None:
        assert rows >= 1
        self.step, self.rows, self.kernel = step, rows, kernel

    @torch.inference_mode()
    def __call__(self, caches: Sequence[Any], tokens: Sequence[int], positions: Sequence[int]) -> torch.Tensor:
        """Logits [len(caches), V] float32 after each request's token at its position; each
        row's KV lands in its own cache (all layers in-place slabs: `all_slabs`)."""
        real = len(caches)
        assert 0 < real <= self.rows, f"{real} requests for a step of {self.rows} rows"
        buffers = [[layer.step_buffers(position) for layer in cache.layers] for cache, position in zip(caches, positions)]
        step = self.step
        device = step.cos.device
        pad = self.rows - real
        token = torch.tensor([*tokens, *([0] * pad)], device=device)  # [B]
        position = torch.tensor([*positions, *([0] * pad)], device=device)  # [B]
        x = step.embed(token).view(self.rows, 1, -1)  # [B, 1, hidden]
        cos = step.cos.index_select(0, position)[:, None]  # [B, 1, D]: broadcast over heads
        sin = step.sin.index_select(0, position)[:, None]
        for index, layer in enumerate(step.layers):
            x = self._layer(layer, index, x, cos, sin, position, positions, buffers)
        logits = step.head(step.norm(x)).view(self.rows, -1)[:real]  # [real, V]
        for cache, at in zip(caches, positions):
            for layer in cache.layers:
                layer.wrote_row(at)
        return logits.float()

    def _layer(self, layer: Any, index: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               position: torch.Tensor, positions: Sequence[int], buffers: list) -> torch.Tensor:
        # x [B, 1, hidden]; buffers[r][index]: request r's slab for this layer, [1, H_kv, capacity, D]
        rows, d, h_kv, heads = self.rows, layer.head_dim, layer.kv_heads, layer.heads
        q, k, v = layer.qkv(layer.input_norm(x)).split(layer.split, dim=-1)  # [B, 1, *]
        q = rope(q.view(rows, heads, d), cos, sin)  # [B, H, D]
        k = rope(k.view(rows, h_kv, d), cos, sin)  # [B, H_kv, D]
        v = v.view(rows, h_kv, d)
        out = torch.zeros(rows, h_kv, heads // h_kv, d, dtype=q.dtype, device=q.device)  # dummies stay 0
        for r, at in enumerate(positions):
            keys, values = buffers[r][index]
            keys.index_copy_(2, position[r : r + 1], k[r].view(1, h_kv, 1, d))
            values.index_copy_(2, position[r : r + 1], v[r].view(1, h_kv, 1, d))
            out[r] = attend(q[r].view(1, h_kv, heads // h_kv, d), keys, values, at + 1, layer.scale, self.kernel)[0]
        x = x + layer.o_proj(out.reshape(rows, 1, heads * d))
        gate, up = layer.gate_up(layer.post_norm(x)).chunk(2, dim=-1)
        return x + layer.down_proj(layer.act(gate) * up)
