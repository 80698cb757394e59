"""In-place KV storage for sliding-window layers on CPU (Gemma 3's local layers).

transformers' DynamicSlidingWindowLayer keeps the last W - 1 rows (W: the window) as a fresh
`torch.cat` per update, so a decode step copies the window on every token and has nowhere to
write its row in place. A WindowLayer keeps the same rows in a buffer of 2W rows and appends
in place; the decode step (memrad.engine.decode.steps.gemma) writes its row there and attends a
view of the last W rows, no copy:

    buffer  [1, H_kv, 2W, D]    | older rows | window: rows start .. end-1 (<= W - 1) | free |
    keys    = buffer[..., start:end, :]                       (a view; values alike)
    step    writes row `end`, attends buffer[..., start:end+1, :]   (<= W rows)

When the buffer is full, the window moves to a fresh buffer (W - 1 rows copied once every ~W
tokens): a buffer's rows are never rewritten below its end, so a snapshot holds a layer by
reference for free, exactly as a SlabLayer's (memrad.engine.state.snapshot). Rebuilding at a
snapshot consumes the longer state the same way: the rebuilt layer appends from the
snapshot's end over whatever a later state wrote there; a fork (`copied`) takes its own
buffer.

The state is still a window: rows before it are gone, so the cache is not croppable and
boundary snapshots keep their role (memrad.engine.parking). Prefill returns what transformers'
layer returns (`cat` of the window and the chunk), so prefill's bits are transformers' (over the
rows as kept: a bf16 window's chunk rounded, then both widened for fp32 queries); the disk
tier writes the window rows and the token count (memrad.engine.state.disk).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicSlidingWindowLayer

from memrad.engine.state.kv import Slab, reserve


def buffer_rows(window: int) -> int:
    """Rows of a window's buffer: fixed, since a compiled step is made for its strides."""
    return 2 * window


class WindowLayer(DynamicSlidingWindowLayer):
    """A sliding-window cache layer that appends in place (see the module docstring)."""

    steps_in_place = True  # the decode step writes its row itself (memrad.engine.state.kv.all_slabs)

    def __init__(self, sliding_window: int, row_dtype: torch.dtype | None = None) -> None:
        super().__init__(sliding_window)
        self.row_dtype = row_dtype  # the rows' dtype (memrad.engine.state.kv.SlabLayer); None: the first rows' own
        self.slab: Slab | None = None
        self.start = self.end = 0  # the kept window: buffer rows [start, end)

    @property
    def kept(self) -> int:
        return self.sliding_window - 1  # rows a later token still sees, as transformers keeps

    def _new_buffer(self, like_keys: torch.Tensor, like_values: torch.Tensor, rows: int) -> None:
        b, h, _, d = like_keys.shape
        capacity = buffer_rows(self.sliding_window)
        assert rows < capacity, f"{rows} rows do not fit a window of {self.sliding_window}"
        dtype = self.row_dtype or like_keys.dtype
        self.slab = Slab(reserve((b, h, capacity, d), dtype, like_keys.device),
                          reserve((b, like_values.shape[1], capacity, like_values.shape[3]), dtype, like_values.device))

    def _place(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Start a fresh buffer holding rows `keys`, `values` [1, H_kv, n, D] as the window."""
        n = keys.shape[-2]
        self._new_buffer(keys, values, n)
        self.slab.keys[..., :n, :].copy_(keys)
        self.slab.values[..., :n, :].copy_(values)
        self.start, self.end = 0, n
        self.slab.high_water = n

    @torch.inference_mode()  # the buffers are inference tensors (see kv.reserve)
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.device, self.is_initialized = key_states.device, True
            self._sliding_window_tensor = self._sliding_window_tensor.to(self.device)
            self._place(key_states[..., :0, :], value_states[..., :0, :])
            self._expose()
        self.cumulative_length += key_states.shape[-2]
        # What transformers attends, as stored (bf16 rows: the chunk rounded as its rows are kept)
        full_keys = torch.cat([self.keys, key_states.to(self.keys.dtype)], dim=-2)
        full_values = torch.cat([self.values, value_states.to(self.values.dtype)], dim=-2)
        new = key_states.shape[-2]
        if self.end + new <= self.slab.capacity:
            self.slab.keys[..., self.end:self.end + new, :].copy_(key_states)
            self.slab.values[..., self.end:self.end + new, :].copy_(value_states)
            self.end += new
            self.slab.high_water = max(self.slab.high_water, self.end)
            self.start = max(self.start, self.end - self.kept)
        else:
            kept = min(self.kept, full_keys.shape[-2])
            self._place(full_keys[..., full_keys.shape[-2] - kept:, :], full_values[..., full_values.shape[-2] - kept:, :])
        self._expose()
        return full_keys.to(key_states.dtype), full_values.to(value_states.dtype)  # widened for fp32 queries

    def step_buffers(self, position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views [1, H_kv, n, D] of the window and one free row after it (n <= W), for a
        decode step that writes its row as the last one; `wrote_row` records it."""
        assert self.is_initialized and position == self.cumulative_length, (
            f"row {position} is not the next of {self.cumulative_length}")
        if self.end >= self.slab.capacity:
            self._place(self.keys, self.values)  # fresh buffer: earlier snapshots keep the old one
        rows = slice(self.start, self.end + 1)
        return self.slab.keys[..., rows, :], self.slab.values[..., rows, :]

    def wrote_row(self, position: int) -> None:
        self.cumulative_length = position + 1
        self.end += 1
        self.slab.high_water = max(self.slab.high_water, self.end)
        self.start = max(self.start, self.end - self.kept)
        self._expose()

    def _expose(self) -> None:
        self.keys = self.slab.keys[..., self.start:self.end, :]
        self.values = self.slab.values[..., self.start:self.end, :]

    @torch.inference_mode()
    def restore(self, keys: torch.Tensor, values: torch.Tensor, num_tokens: int) -> "WindowLayer":
        """This (blank) layer holding window rows `keys`, `values` after `num_tokens` tokens
        (the disk tier's form of the layer)."""
        self.device, self.is_initialized = keys.device, True
        self._sliding_window_tensor = self._sliding_window_tensor.to(self.device)
        self._place(keys, values)
        self.cumulative_length = num_tokens
        self._expose()
        return self

    def copied(self, position: int) -> "WindowLayer":
        """A layer with its own buffer holding this window: a fork appends there and leaves
        this layer's rows untouched (memrad.engine.state.snapshot)."""
        assert position == self.cumulative_length, f"a window after {self.cumulative_length} tokens is not at {position}"
        out = WindowLayer(self.sliding_window, self.row_dtype)
        return out.restore(self.keys, self.values, position) if self.is_initialized else out

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove:
            raise ValueError("a sliding-window layer keeps only its window: it cannot be cut back")

    def reset(self) -> None:
        self.slab, self.start, self.end, self.cumulative_length = None, 0, 0, 0
        self.keys = self.values = None
        self.is_initialized = False

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("memra runs one sequence per cache")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("memra runs one sequence per cache")
