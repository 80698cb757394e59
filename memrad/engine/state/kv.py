"""In-place KV storage for full-attention layers on CPU.

transformers' DynamicLayer grows by `torch.cat`: every prefill chunk and every decode step
copies the whole cache into a fresh allocation. On a CPU that is memory traffic in
proportion to the context on every step, and fresh memory is paid again in page faults: inside
a serving process a resumed suffix took far longer than the same forward on a warm cache
(measured: docs/BENCHMARKS.md, Reuse and affinity: In-place KV). A SlabLayer writes new rows in
place instead, into a buffer that reserves room for the model's whole context once:

    buffer  [1, H_kv, capacity, D]    anonymous mmap: a page is committed when first written
             |<--- length --->|<------------- reserved, never touched ------------->|
    keys    [1, H_kv, length, D]  =  buffer[..., :length, :]   (a view; values alike)

A slab may keep its rows in another dtype than the model computes them in (bf16 under fp32
activations: memrad.engine.model.kv_dtype): rows are rounded as they are written, and prefill
attends the slab's rows widened back, so a row reads the same whichever chunk or step wrote it.

Rewinding shares the buffer (`rewound(p)`): the next write overwrites rows p.. of whoever
held them before, so a rewind *consumes* the longer state. The engine only rewinds a parked
session it has checked out of the pool (a resume replaces its parent). Rows below the
current length are never written again, so views handed out earlier stay exact.
"""

from __future__ import annotations

import math
import mmap

import torch
from transformers.cache_utils import DynamicLayer

# Reserve at most this many positions up front; longer contexts grow by copying (rare).
MAX_RESERVED_TOKENS = 32768


