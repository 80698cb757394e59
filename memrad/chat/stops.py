"""Stop strings over a stream of text deltas.

Text that could still grow into a stop string is held back, so a client never sees the
first half of a stop string that then matches.
"""

from __future__ import annotations


class StopMatcher:
    """Feed text deltas; get back what is safe to emit. Mutates its own buffer only."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self._stops = tuple(s for s in stops if s)
        self._held = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text

    def feed(self, delta: str) -> str:
        """Return the text that can be sent now; sets `stopped` once a stop string matches."""
        if self.stopped:
            return ""
        text = self._held + delta
        found = [(i, s) for s, i in ((s, text.find(s)) for s in self._stops) if i >= 0]
        cut = min(found)[0] if found else -1
        if cut >= 0:
            self.matched = min(found)[1]
            self._held = ""
            self.stopped = True
            return text[:cut]
        keep = longest_partial_suffix(text, self._stops)
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]

    def flush(self) -> str:
        """At the end of generation, whatever was held back is plain text after all."""
        held, self._held = self._held, ""
        return "" if self.stopped else held


def longest_partial_suffix(text: str, patterns: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `patterns`."""
    best = 0
    for pattern in patterns:
        for n in range(min(len(pattern) - 1, len(text)), best, -1):
            if text.endswith(pattern[:n]):
                best = n
                break
    return best
