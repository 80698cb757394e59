"""The canonical prefill grid: where prefill chunks are cut, cold or resumed.

Without anchors: at absolute multiples of the chunk size C. In exact mode also at every
reply anchor (the position right after a reply header such as "<|im_start|>assistant\n",
where the reply's own tokens begin), and the grid restarts there: cuts fall at an anchor
and then every C tokens after it, up to the next anchor.

A resume starts mid-conversation, so a naive engine would cut its chunks at different
places than a cold run and change the logits in their last bits. Cutting at absolute
grid positions makes every chunk after the first grid point the same shape over the same
inputs, cold or resumed:

    positions   0        C        2C       3C
                |--------|--------|--------|-----|      cold: [0,C) [C,2C) [2C,3C) [3C,end)
    resume at C          |--------|--------|-----|      same chunks from C on
    start=s (off-grid)     |------|--------|-----|      [s,2C) then on the grid

Why anchors: a prompt ends with the header of the reply it asks for, and a client that
rewrites that reply keeps everything up to the header. Cutting there makes the prompt's
end an exact checkpoint, so an exact resume re-primes from the reply itself instead of
from the last multiple of C (up to C-1 tokens earlier); restarting the grid there makes a
resumed suffix of up to C tokens one chunk, the same shape every turn:

    turn N     0 ... |--C--|--C--|----hdr|                   a = P (turn N's prompt end)
    turn N+1   0 ... |--C--|--C--|----hdr|reply' user .. hdr|    one chunk [a, P')
                                         ^ a: resume here; rows before a were cut the same way

The cuts below a position depend only on the tokens before it, so two prompts that agree
up to a cut chunk everything below it identically. A header the tokenizer merges with the
reply's first characters is simply not found: that prompt then has no anchor there, and
the planner (which compares both prompts' anchors) falls back to a lower cut.
"""

from __future__ import annotations


def grid_chunks(start: int, end: int, chunk: int) -> list[tuple[int, int]]:
    """Half-open spans covering [start, end), cut at every multiple of `chunk`."""
    return canonical_chunks(start, end, chunk)


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


def find_anchors(token_ids, header: tuple[int, ...]) -> tuple[int, ...]:
    """Positions right after each occurrence of `header` (a reply header's ids); () for none."""
    if not header:
        return ()
    n, first = len(header), header[0]
    return tuple(i + n for i, t in enumerate(token_ids) if t == first and tuple(token_ids[i : i + n]) == header)


def canonical_chunks(start: int, end: int, chunk: int, anchors: tuple[int, ...] = ()) -> list[tuple[int, int]]:
    """Half-open spans covering [start, end), cut at every cut of `anchors` (see the module
    docstring); with no anchors, at every multiple of `chunk`."""
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    if not 0 <= start <= end:
        raise ValueError(f"need 0 <= start <= end, got start={start} end={end}")
    spans = []
    a = start
    while a < end:
        b = min(cut_floor(a, chunk, anchors) + chunk, *(x for x in anchors if x > a), end)
        spans.append((a, b))
        a = b
    return spans


def _base(position: int, anchors: tuple[int, ...]) -> int:
    """Where the grid restarted last at or below `position`: an anchor, or 0."""
    return max((a for a in anchors if a <= position), default=0)


def is_cut(position: int, chunk: int, anchors: tuple[int, ...] = ()) -> bool:
    return (position - _base(position, anchors)) % chunk == 0


def cut_floor(position: int, chunk: int, anchors: tuple[int, ...] = ()) -> int:
    """The last cut at or below `position`."""
    base = _base(position, anchors)
    return base + grid_floor(position - base, chunk)


def cuts_up_to(limit: int, chunk: int, anchors: tuple[int, ...] = ()) -> list[int]:
    """Every cut in (0, limit], ascending."""
    bases = [0, *(a for a in anchors if 0 < a <= limit)]
    found = []
    for base, stop in zip(bases, [*bases[1:], limit + 1]):
        found += [c for c in range(base, stop, chunk) if c > 0]
    return found
