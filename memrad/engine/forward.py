"""The two model steps: prefill on the canonical grid, and one-token decode.

Shapes at the boundary: input_ids [1, T], position_ids [1, T], logits out [V] (last
position only). The cache is a transformers `Cache` mutated in place. Positions are passed
explicitly: after a rebuild the cache's own length bookkeeping is not trusted, and
Mamba2-only caches cannot report a length at all.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from memrad.grid import canonical_chunks, relative_chunks


def cache_length(cache) -> int | None:
    """Tokens the cache holds, or None where it cannot tell (recurrent-only caches)."""
    try:
        return int(cache.get_seq_length())
    except (NotImplementedError, AttributeError, TypeError, ValueError):
        return None


def crop_to(cache, length: int) -> None:
    """Drop every row past `length` from a croppable cache (plain or in-place attention layers)."""
    extra = cache_length(cache) - length
    if extra > 0:
        cache.crop(-extra)


def _check_position(cache, position: int) -> None:
    known = cache_length(cache)
    assert known is None or known == position, f"cache holds {known} tokens, expected {position}"


@torch.inference_mode()
def prefill(model, cache, token_ids: Sequence[int], start: int, chunk: int,
            cancelled: Callable[[], bool] = lambda: False,
            after_chunk: Callable[[int], None] | None = None, on_grid: bool = True,
            anchors: tuple[int, ...] = ()) -> torch.Tensor | None:
    """Prime absolute positions [start, start + len(token_ids)) into `cache`.

    `cache` must hold exactly `start` tokens. Chunks are cut at absolute multiples of
    `chunk` and at `anchors` (see memrad.grid), so a resumed prefill runs the same shapes as a cold one;
    `on_grid=False` counts chunks from `start` instead (fast mode: fewer chunks, no
    exactness). `after_chunk(end)` runs after each chunk (snapshots hook in here). Returns the last
    position's logits [V] in float32, or None if cancelled between chunks.
    """
    _check_position(cache, start)
    assert len(token_ids) > 0, "prefill needs at least one token"
    ids = torch.tensor(token_ids, dtype=torch.long, device=model.device)
    logits = None
    for a, b in prefill_spans(start, start + len(token_ids), chunk, on_grid, anchors):
        if cancelled():
            return None
        logits = prefill_span(model, cache, ids, start, a, b)
        if after_chunk is not None:
            after_chunk(b)
    return logits.float()


def prefill_spans(start: int, end: int, chunk: int, on_grid: bool = True,
                  anchors: tuple[int, ...] = ()) -> list[tuple[int, int]]:
    """The chunks `prefill` runs for absolute positions [start, end): on the grid (exact) or
    counted from `start` (fast). The engine's scheduler runs them one iteration at a time."""
    return canonical_chunks(start, end, chunk, anchors) if on_grid else relative_chunks(start, end, chunk)


@torch.inference_mode()
def prefill_span(model, cache, ids: torch.Tensor, offset: int, a: int, b: int) -> torch.Tensor:
    """Prime absolute positions [a, b) of `ids` [N] (ids[0] is position `offset`) into `cache`,
    which holds exactly `a` tokens; the last position's logits [V] in the model's dtype."""
    input_ids = ids[a - offset : b - offset].unsqueeze(0)  # [1, T]
    position_ids = torch.arange(a, b, device=ids.device).unsqueeze(0)  # [1, T]
    out = model(input_ids=input_ids, position_ids=position_ids, cache=cache, use_cache=True, logits_to_keep=1)
    return out.logits[0, -1]  # [V]


@torch.inference_mode()
def decode_one_token(model, cache, token_id: int, position: int) -> torch.Tensor:
    """Feed one token at absolute `position`; return the next-token logits [V] in float32."""
    _check_position(cache, position)
    device = model.device
    input_ids = torch.tensor([[token_id]], dtype=torch.long, device=device)  # [1, 1]
    position_ids = torch.tensor([[position]], dtype=torch.long, device=device)  # [1, 1]
    out = model(input_ids=input_ids, position_ids=position_ids, cache=cache, use_cache=True)
    return out.logits[0, -1].float()  # [V]
