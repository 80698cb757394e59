"""An index of parked sessions by token prefix: chained hashes of fixed token blocks.

The longest-prefix tier asks "which parked sessions share the longest token prefix with
this prompt?" with tens of sessions of thousands of tokens each. Comparing the prompt with
every session token by token is O(sessions x tokens) in Python per request; instead each
session's committed tokens are cut into blocks of BLOCK tokens and each block is hashed
together with everything before it (vLLM's prefix-caching scheme):

    tokens   |-- block 0 --|-- block 1 --|-- block 2 --|-- tail (< BLOCK, unindexed) --|
    hash     h0 = H(ns, b0) h1 = H(h0, b1) h2 = H(h1, b2)
    index    {h0: {s1, s4}, h1: {s1, s4}, h2: {s1}, ...}

Equal chained hashes mean equal prefixes (up to a 64-bit collision), so a lookup walks the
prompt's blocks until a hash is missing: the cost grows with the shared prefix, not with the
number of sessions. The chain is seeded with the namespace, so sessions of another model or
cache_salt never match. The index only proposes; the pool then compares the real tokens
(`PrefixIndex.lookup` returns block counts, a lower bound the caller verifies), so a
collision costs one comparison, never a wrong resume.

Mechanism only, not thread-safe on its own: the pool calls it under its lock.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator, Sequence

import xxhash

BLOCK = 32


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the common leading run of two token sequences: compared 256 tokens at a
    time (slice equality runs in C), then by bisection inside the first differing stretch."""
    if type(a) is not type(b):  # a tuple never equals a list slice
        a, b = tuple(a), tuple(b)
    n = min(len(a), len(b))
    at = 0
    while at < n:
        end = min(at + 256, n)
        if a[at:end] != b[at:end]:
            break
        at = end
    else:
        return n
    lo, hi = at, end  # a[:lo] == b[:lo], and a difference lies in [lo, hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo if a[lo] != b[lo] else hi


def _seed(namespace: object) -> int:
    return xxhash.xxh64_intdigest(repr(namespace).encode())


def block_hashes(namespace: object, token_ids: Sequence[int]) -> Iterator[int]:
    """The chained hash of every full block of `token_ids`, in order (lazily)."""
    h = _seed(namespace)
    data = memoryview(array("q", token_ids)).cast("B")  # one conversion; blocks are views
    step = BLOCK * 8
    for start in range(0, (len(token_ids) // BLOCK) * step, step):
        h = xxhash.xxh64_intdigest(data[start : start + step], seed=h)
        yield h


class PrefixIndex:
    def __init__(self) -> None:
        self._holders: dict[int, set[str]] = {}  # chained block hash -> session ids
        self._hashes: dict[str, list[int]] = {}  # session id -> its chained block hashes

    def add(self, session_id: str, namespace: object, token_ids: Sequence[int]) -> None:
        """Index a session's tokens (mutates)."""
        hashes = list(block_hashes(namespace, token_ids))
        self._hashes[session_id] = hashes
        for h in hashes:
            self._holders.setdefault(h, set()).add(session_id)

    def remove(self, session_id: str) -> None:
        """Forget a session (mutates); unknown ids are ignored."""
        for h in self._hashes.pop(session_id, ()):
            holders = self._holders.get(h)
            if holders is not None:
                holders.discard(session_id)
                if not holders:
                    del self._holders[h]

    def lookup(self, namespace: object, prompt_ids: Sequence[int]) -> dict[str, int]:
        """Session id -> how many leading blocks it shares with `prompt_ids` (>= 1).

        Does not mutate. A hash match is a claim: compare the real tokens before using it.
        """
        found: dict[str, int] = {}
        for num_blocks, h in enumerate(block_hashes(namespace, prompt_ids), start=1):
            holders = self._holders.get(h)
            if not holders:
                break
            for session_id in holders:
                found[session_id] = num_blocks
        return found

    def __len__(self) -> int:
        return len(self._hashes)
