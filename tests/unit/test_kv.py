"""In-place KV slabs: appends write in place, rewinds share the buffer, reservations cost nothing."""

import sys

import pytest
import torch

from memrad.engine.state.kv import SlabLayer
from memrad.engine.state.layers import install


def rows(n: int, start: int = 0, heads: int = 2, dim: int = 4) -> torch.Tensor:
    # [1, H, n, D]; row i of head h holds start + i + 1000 h, so any misplaced row shows
    base = torch.arange(start, start + n, dtype=torch.float32)
    return (base[None, :, None] + 1000 * torch.arange(heads)[:, None, None]).expand(heads, n, dim)[None].clone()


def test_appends_land_in_place_and_read_back_as_the_concatenation():
    layer = SlabLayer(capacity=64)
    k, v = layer.update(rows(5), -rows(5))
    buffer = layer.slab.keys.data_ptr()
    k, v = layer.update(rows(3, start=5), -rows(3, start=5))
    assert layer.slab.keys.data_ptr() == buffer  # no new allocation, no copy of earlier rows
    assert k.data_ptr() == buffer and k.shape == (1, 2, 8, 4)
    assert torch.equal(k, rows(8)) and torch.equal(v, -rows(8))
    assert layer.get_seq_length() == 8 and layer.slab.high_water == 8


def test_a_rewound_layer_writes_over_the_later_rows_and_never_below():
    parked = SlabLayer(capacity=64)
    parked.update(rows(10), rows(10))
    early_view = parked.keys[..., :6, :]  # what a snapshot at 6 holds
    resumed = parked.rewound(6)
    assert resumed.slab is parked.slab and resumed.get_seq_length() == 6
    k, _ = resumed.update(rows(2, start=100), rows(2, start=100))
    assert torch.equal(k[..., :6, :], rows(6)) and torch.equal(k[..., 6:, :], rows(2, start=100))
    assert torch.equal(early_view, rows(6))
    # The longer parked state is consumed: its rows 6..7 now hold the resumed request's rows.
    assert torch.equal(parked.keys[..., 6:8, :], rows(2, start=100))
    assert parked.slab.high_water == 10


def test_crop_shortens_the_view_and_a_full_buffer_grows_keeping_every_row():
    layer = SlabLayer(capacity=4)
    layer.update(rows(3), rows(3))
    layer.crop(-1)
    assert layer.get_seq_length() == 2
    k, _ = layer.update(rows(5, start=2), rows(5, start=2))  # 7 rows > capacity 4
    assert layer.slab.capacity >= 7 and torch.equal(k, rows(7))
    with pytest.raises(ValueError):
        layer.crop(3)


def test_install_swaps_each_layer_kind_for_its_in_place_form_and_leaves_the_rest():
    from transformers.cache_utils import (DummyLayer, DynamicLayer, DynamicSlidingWindowLayer,
                                          LinearAttentionAndFullAttentionLayer, LinearAttentionLayer)

    from memrad.engine.state.recurrent import HybridSlabLayer, RecurrentLayer
    from memrad.engine.state.shared import SharedLayer
    from memrad.engine.state.window import WindowLayer

    class FakeCache:
        layers = [DynamicLayer(), DynamicSlidingWindowLayer(sliding_window=8), LinearAttentionLayer(),
                  LinearAttentionAndFullAttentionLayer(), DummyLayer(), DynamicLayer()]

    cache = install(FakeCache(), 128)
    # a KV-shared layer (Gemma 4's DummyLayer) holds no rows: its stand-in hands the step an empty pair
    assert [type(layer) for layer in cache.layers] == [SlabLayer, WindowLayer, RecurrentLayer, HybridSlabLayer,
                                                       SharedLayer, SlabLayer]
    assert cache.layers[1].sliding_window == 8 and cache.layers[3].capacity == 128


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
def test_the_reservation_commits_memory_only_for_written_rows():
    # 16 layers x (K + V) x 8 heads x 32768 rows x 64 dims x 4 B = 2 GiB reserved
    layers = [SlabLayer(capacity=32768) for _ in range(16)]
    before = _resident_bytes()
    for layer in layers:
        layer.update(rows(256, heads=8, dim=64), rows(256, heads=8, dim=64))
    grown = _resident_bytes() - before
    written = 16 * 2 * 8 * 256 * 64 * 4  # 16 MiB
    assert grown < 4 * written, f"{grown} bytes resident for {written} bytes written"
    assert layers[0].slab.capacity == 32768


@pytest.mark.parametrize("in_place", [True, False])
def test_crop_to_keeps_the_first_rows_of_slab_and_plain_caches(tiny_engine, in_place):
    from memrad.engine.forward import crop_to, prefill

    cache = tiny_engine.new_cache(in_place)
    prefill(tiny_engine.loaded.model, cache, list(range(3, 43)), 0, 16)
    keys = cache.layers[0].keys[..., :25, :].clone()
    crop_to(cache, 25)
    assert cache.get_seq_length() == 25 and torch.equal(cache.layers[0].keys, keys)
    crop_to(cache, 30)  # longer than what it holds: nothing to drop
    assert cache.get_seq_length() == 25
