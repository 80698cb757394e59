"""Cache state that outlives a request: snapshot, rebuild, size.

The only code that knows transformers' cache-layer internals (5.x):

  - Full attention: a SlabLayer (memrad.engine.state.kv; CPU) appends in place and never rewrites
    a row below its length; a DynamicLayer (CUDA) grows by torch.cat and never writes in
    place. Either way holding keys/values by reference is a free snapshot, and the first p
    rows are the exact state after p tokens (croppable). Rebuilding a SlabLayer at p hands
    its buffer on: the rebuilt cache overwrites rows p.., so a rebuild consumes the parked
    state (the engine checks the session out of the pool first). A fork (`copy=True`)
    copies rows :p into a fresh buffer instead and leaves the parked state intact.
  - Linear-attention / Mamba / conv layers (LinearAttention*Layer) update conv and
    recurrent state in place and have no per-position index: a snapshot must clone them,
    and a rebuild must clone again so the parked copy stays intact. `Cache.crop` cannot be
    trusted for them (it raises, or after activate_past_recording rewinds only conv state).
  - Sliding-window layers keep only the last window: not croppable; snapshots only. A
    WindowLayer (memrad.engine.state.window; CPU) appends in place like a SlabLayer, so a
    snapshot shares its buffer and a fork copies its window.

Shapes: keys/values [B=1, H_kv, T, D]; conv state [1, C, K]; recurrent state model-specific.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from memrad.engine.state.kv import SlabLayer, resident_bytes
from memrad.engine.state.shared import SharedLayer
from memrad.engine.state.window import WindowLayer

RECENT_BOUNDARIES = 4  # the newest boundary checkpoints kept at full density

_LINEAR_DICTS = ("conv_states", "recurrent_states")
_LINEAR_FLAGS = ("is_conv_states_initialized", "is_recurrent_states_initialized",
                 "has_previous_state", "conv_kernel_size")


def _is_linear(layer: Any) -> bool:
    return hasattr(layer, "recurrent_states")


def is_croppable(cache: Any) -> bool:
    """True when every layer is plain full attention (or holds nothing)."""
    from transformers.cache_utils import DummyLayer, DynamicLayer

    return all(type(layer) in (DynamicLayer, SlabLayer, DummyLayer, SharedLayer) for layer in cache.layers)


def _copy_layer(layer: Any) -> Any:
    """A copy sharing attention rows (never rewritten) and owning linear state."""
    out = copy.copy(layer)
    if _is_linear(layer):
        for name in _LINEAR_DICTS:
            setattr(out, name, {i: None if t is None else t.clone() for i, t in getattr(layer, name).items()})
        for name in _LINEAR_FLAGS:
            setattr(out, name, dict(getattr(layer, name)))
    return out


@dataclass(frozen=True)
class Snapshot:
    """The state of every layer after `num_tokens` tokens."""

    num_tokens: int
    layers: tuple[Any, ...]

    @classmethod
    def take(cls, cache: Any, num_tokens: int) -> "Snapshot":
        return cls(num_tokens, tuple(_copy_layer(layer) for layer in cache.layers))

    @classmethod
    def adopt(cls, cache: Any, num_tokens: int) -> "Snapshot":
        """Take ownership of a finished request's cache without copying anything."""
        return cls(num_tokens, tuple(cache.layers))


