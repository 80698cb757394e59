"""Kill-9 injection points: `MEMRA_FAULT_KILL=<point>` makes the process SIGKILL itself when
it reaches that point, so a crash lands exactly there, every time (`memrad bench faults
kill9 --at POINT`, tests/unit/test_crash_points.py). Unset, a point costs one dict lookup.

Points (each names the write step it interrupts):
  spill-tmp       a spill's temp file is written, not yet fsynced
  spill-rename    the temp file is fsynced, not yet renamed over its final name
  spill-renamed   the file has its final name, the tier has not recorded it yet
"""

from __future__ import annotations

import os
import signal

POINTS = ("spill-tmp", "spill-rename", "spill-renamed")


def kill_point(name: str) -> None:
    """SIGKILL this process here if MEMRA_FAULT_KILL names this point."""
    assert name in POINTS, name
    if os.environ.get("MEMRA_FAULT_KILL") == name:
        os.kill(os.getpid(), signal.SIGKILL)
