"""The canonical prefill grid: chunks are cut at absolute multiples of the chunk size.

A resume starts mid-conversation, so a naive engine would cut its chunks at different
places than a cold run and change the logits in their last bits. Cutting at absolute
grid positions makes every chunk after the first grid point the same shape over the same
inputs, cold or resumed:

    positions   0        C        2C       3C
                |--------|--------|--------|-----|      cold: [0,C) [C,2C) [2C,3C) [3C,end)
    resume at C          |--------|--------|-----|      same chunks from C on
    start=s (off-grid)     |------|--------|-----|      [s,2C) then on the grid
"""

from __future__ import annotations


def grid_chunks(start: int, end: int, chunk: int) -> list[tuple[int, int]]:
    """Half-open spans covering [start, end), cut at every multiple of `chunk`."""
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    if not 0 <= start <= end:
        raise ValueError(f"need 0 <= start <= end, got start={start} end={end}")
    spans = []
    a = start
    while a < end:
        b = min((a // chunk + 1) * chunk, end)
        spans.append((a, b))
        a = b
    return spans


def grid_floor(position: int, chunk: int) -> int:
    """The last grid position at or below `position`."""
    return position - position % chunk


def relative_chunks(start: int, end: int, chunk: int) -> list[tuple[int, int]]:
    """Spans of `chunk` tokens counted from `start`: fewer, fuller chunks, off the grid.

    Fast mode uses these for a resumed suffix, since it promises no bit-exactness: priming
    231 tokens from 2426 takes one chunk instead of [2426, 2560) + [2560, 2657).
    """
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    return [(a, min(a + chunk, end)) for a in range(start, end, chunk)]