@torch.inference_mode()
def reserve(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised tensor whose untouched pages cost no memory (CPU) or a plain empty one.

    Always an inference tensor, wherever it is made: the compiled decode step guards on
    that, and a buffer of the other kind would make it compile again mid-request."""
    num_bytes = dtype.itemsize * math.prod(shape)
    if device.type != "cpu" or num_bytes == 0:  # nothing to map (LFM2's empty recurrent state)
        return torch.empty(shape, dtype=dtype, device=device)
    # The tensor keeps the mapping alive; freeing the tensor unmaps it and returns the pages.
    return torch.frombuffer(mmap.mmap(-1, num_bytes), dtype=dtype).view(shape)


class Slab:
    """One layer's key and value buffers, shared by every SlabLayer (or WindowLayer) view of them."""

    __slots__ = ("keys", "values", "high_water")

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.keys = keys  # [1, H_kv, capacity, D]
        self.values = values  # [1, H_kv, capacity, D_v]
        self.high_water = 0  # rows ever written: the committed part of the reservation

    @property
    def capacity(self) -> int:
        return self.keys.shape[-2]

    @property
    def bytes_per_row(self) -> int:
        k, v = self.keys, self.values
        return (k.shape[1] * k.shape[3] + v.shape[1] * v.shape[3]) * k.element_size()

    @torch.inference_mode()  # the buffers are inference tensors (see `reserve`)
    def grow(self, needed: int) -> None:
        capacity = max(needed, 2 * self.capacity)
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = reserve((*old.shape[:2], capacity, old.shape[3]), old.dtype, old.device)
            new[..., : self.high_water, :].copy_(old[..., : self.high_water, :])
            setattr(self, name, new)


class SlabLayer(DynamicLayer):
    """A full-attention cache layer that appends in place (see the module docstring)."""

    steps_in_place = True  # the decode step writes its row itself (`all_slabs`)

    def __init__(self, capacity: int, row_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.capacity = min(capacity, MAX_RESERVED_TOKENS)
        self.row_dtype = row_dtype  # the rows' dtype; None: the first rows' own
        self.slab: Slab | None = None
        self.length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        # key_states: [1, H_kv, T, D]
        self.device = key_states.device
        b, h, _, d = key_states.shape
        dtype = self.row_dtype or key_states.dtype
        self.slab = Slab(reserve((b, h, self.capacity, d), dtype, self.device),
                          reserve((b, value_states.shape[1], self.capacity, value_states.shape[3]), dtype, self.device))
        self.is_initialized = True
        self._expose()

    @torch.inference_mode()  # the buffers are inference tensors (see `reserve`)
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, end = self.length, self.length + key_states.shape[-2]
        if end > self.slab.capacity:
            self.slab.grow(end)
        self.slab.keys[..., start:end, :].copy_(key_states)
        self.slab.values[..., start:end, :].copy_(value_states)
        self.length = end
        self.slab.high_water = max(self.slab.high_water, end)
        self._expose()
        # Attended as stored: bf16 rows widened for fp32 queries (copies; none where the dtypes match).
        return self.keys.to(key_states.dtype), self.values.to(value_states.dtype)

    def step_buffers(self, position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole key and value buffers [1, H_kv, capacity, D], with room for row
        `position` and one more (the split attention reads one row past the end, masked),
        for a decode step that writes that row itself (memrad.engine.decode.steps.llama);
        `wrote_row` records it afterwards."""
        assert self.is_initialized and position == self.length, f"row {position} is not the next of {self.length}"
        if position + 1 >= self.slab.capacity:
            self.slab.grow(position + 2)
        return self.slab.keys, self.slab.values

    def wrote_row(self, position: int) -> None:
        self.length = position + 1
        self.slab.high_water = max(self.slab.high_water, self.length)
        self._expose()

    def _expose(self) -> None:
        self.keys = self.slab.keys[..., : self.length, :]
        self.values = self.slab.values[..., : self.length, :]

    def get_seq_length(self) -> int:
        return self.length

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("SlabLayer.crop takes a negative count, as DynamicLayer.crop does")
        if tokens_to_remove and self.is_initialized:
            self.length -= abs(tokens_to_remove)
            self._expose()

    def rewound(self, position: int) -> "SlabLayer":
        """A layer sharing this buffer, holding the first `position` rows; its writes land at
        `position` onwards, overwriting this layer's later rows (see the module docstring)."""
        assert 0 <= position <= self.length, f"cannot rewind {self.length} rows to {position}"
        out = SlabLayer(self.capacity, self.row_dtype)
        out.device, out.slab, out.is_initialized, out.length = self.device, self.slab, self.is_initialized, position
        if out.is_initialized:
            out._expose()
        return out

    def copied(self, position: int) -> "SlabLayer":
        """A layer with its own buffer holding a copy of the first `position` rows: a fork
        appends there and leaves this layer's rows untouched (memrad.engine.state.snapshot)."""
        assert 0 <= position <= self.length, f"cannot copy {position} of {self.length} rows"
        out = SlabLayer(self.capacity, self.row_dtype)
        if self.is_initialized:
            k, v = self.slab.keys, self.slab.values  # [1, H_kv, capacity, D]
            out.lazy_initialization(k[..., :0, :], v[..., :0, :])
            out.update(k[..., :position, :], v[..., :position, :])
        return out

    def reset(self) -> None:
        self.slab, self.length = None, 0
        super().reset()

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("memra runs one sequence per cache")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("memra runs one sequence per cache")


def all_slabs(cache) -> bool:
    """Whether every layer of `cache` is an initialised in-place layer (SlabLayer,
    WindowLayer, RecurrentLayer, HybridSlabLayer): what the decode step needs."""
    return all(getattr(layer, "steps_in_place", False) and layer.is_initialized for layer in cache.layers)


def resident_bytes(layer: SlabLayer) -> tuple[int, int]:
    """(buffer identity, bytes committed): rows ever written, not the reservation."""
    if layer.slab is None:
        return id(layer), 0
    return id(layer.slab), layer.slab.high_water * layer.slab.bytes_per_row
