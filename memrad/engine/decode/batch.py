"""One decode step for several requests at once, with bits that do not depend on the others.

The llama-shaped step (memrad.engine.decode.steps.llama) decodes one token of one request. Here the
same layers run B requests' tokens as the rows of one matrix, so each projection reads its
weights once for all of them, while attention stays per row, over that request's own slab:

    tokens [B] -> embed -> x [B, 1, hidden]
      per layer:  q, k, v = qkv(norm(x))                     one matmul, M = B rows
                  q_norm, k_norm per head (Qwen3); rope per row at its own position
                  row r: write k_r, v_r into row positions[r] of request r's slab;
                  o = attend_rows(q, rows [0, positions[r]] of each row's slab)
                         one call of memra's op for every row (row r: what attend gives it alone)
                  x += o_proj(o);  x += down(act(gate) * up) of gate_up(norm(x))
                             (Qwen3-MoE: routed experts, row by row: memrad.engine.decode.steps.experts)
    -> norm -> head -> logits [B, V]

LFM2 (memrad.engine.decode.steps.lfm2) runs here too: its attention layers are llama's layer, and
its short-convolution layers run their in_proj, out_proj and MLP as one matmul for every row and
the convolution per row, over that request's own conv state (keys[r] of the layer).

Gemma 3, Gemma 2 and Gemma 4 (memrad.engine.decode.steps.gemma, gemma2, gemma4) run their rows themselves
(`forward_rows`, whose call at B = 1 is their one-row step): the same matmuls for every row,
and per row the rope at its own position, its KV row written into its own slab or window view
and attention over those only. A sliding layer's row attends its request's window view
[1, H_kv, n_r, D], n_r = min(positions[r] + 1, W), as the one-row step does; the final soft-cap
runs row by row. gpt-oss's step (memrad.engine.decode.steps.gpt_oss) runs its rows the same way,
with its sink attention and routed experts per row.

`BatchGraph` is that function over tensors only, so it runs eager or is exported and
compiled into one AOTInductor graph (memrad.engine.decode.package, `rows`): each row's
attended length is its own symbol there, every other size static. `BatchStep` hands it the
requests' slabs and pads the batch.

Batch invariance (a request's tokens are the same bits alone or beside any others): every
op but the matmuls is per row, and attention reads only the row's own slab with the call the
one-row step makes. A matmul's row, measured on this machine's torch (docs/BENCHMARKS.md,
Many requests at once): the int4 weight-only kernel and bf16 give every row the same bits at any
M; fp32 takes another path at M = 1 (and for small shapes at M = 2) than at M = 4, but at one
M a row never depends on its neighbours. So the step always runs `rows` rows (max_batch):
rows without a request are dummies (token 0 at position 1 of a scratch slab of their own,
output dropped), and a request running alone computes exactly what it computes in a full
batch. The compiled graph keeps that (fixed shapes: its code does not change with the other
rows' lengths or values); it is not the eager graph's bits (inductor fuses, as for the
one-row step: memrad.engine.decode.decoder).

Across steps: where the matmuls give a row the same bits at M = 1 as at `rows` (bf16 on the
int4 kernel and memra's block kernel), the eager one-row step computes a request's row as the
eager batched step does, and so does the compiled one-row step the compiled batched one,
since inductor rounds where eager would (memrad.engine.decode.package.INDUCTOR_OPTIONS). The
decoder checks that on a scratch request before it lets a lone request run the one-row step
(`BatchStep.alone`); where it does not hold (fp32 matmuls), a lone request runs padded.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from memrad.engine.decode.steps.llama import DecodeStep, attend, attended_rows, rope

# (tokens [B], positions [B], rows, keys, values) -> logits [B, V] in the model's dtype
Graph = Callable[..., torch.Tensor]


class BatchGraph(nn.Module):
    """The batched step over tensors only; shares every weight with `step` (a DecodeStep, an
    Lfm2Step, or a Gemma or gpt-oss step, which computes its rows itself: `steps.has_batched`)."""

    def __init__(self, step: DecodeStep, kernel: bool) -> None:
        super().__init__()
        self.step, self.kernel = step, kernel  # `step`: the exported graph names weights step.*

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, rows: list[torch.Tensor],
                keys: list[list[torch.Tensor]], values: list[list[torch.Tensor]]) -> torch.Tensor:
        """Logits [B, V] after tokens [B] at positions [B]; rows[r]: `attended_rows` of row r;
        keys[r][layer], values[r][layer]: row r's slab [1, H_kv, capacity, D] (a sliding layer's:
        its window view [1, H_kv, n_r, D]), its KV row written."""
        step, batch = self.step, tokens.shape[0]
        lengths = [r.shape[0] for r in rows]
        own_rows = getattr(step, "forward_rows", None)
        if own_rows is not None:  # Gemma 3, 2, 4, gpt-oss: their one-row step is this call at B = 1
            return own_rows(tokens, positions, lengths, keys, values, self.kernel)
        x = step.embed(tokens).view(batch, 1, -1)  # [B, 1, hidden]
        cos = step.cos.index_select(0, positions)[:, None]  # [B, 1, D]: broadcast over heads
        sin = step.sin.index_select(0, positions)[:, None]
        for index, layer in enumerate(step.layers):
            if getattr(layer, "recurrent", False):  # LFM2's short convolutions: each row's conv state its own
                x = layer.rows(x, [k[index] for k in keys])
            else:
                x = self._layer(layer, x, cos, sin, positions, lengths, [k[index] for k in keys],
                                [v[index] for v in values])
        return step.head(step.norm(x)).view(batch, -1)

    def _layer(self, layer: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
               lengths: list, keys: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
        # x [B, 1, hidden]; keys[r], values[r]: row r's slab for this layer, [1, H_kv, capacity, D]
        batch, d, h_kv, heads = x.shape[0], layer.head_dim, layer.kv_heads, layer.heads
        q, k, v = layer.qkv(layer.input_norm(x)).split(layer.split, dim=-1)  # [B, 1, *]
        q = rope(layer.q_norm(q.view(batch, heads, d)), cos, sin)  # [B, H, D]; q_norm: per head (Qwen3)
        k = rope(layer.k_norm(k.view(batch, h_kv, d)), cos, sin)  # [B, H_kv, D]
        v = v.view(batch, h_kv, d)
        for r in range(batch):  # every row's KV first: a run's row j attends the rows before it only
            keys[r].index_copy_(2, positions[r : r + 1], k[r].view(1, h_kv, 1, d).to(keys[r].dtype))  # bf16: rounded
            values[r].index_copy_(2, positions[r : r + 1], v[r].view(1, h_kv, 1, d).to(values[r].dtype))
        o = attend_rows(q.view(batch, h_kv, heads // h_kv, d), keys, values, lengths, layer.scale, self.kernel)
        x = x + layer.o_proj(o.reshape(batch, 1, heads * d))
        return x + layer.feed_forward(layer.post_norm(x))  # routed experts (Qwen3-MoE): each row on its own


def attend_rows(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], lengths: list,
                scale: float, kernel: bool) -> torch.Tensor:
    """Attention of rows q [B, H_kv, G, D], row r over the first lengths[r] rows of its slab keys[r],
    values[r] [1, H_kv, capacity, D]: each row as `attend` gives it alone. With `kernel`, one call
    of memra's op for every row (memrad.engine.kernels.decode_attention); otherwise torch's, row by row."""
    if kernel:
        return torch.ops.memra.decode_attention_rows(q, keys, values, lengths, scale)
    return torch.cat([attend(q[r : r + 1], keys[r], values[r], lengths[r], scale) for r in range(q.shape[0])])


class BatchStep:
    """Feeds up to `rows` requests one token each in one step of exactly `rows` rows.

    `graph`: the eager BatchGraph or its compiled form (memrad.engine.decode.package.PackagedBatch),
    which says per row whether it runs it (`fits`: a slab of the capacity it was compiled for,
    an attended length in its range). `scratch`: rows - 1 dummy slabs, (keys, values) per
    layer each, that pad rows write into (at position 1: length 2 is in every range).
    A request keeps one BatchStep from its first token to its last. `alone`: the one-row
    step's feed where it gives a row the same bits as this step does (checked by the decoder:
    memrad.engine.decode.decoder.Decoder.batch_step); a request decoding by itself then runs
    that, and does not pay for the pad rows, and fewer requests than `rows` run the smallest of
    `smaller` that holds them (`fitting`)."""

    def __init__(self, graph: Graph, rows: int, kernel: bool, scratch: list[tuple[list, list]],
                 eager: BatchGraph, compiled: bool) -> None:
        assert rows >= 1 and len(scratch) >= rows - 1
        self.graph, self.rows, self.kernel, self.scratch = graph, rows, kernel, scratch
        self.eager, self.compiled = eager, compiled
        self.alone: Callable[[Any, int, int], torch.Tensor] | None = None
        self.smaller: list[BatchStep] = []  # fewer rows, the same bits for a row (set with `alone`)
        # Runs of several rows on one slab give each row its one-row bits here (None: not checked
        # yet; memrad.engine.decode.decoder.Decoder.runs_exact).
        self.runs_exact: bool | None = None

    @property
    def step(self) -> str:
        """Which step a request on this one decodes with (the reply's `step`)."""
        return "compiled" if self.compiled else "eager"

    def fitting(self, count: int) -> "BatchStep":
        """The step of the fewest rows that holds `count` requests: this one or a smaller twin."""
        return min((s for s in (*self.smaller, self) if s.rows >= count), key=lambda s: s.rows)

    @torch.inference_mode()
    def __call__(self, caches: Sequence[Any], tokens: Sequence[int], positions: Sequence[int]) -> torch.Tensor:
        """Logits [len(caches), V] float32 after each request's token at its position; each
        row's KV lands in its own cache (all layers in-place slabs: `all_slabs`)."""
        return torch.cat(self.runs(caches, [[token] for token in tokens], positions))

    @torch.inference_mode()
    def runs(self, caches: Sequence[Any], runs: Sequence[Sequence[int]], positions: Sequence[int]
             ) -> list[torch.Tensor]:
        """Each request feeds a run of tokens at consecutive positions from its own, as rows of
        this one step: logits [len(run), V] float32 per request, row j after run[:j + 1].

            rows    | a: p_a  p_a+1  p_a+2 | b: p_b | pad ... |     one slab per request, handed
            attends | [0,p_a] [0,p_a+1] .. | [0,p_b]|         |     once per row of its run

        A run's rows share its slab: per layer every row writes its KV row, then all attend, row j
        over the rows up to its own position, so it reads the rows j' < j wrote just before it and
        none after (speculation's verify step: memrad.engine.speculation; the compiled graph is
        checked to keep that: `Decoder.runs_exact`). Each cache then holds its run: the caller cuts back what it drops."""
        real = sum(len(run) for run in runs)
        assert 0 < real <= self.rows and all(runs), f"{real} rows for a step of {self.rows} rows"
        buffers = [[layer.step_buffers(at) for layer in cache.layers] for cache, at in zip(caches, positions)]
        fits = getattr(self.graph, "fits", lambda *_: True)
        # A request the compiled graph does not run (a slab that grew past the compiled capacity: a
        # context longer than the reservation) runs the eager graph in a batch of its own, so
        # which graph a row takes depends on its own slab only, never on its neighbours.
        apart = [i for i in range(len(runs)) if not fits(buffers[i], positions[i] + len(runs[i]))]
        together = [i for i in range(len(runs)) if i not in apart]
        out: list[torch.Tensor | None] = [None] * len(runs)
        for graph, group in ((self.graph, together), *((self.eager, [i]) for i in apart)):
            if not group:
                continue
            rows = [(i, j) for i in group for j in range(len(runs[i]))]
            logits = self._run(graph, [buffers[i] for i, _ in rows], [runs[i][j] for i, j in rows],
                               [positions[i] + j for i, j in rows])
            start = 0
            for i in group:
                out[i] = logits[start : start + len(runs[i])].float()
                start += len(runs[i])
        for cache, at, run in zip(caches, positions, runs):
            for layer in cache.layers:
                layer.wrote_row(at + len(run) - 1)
        return out

    def _run(self, graph: Graph, buffers: list, tokens: list[int], positions: list[int]) -> torch.Tensor:
        pad = self.rows - len(buffers)
        device = self.eager.step.embed.weight.device
        slabs = [*buffers, *([list(zip(*pair)) for pair in self.scratch[:pad]])]  # [B][layer] (keys, values)
        lengths = [*(at + 1 for at in positions), *([2] * pad)]
        token = torch.tensor([*tokens, *([0] * pad)], device=device)  # [B]
        position = torch.tensor([*positions, *([1] * pad)], device=device)  # [B]
        rows = [attended_rows(length, device) for length in lengths]
        keys = [[k for k, _ in slab] for slab in slabs]
        values = [[v for _, v in slab] for slab in slabs]
        return graph(token, position, rows, keys, values)[: len(buffers)]  # [real, V]
