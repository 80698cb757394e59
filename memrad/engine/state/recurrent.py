"""Recurrent state the decode step updates in place (linear-attention layers on CPU).

transformers' LinearAttentionLayer already keeps a layer's conv state [1, C, K] and recurrent
state (model-specific, e.g. [1, H_v, D_k, D_v] for a gated delta net) as tensors of fixed
shape that every update copies into (`copy_`, never a new tensor), so they can be handed to a
compiled graph as buffers to rewrite. A RecurrentLayer is that layer, marked for the decode
step (memrad.engine.decode.steps: qwen3_next, falcon_h1, lfm2): prefill runs transformers' own
code on it unchanged, and the step reads and writes the two tensors itself:

    step_buffers(position) -> (conv state, recurrent state)   rewritten in place by the step
                              (LFM2's conv layers: (conv state, empty [0]); they have no other)

It has no per-position index, so it is never croppable: snapshots clone it and a rebuild
clones again (memrad.engine.state.snapshot); the disk tier stores its dicts as it stores
transformers' layer (memrad.engine.state.disk).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import LinearAttentionLayer

from memrad.engine.state.kv import SlabLayer


class RecurrentLayer(LinearAttentionLayer):
    """A linear-attention cache layer whose one-token update the decode step computes."""

    steps_in_place = True  # the decode step updates its state itself (memrad.engine.state.kv.all_slabs)

    @property
    def is_initialized(self) -> bool:
        """Prefill has made the layer's state (the step needs it; a fresh layer has none). The
        conv state says so: a layer with recurrent state makes it in the same forward, and one
        without (LFM2's short convolutions) never makes any."""
        return bool(self.is_conv_states_initialized[0] and not self.record_past)

    def step_buffers(self, position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv state [1, C, K], recurrent state): the tensors the step rewrites for the
        token at `position` (any position: the state holds no rows). A layer with conv state
        only hands an empty tensor [0] in the recurrent state's place, so every recurrent
        layer hands the step a pair (memrad.engine.decode.steps.lfm2)."""
        conv, recurrent = self.conv_states[0], self.recurrent_states[0]
        return conv, recurrent if recurrent is not None else conv.new_empty(0)

    def wrote_row(self, position: int) -> None:
        """Nothing to record: the state tensors were rewritten in place."""


class HybridSlabLayer(LinearAttentionLayer, SlabLayer):
    """A layer holding both attention rows and recurrent state (FalconH1: Mamba-2 beside
    attention in every layer; transformers' LinearAttentionAndFullAttentionLayer): the rows in
    a slab that appends in place (memrad.engine.state.kv.SlabLayer), the state as a
    RecurrentLayer's. The step is handed both:

        step_buffers(position) -> ((keys, values) slabs [1, H_kv, capacity, D],
                                   (conv state, recurrent state))   all written in place

    A rewind or a fork keeps the state with the rows (cloned: a state holds no rows to share).
    """

    steps_in_place = True

    def __init__(self, capacity: int, number_of_states: int = 1, row_dtype: torch.dtype | None = None) -> None:
        SlabLayer.__init__(self, capacity, row_dtype)
        LinearAttentionLayer.__init__(self, number_of_states=number_of_states)

    def lazy_initialization(self, *args, **kwargs) -> None:
        # As transformers' hybrid layer: two positional tensors are attention rows, keywords are state.
        if len(args) == 2 and not kwargs:
            SlabLayer.lazy_initialization(self, *args)
        else:
            LinearAttentionLayer.lazy_initialization(self, *args, **kwargs)

    def step_buffers(self, position: int) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
        """((keys, values) slabs with room for row `position`, (conv state, recurrent state))."""
        return SlabLayer.step_buffers(self, position), (self.conv_states[0], self.recurrent_states[0])

    def wrote_row(self, position: int) -> None:
        SlabLayer.wrote_row(self, position)

    def crop(self, tokens_to_remove: int) -> None:
        raise ValueError("a layer with recurrent state cannot be cut back: rebuild it from a snapshot")

    def reset(self) -> None:
        LinearAttentionLayer.reset(self)
        SlabLayer.reset(self)

    def rewound(self, position: int) -> "HybridSlabLayer":
        return self._with_state(SlabLayer.rewound(self, position))

    def copied(self, position: int) -> "HybridSlabLayer":
        return self._with_state(SlabLayer.copied(self, position))

    def _with_state(self, rows: SlabLayer) -> "HybridSlabLayer":
        out = HybridSlabLayer(self.capacity, self.number_of_states, self.row_dtype)
        out.__dict__.update(rows.__dict__)
        for name in ("conv_states", "recurrent_states"):
            setattr(out, name, {i: None if t is None else t.clone() for i, t in getattr(self, name).items()})
        for name in ("is_conv_states_initialized", "is_recurrent_states_initialized", "has_previous_state",
                     "conv_kernel_size"):
            setattr(out, name, dict(getattr(self, name)))
        out.dtype, out.record_past = self.dtype, self.record_past
        return out