@dataclass(frozen=True)
class ParkedState:
    """What the engine keeps for a parked session.

    `final` is the state after all of the session's tokens; `snapshots` hold earlier
    positions whose non-croppable state was cloned during prefill.
    """

    final: Snapshot
    snapshots: dict[int, Snapshot] = field(default_factory=dict)
    croppable: bool = True

    def can_rebuild(self, position: int) -> bool:
        if self.croppable:
            return 0 < position <= self.final.num_tokens
        return position == self.final.num_tokens or position in self.snapshots

    def rebuild(self, config: Any, position: int, copy: bool = False) -> Any:
        """A cache holding exactly the state after `position` tokens.

        Without `copy`, consumes self where the attention layers are SlabLayers or WindowLayers: the rebuilt
        cache appends into the same buffers from `position` on. With `copy` (a fork), those
        rows are copied into new buffers and self stays intact. Cloned linear state is never
        shared; other layers (DynamicLayer, DynamicSlidingWindowLayer) never write in place.
        """
        from transformers import DynamicCache

        assert self.can_rebuild(position), f"no state for position {position}"
        source = self.snapshots.get(position, self.final)
        cache = DynamicCache(config=config)
        layers = [_copy_layer(layer) for layer in source.layers]
        if copy:
            layers = [layer.copied(position) if isinstance(layer, (SlabLayer, WindowLayer)) else layer
                      for layer in layers]
        if source.num_tokens != position:  # croppable: plain attention, views are free
            layers = [_rewound(layer, position) for layer in layers]
        cache.layers = layers
        return cache

    def below(self, position: int) -> dict[int, Snapshot]:
        """The snapshots at or below `position`: still exact after a rebuild at `position`
        (rows below it are never written again), so a successor may keep them."""
        return {p: snap for p, snap in self.snapshots.items() if p <= position}

    @property
    def num_bytes(self) -> int:
        return state_bytes([self.final, *self.snapshots.values()])


def thin_boundaries(positions: Iterable[int], anchors: tuple[int, ...]) -> set[int]:
    """Which boundary snapshots (positions that are reply anchors) a session keeps.

    The newest RECENT_BOUNDARIES, then geometric spacing further back: a boundary `age`
    anchors old keeps only if its anchor index is a multiple of 2^(bit_length(age) - 2), so
    about two per doubling of age survive. The rule only gets stricter as a boundary ages,
    so what a later turn keeps is always a subset of what it was handed (nothing dropped
    is ever needed again): O(RECENT + 2 log n) snapshots per session.
    """
    index = {a: i for i, a in enumerate(sorted(anchors))}
    kept = set()
    for p in positions:
        if p not in index:
            continue
        age = len(index) - index[p]
        if age <= RECENT_BOUNDARIES or index[p] % (1 << max(0, age.bit_length() - 2)) == 0:
            kept.add(p)
    return kept


def _rewound(layer: Any, position: int) -> Any:
    if isinstance(layer, SlabLayer):
        return layer.rewound(position)
    if getattr(layer, "keys", None) is not None:
        layer.keys = layer.keys[..., :position, :]
        layer.values = layer.values[..., :position, :]
    return layer


def _tensors(layer: Any) -> list[torch.Tensor]:
    found = [t for t in (getattr(layer, "keys", None), getattr(layer, "values", None)) if isinstance(t, torch.Tensor)]
    if _is_linear(layer):
        for name in _LINEAR_DICTS:
            found.extend(t for t in getattr(layer, name).values() if isinstance(t, torch.Tensor))
    return found


class _LinearPart:
    """The recurrent state of a layer that also holds slab rows, for `_tensors`."""

    def __init__(self, layer: Any) -> None:
        self.conv_states, self.recurrent_states = layer.conv_states, layer.recurrent_states


def state_bytes(snapshots: list[Snapshot]) -> int:
    """Bytes of the distinct storages the snapshots hold (shared views count once).

    A SlabLayer counts the rows ever written to its buffer: the untouched rest of its
    reservation holds no memory (memrad.engine.state.kv).
    """
    seen: dict[int, int] = {}
    for snap in snapshots:
        for layer in snap.layers:
            if isinstance(layer, (SlabLayer, WindowLayer)):
                key, num_bytes = resident_bytes(layer)
                seen[key] = num_bytes
                if not _is_linear(layer):  # a HybridSlabLayer also holds recurrent state
                    continue
                layer = _LinearPart(layer)
            for t in _tensors(layer):
                storage = t.untyped_storage()
                seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())
