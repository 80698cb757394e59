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
    """`value` as one printable line: backslashes, control and non-printable characters
    backslash-escaped (\\n, \\x1b, \\u2028), cut to `max_chars` with the full length said."""
    text = value if isinstance(value, str) else str(value)
    cut = len(text) > max_chars
    safe = one_line(text[:max_chars] if cut else text, escape_backslash=True)
    return f"{safe}...({len(text)} chars)" if cut else safe


def one_line(text: str, escape_backslash: bool = False) -> str:
    """`text` with every non-printable character (newline, escape, U+2028...) escaped."""
    if text.isprintable() and not (escape_backslash and "\\" in text):
        return text
    return "".join(c if c.isprintable() and not (escape_backslash and c == "\\")
                   else "\\\\" if c == "\\" else c.encode("unicode_escape").decode("ascii") for c in text)


def quoted(value: Any, max_chars: int = MAX_CHARS) -> str:
    """`clean` in double quotes, for names inside a sentence."""
    return f'"{clean(value, max_chars)}"'


class SafeFormatter(logging.Formatter):
    """The daemon's log format, made injection-proof at the last step: a record's message is
    escaped to one line whatever its arguments hold, and the lines a traceback adds are
    indented, so a line at column 0 is always the start of a real record."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = one_line(record.message)
        return super().formatMessage(record)

    def format(self, record: logging.LogRecord) -> str:
        return super().format(record).replace("\n", "\n    ")


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
