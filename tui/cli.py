"""memra-tui entry point.

The inspector attaches to the daemon's control socket (memrad.protocol records). The
socket and its records exist; the Textual app that draws them is the next step. Until it
lands this says so rather than drawing an empty UI.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    print("memra-tui's screens are not built yet. The daemon's control socket already serves "
          "what they will show: `memrad status` prints its path; send {\"op\": \"snapshot\"} or "
          "{\"op\": \"subscribe\"} as a JSON line (e.g. with `socat - UNIX-CONNECT:PATH`). "
          "`memrad logs -f` shows every decision meanwhile.", file=sys.stderr)
    return 1
