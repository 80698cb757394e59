"""What may enter a log line: client strings made inert, repeated warnings thinned.

A client controls session names, `user`, `metadata.user_id`, model names and more. Written
raw, a newline forges a log line (`ERROR memrad.security: ...`) and an escape sequence is
replayed into the terminal of whoever runs `memrad logs`. `clean` makes any string one
printable line of bounded length; every client string goes through it on its way into a
log line.
"""

from __future__ import annotations

import logging
import time
from typing import Any

MAX_CHARS = 200


def clean(value: Any, max_chars: int = MAX_CHARS) -> str:
    """`value` as one printable line: control and non-printable characters backslash-escaped
    (\\n, \\x1b, \\u2028), cut to `max_chars` with the full length said."""
    text = value if isinstance(value, str) else str(value)
    cut = len(text) > max_chars
    head = text[:max_chars] if cut else text
    safe = "".join(c if c.isprintable() and c != "\\" else _escape(c) for c in head)
    return f"{safe}...({len(text)} chars)" if cut else safe


def _escape(c: str) -> str:
    if c == "\\":
        return "\\\\"
    return c.encode("unicode_escape").decode("ascii")


def quoted(value: Any, max_chars: int = MAX_CHARS) -> str:
    """`clean` in double quotes, for names inside a sentence."""
    return f'"{clean(value, max_chars)}"'


class RateLimitedLog:
    """At most one line per `every_s` per message template; the next one says how many were
    dropped. For events a client can cause at will (refused connections, accept failures)."""

    def __init__(self, logger: logging.Logger, every_s: float) -> None:
        self.logger = logger
        self.every_s = every_s
        self._last: dict[str, float] = {}
        self._dropped: dict[str, int] = {}

    def log(self, level: int, template: str, *args: Any) -> bool:
        """Log now or count it as dropped; True if it was logged."""
        now = time.monotonic()
        last = self._last.get(template)
        if last is not None and now - last < self.every_s:
            self._dropped[template] = self._dropped.get(template, 0) + 1
            return False
        self._last[template] = now
        dropped = self._dropped.pop(template, 0)
        suffix = f" ({dropped} more like this in the last {self.every_s:g} s not logged)" if dropped else ""
        self.logger.log(level, template + suffix, *args)
        return True

    def warning(self, template: str, *args: Any) -> bool:
        return self.log(logging.WARNING, template, *args)

    def info(self, template: str, *args: Any) -> bool:
        return self.log(logging.INFO, template, *args)
