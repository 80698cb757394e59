"""The cache layer of a layer that attends another layer's keys and values (Gemma 4's KV-shared layers).

transformers gives such a layer a DummyLayer: it holds nothing, and the model hands it the rows
its producer (the last earlier layer of its kind that writes) returned. memra's decode step does
the same (memrad.engine.decode.steps.gemma4), so the layer needs no rows of its own; SharedLayer is
that DummyLayer, marked as stepping in place (memrad.engine.state.kv.all_slabs) so the step runs on
a cache that has it:

    step_buffers(position) -> (empty, empty)   [0] tensors, never read: the step reads the producer's
    wrote_row(position)    -> nothing to record
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DummyLayer


class SharedLayer(DummyLayer):
    """A KV-shared layer's place in the cache: no rows, and the step's buffers are empty."""

    steps_in_place = True  # the decode step reads its producer's rows (memrad.engine.state.kv.all_slabs)

    def step_buffers(self, position: int) -> tuple[torch.Tensor, torch.Tensor]:
        empty = torch.empty(0)
        return empty, empty

    def wrote_row(self, position: int) -> None:
        pass

    def get_seq_length(self) -> int:
        return 0
