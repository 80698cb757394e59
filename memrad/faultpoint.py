"""Kill-9 injection points: `MEMRA_FAULT_KILL=<point>` makes the process SIGKILL itself when
it reaches that point, so a crash lands exactly there, every time (`memrad bench faults
kill9 --at POINT`, tests/unit/test_crash_points.py). Unset, a point costs one dict lookup.

Points (each names the write step it interrupts):
  spill-tmp       a spill's temp file is written, not yet fsynced
  spill-rename    the temp file is fsynced, not yet renamed over its final name
  spill-renamed   the file has its final name, the tier has not recorded it yet
  pull-staged     `memrad pull`: the converted weights and tokenizer are in the staging
                  folder, not yet verified, no block caches, no marker
  pull-publish    the staging folder is complete (marker written), not yet renamed into place
  package-staged  the compile child (memrad.engine.decode.builder): the package's staging
                  .pt2 is written, its constants are not
  package-rename  the constants have their final name, the package's staging file not yet
"""

from __future__ import annotations

import os
import signal

POINTS = ("spill-tmp", "spill-rename", "spill-renamed", "pull-staged", "pull-publish", "package-staged",
          "package-rename")


def kill_point(name: str) -> None:
    """SIGKILL this process here if MEMRA_FAULT_KILL names this point."""
    assert name in POINTS, name
    if os.environ.get("MEMRA_FAULT_KILL") == name:
        os.kill(os.getpid(), signal.SIGKILL)
