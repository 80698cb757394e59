"""Recurrent state the decode step updates in place (linear-attention layers on CPU).

transformers' LinearAttentionLayer already keeps a layer's conv state [1, C, K] and recurrent
state (model-specific, e.g. [1, H_v, D_k, D_v] for a gated delta net) as tensors of fixed
shape that every update copies into (`copy_`, never a new tensor), so they can be handed to a
compiled graph as buffers to rewrite. A RecurrentLayer is that layer, marked for the decode
step (memrad.engine.decode.hybrid_step): prefill runs transformers' own code on it unchanged,
and the step reads and writes the two tensors itself:

    step_buffers(position) -> (conv state, recurrent state)   rewritten in place by the step

It has no per-position index, so it is never croppable: snapshots clone it and a rebuild
clones again (memrad.engine.state.snapshot); the disk tier stores its dicts as it stores
transformers' layer (memrad.engine.state.disk).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import LinearAttentionLayer


class RecurrentLayer(LinearAttentionLayer):
    """A linear-attention cache layer whose one-token update the decode step computes."""

    steps_in_place = True  # the decode step updates its state itself (memrad.engine.state.kv.all_slabs)

    @property
    def is_initialized(self) -> bool:
        """Prefill has made both states (the step needs them; a fresh layer has neither)."""
        return bool(self.is_conv_states_initialized[0] and self.is_recurrent_states_initialized[0]
                    and not self.record_past)

    def step_buffers(self, position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv state [1, C, K], recurrent state): the tensors the step rewrites for the
        token at `position` (any position: the state holds no rows)."""
        return self.conv_states[0], self.recurrent_states[0]

    def wrote_row(self, position: int) -> None:
        """Nothing to record: the state tensors were rewritten in place."""
