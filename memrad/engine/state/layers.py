"""Which in-place layer each of a cache's layers becomes: the one place that knows every kind.

    transformers' layer                     memra's, written in place
    DynamicLayer                         -> SlabLayer        (memrad.engine.state.kv)
    DynamicSlidingWindowLayer            -> WindowLayer      (memrad.engine.state.window)
    LinearAttentionLayer                 -> RecurrentLayer   (memrad.engine.state.recurrent)
    LinearAttentionAndFullAttentionLayer -> HybridSlabLayer  (memrad.engine.state.recurrent)
    DummyLayer (a KV-shared layer)       -> SharedLayer      (memrad.engine.state.shared)
    anything else                        -> kept as it is (the decode step then does not run on it)
"""

from __future__ import annotations

import torch
from transformers.cache_utils import (DummyLayer, DynamicLayer, DynamicSlidingWindowLayer,
                                      LinearAttentionAndFullAttentionLayer, LinearAttentionLayer)

from memrad.engine.state.kv import SlabLayer
from memrad.engine.state.recurrent import HybridSlabLayer, RecurrentLayer
from memrad.engine.state.shared import SharedLayer
from memrad.engine.state.window import WindowLayer


def install(cache, capacity: int, row_dtype: torch.dtype | None = None):
    """Swap `cache`'s layers for their in-place kinds (the table above); returns `cache`.
    `row_dtype`: the KV rows' dtype (memrad.engine.model.kv_dtype.of); None: the model's."""

    def in_place(layer):
        if type(layer) is DynamicLayer:
            return SlabLayer(capacity, row_dtype)
        if type(layer) is DynamicSlidingWindowLayer:
            return WindowLayer(layer.sliding_window, row_dtype)
        if type(layer) is LinearAttentionLayer:
            return RecurrentLayer(layer.number_of_states)
        if type(layer) is LinearAttentionAndFullAttentionLayer:
            return HybridSlabLayer(capacity, layer.number_of_states, row_dtype)
        if type(layer) is DummyLayer:
            return SharedLayer()
        return layer

    cache.layers = [in_place(layer) for layer in cache.layers]
    return cache
