"""A request whose prompt extends (or equals) the prompt of one still on the model: where it
forks that one's live state instead of priming the same tokens beside it. Pure.

A client whose idle timer fires mid-prefill retries the same prompt at once; a client that
reconnects re-sends it. Before the first request's cancel lands (or while it is still
wanted), nothing is parked yet, so the pool offers nothing and the retry would prime the
whole prompt a second time beside the first. Instead it attaches:

    running  A  prompt ............................................|      primed so far: at
    retry    B  prompt ............................................|+ (B's own tail)
                0        C        2C   ...        target = the last cut <= len(A) with a
                                                           token of B left to prime
    B waits (queued, costing nothing) until A's prefill passes target, then forks A's rows
    :target (a copy; A goes on untouched) and primes [target, len(B)) on the grid. If A ends
    first (its client gone: the cancel parks its prefix, grid-aligned), B is planned against
    the pool as usual and resumes what A parked.

Either way B's state up to target came from canonical grid chunks of the same tokens, so in
exact mode B's reply is bit-identical to a cold run's. The pool is never involved in a
fork (A is not parked), so its invariants do not change.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from memrad.grid import cut_floor


@dataclass(frozen=True, slots=True)
class Attachment:
    """A request attached to `source_id`'s prefill: that request's prompt length, how far it
    had primed when this one arrived (`at`), and the cut this one forks at (`target`)."""

    source_id: str
    source_tokens: int
    at: int
    target: int

    def forked(self, primed: int) -> str:
        """The reason of a decision that forked the source's live state."""
        return (f"attached to a running prefill at {self.at:,} of {self.source_tokens:,} ({self.source_id}); "
                f"forked at {self.target:,}; primed {primed:,}")

    def ended(self, reason: str) -> str:
        """The reason of a decision planned after the source ended before reaching `target`."""
        return (f"attached to a running prefill at {self.at:,} of {self.source_tokens:,} ({self.source_id}), "
                f"which ended first; {reason}")


def fork_point(prompt: Sequence[int], anchors: tuple[int, ...], source_prompt: Sequence[int], chunk: int) -> int | None:
    """The cut where a request with `prompt` (reply anchors `anchors`) can fork the state of
    one with `source_prompt`: the last cut at or below the source's prompt that leaves at
    least one token to prime. None unless `prompt` extends or equals `source_prompt`, or when
    that cut is 0."""
    n = len(source_prompt)
    if n > len(prompt) or tuple(prompt[:n]) != tuple(source_prompt):
        return None
    target = cut_floor(min(n, len(prompt) - 1), chunk, anchors)
    return target if target > 0 else None
