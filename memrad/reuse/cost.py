"""What a resume costs, in tokens: the unit the planner compares offers in. Pure.

A resume from checkpoint c of a P-token prompt primes prompt[c:], and a fork (another
conversation's state) first copies the c rows it reuses into buffers of its own:

    positions  0                     c                 P
               |------ reused -------|---- primed -----|
    fork       |== copied (c rows) ==|                      replace: the rows are handed on

Both are priced in *primed tokens at position 0*: a token primed at position p costs
1 + p / ATTENTION_SPAN of them (its attention reads every row before it), and a fork's copy
costs one per COPY_ROWS_PER_TOKEN rows. So more reuse from the same kind of resume is always
cheaper, a fork always beats priming from zero, and a fork that reuses a few more tokens
than the request's own conversation offers, at the price of copying every row below them,
loses to the replace (memrad.reuse.planner). The constants are measured, not exact: default
model, bf16, chunk 256, 2 threads, Intel Xeon with AMX (docs/BENCHMARKS.md, Reuse and
affinity: What a resume costs): priming cost 0.90 / 1.37 / 2.73 ms a token at 512 / 2k / 8k
of context, a fork's copy 10.9 us a row (fresh pages: the copy is page faults, ~2 GB/s).
"""

from __future__ import annotations

ATTENTION_SPAN = 3200        # positions at which a primed token costs twice a token at position 0
COPY_ROWS_PER_TOKEN = 64     # rows a fork copies for the price of one token primed at position 0


def prime_cost(start: int, end: int) -> int:
    """Priming positions [start, end): sum over p of (1 + p / ATTENTION_SPAN), rounded down."""
    n = max(end - start, 0)
    return n + n * (start + end - 1) // (2 * ATTENTION_SPAN) if n else 0


def copy_cost(num_rows: int) -> int:
    """Copying `num_rows` rows into a fork's own buffers (rounded up: a copy is never free)."""
    return -(-num_rows // COPY_ROWS_PER_TOKEN)


def resume_cost(checkpoint: int, num_prompt: int, copied_rows: int) -> int:
    """A resume at `checkpoint` of a `num_prompt`-token prompt that copies `copied_rows` rows
    first (0: a replace, a cold start, or a fork of state just loaded from disk)."""
    return prime_cost(checkpoint, num_prompt) + copy_cost(copied_rows)
