"""memra-tui entry point.

The inspector attaches to the daemon's control socket, which lands together with the
records it shows (parked sessions, decisions). Until then it says so rather than drawing
an empty UI.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    print("memra-tui needs a running memrad daemon with a control socket, and this build's "
          "daemon does not open one yet. Meanwhile `memrad status` and `memrad logs -f` show "
          "what the daemon is doing.", file=sys.stderr)
    return 1
