"""Drafts from the context: the tokens a reply is likely to copy next, found in what it has seen.

A coding agent's reply copies what it was shown (a rewritten file, a diff's context lines, paths
and code quoted in tool arguments). So the continuation of the reply's last tokens, wherever those
tokens occurred before in the prompt or the reply so far, is a good guess at what comes next; the
engine verifies the guess as rows of one decode step (memrad.engine.speculation) and keeps only
what greedy decoding would have produced, so a wrong draft costs time, never output.

    tokens   t0 t1 ... ta tb tc  x  y  z ... ta tb tc |        (| : the end, the reply's last token tc)
                       \\______/  \\_____/
                       match     draft = the tokens that followed the earlier occurrence

The index keys every position by the 3 tokens that end there (`KEYS`): a lookup takes the
tail's last 3 tokens, then extends each of that key's most recent `CANDIDATES` earlier occurrences
backwards (up to `MAX_MATCH` tokens); the longest match wins, then the most recent. A draft is
no longer than its match (a copy earns its length as it runs). A tail whose last 3 tokens never
occurred before drafts nothing: on fresh text a 1- or 2-token match ("the", ", and") is mostly
chance, and each such draft costs a verify row that is thrown away (measured on the default
model's tokens: with keys of 1 and 2 tokens as well, 397 tokens of prose ran 16 verify steps, 15
kept nothing; with 3 only, 8 steps, 5 kept nothing; a file rewrite wasted 1 verify step of 87
instead of 13 of 100: docs/BENCHMARKS.md, Speculation). Pure Python over token ids; appending a token costs one dict update per key.

The index is kept with the parked session (memrad.reuse.pool.ParkedSession.drafts), covering
exactly its tokens, so the next turn of a conversation does not index its whole prompt again:

    parked     t0 ... tc  r0 ... rm                  (the prompt and the reply fed: the session's tokens)
    next turn  t0 ... tc  r0 ... rj  s0 ... sn       (the client's rendering of the reply, a new message)
               \\________________/
               shared: kept          cut: rj+1 ... rm    extended: s0 ... sn

`follow` does that in place (a resume that replaces its parent owns the parent's index), and
the result equals the index built from scratch over the new tokens, entry for entry. A fork
builds its own from scratch: copying the source's shared part costs about as much (measured:
`memrad bench draft-index`), and its source stays parked and unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from memrad.reuse.prefix_index import common_prefix_len

KEYS = (3,)  # key lengths tried, longest first: a shorter match drafts nothing
CANDIDATES = 32  # most recent occurrences of a key a lookup compares
MAX_MATCH = 32  # tokens a match is extended backwards, at most


class DraftIndex:
    """The context's tokens and, for each key length n, where every n-gram ended before.

    Mutates on `extend`, `follow` and `truncate`; `propose` only reads.

    Invariant: `_ends[n][gram]` lists, oldest first, each j < len(tokens) with
    tokens[j - n : j] == gram, so tokens[j] (the draft's first token) exists.
    """

    def __init__(self, tokens: Iterable[int] = ()) -> None:
        self.tokens: list[int] = []
        self._ends: dict[int, dict[tuple[int, ...], list[int]]] = {n: {} for n in KEYS}
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, DraftIndex) and self.tokens == other.tokens and self._ends == other._ends

    __hash__ = None  # mutable

    def follow(self, tokens: Sequence[int]) -> None:
        """Become the index of `tokens` (mutates): cut back to the prefix shared with them, then
        extend with the rest. Costs the tokens cut and added, not the tokens kept."""
        self.truncate(common_prefix_len(self.tokens, tokens))
        self.extend(tokens[len(self.tokens) :])

    def truncate(self, length: int) -> None:
        """Keep the first `length` tokens (mutates): the positions past them leave their keys,
        newest first, so each is the last entry of its list."""
        seq = self.tokens
        for j in range(len(seq) - 1, length - 1, -1):
            for n in KEYS:
                if j < n:
                    continue
                gram = tuple(seq[j - n : j])
                ends = self._ends[n][gram]
                ends.pop()
                if not ends:
                    del self._ends[n][gram]
        del seq[length:]

    def extend(self, tokens: Iterable[int]) -> None:
        """Append tokens (the prompt once, then each generated token). Each position j the
        new tokens take has a continuation (tokens[j]) now: what ends there is registered, in
        bulk (a 16k-token prompt in tens of milliseconds, before its first draft)."""
        seq = self.tokens
        old = len(seq)
        seq.extend(tokens)
        for n in KEYS:
            first = max(old, n)  # positions j in [first, len(seq)): the gram seq[j - n : j] ends there
            grams = zip(*(seq[first - n + i : len(seq) - n + i] for i in range(n)))
            ends = self._ends[n]
            for j, gram in zip(range(first, len(seq)), grams):
                ends.setdefault(gram, []).append(j)

    def propose(self, k: int) -> list[int]:
        """Up to `k` tokens that followed the longest earlier match of the tail (ties: the most
        recent), and no more than the match is long: a one-token match is weak evidence, a
        copy that has run for 8 tokens is strong; [] when the tail's last 3 tokens never
        occurred before or k < 1."""
        found = self.locate() if k >= 1 else None
        if found is None:
            return []
        start, length = found
        return self.tokens[start : start + min(k, length)]

    def locate(self) -> tuple[int, int] | None:
        """Where the longest earlier match of the tail ends (the position of the token that
        followed it: the draft's start) and how long it is; None where there is none."""
        seq, end = self.tokens, len(self.tokens)
        for n in KEYS:
            if end < n:
                continue
            ends = self._ends[n].get(tuple(seq[end - n :]))
            if not ends:
                continue
            best, best_len = -1, -1
            for j in reversed(ends[-CANDIDATES:]):  # most recent first: a tie keeps the newer
                length = _match_length(seq, j, end)
                if length > best_len:
                    best, best_len = j, length
            return best, best_len
        return None


def _match_length(seq: list[int], j: int, end: int) -> int:
    """How many tokens before position j equal those before `end` (at most MAX_MATCH)."""
    length = 0
    while length < MAX_MATCH and length < j and seq[j - 1 - length] == seq[end - 1 - length]:
        length += 1
    return length


class DraftLength:
    """How many tokens to draft next, from how the last drafts fared: doubles (up to `most`)
    when a whole draft was accepted, shrinks to what was accepted plus one otherwise; after a
    draft with nothing accepted at length 1, pauses speculation for a while (`paused`), doubling
    the pause on each further miss (up to MAX_PAUSE), so fresh generation stops paying for rows
    that are never kept. Mutates on `record`."""

    MAX_PAUSE = 64  # plain decode steps, at most, between two tries after misses

    def __init__(self, start: int = 8, most: int = 8) -> None:
        self.most = most
        self.k = min(start, most)
        self._pause = 0  # the pause a miss at length 1 sets
        self.paused = 0  # plain steps left before the next draft

    def record(self, drafted: int, accepted: int) -> None:
        """One verify step: `drafted` tokens offered, `accepted` of them kept."""
        if accepted == drafted:
            self.k = min(self.most, self.k * 2)
            self._pause = 0
        elif accepted == 0 and drafted <= 1:
            self._pause = min(self.MAX_PAUSE, max(1, 2 * self._pause))
            self.paused = self._pause
        else:
            self.k = max(1, accepted + 1)
            if accepted > 0:
                self._pause = 0

    def plain_step(self) -> None:
        """A step decoded without a draft (none found, or paused)."""
        if self.paused:
            self.paused -= 1
