"""Files only their owner can read: prompts end up in the log, in `--record` recordings and
in parked state, and another local user must not read them.

New files are created 0600 and new directories 0700 (whatever the umask); memrad's own
directories (`tighten`) are also narrowed when they already exist. A directory the user
named (a recording's folder, /tmp) is never chmod-ed: only the file memrad writes is.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import IO

FILE_MODE = 0o600
DIR_MODE = 0o700


def private_dir(path: Path, tighten: bool = False) -> Path:
    """Create `path` and any missing parents as 0700; with `tighten`, narrow `path` itself
    to 0700 if it exists with wider permissions."""
    path = Path(path)
    missing = []
    probe = path
    while not probe.exists():
        missing.append(probe)
        probe = probe.parent
    for directory in reversed(missing):
        try:
            directory.mkdir(mode=DIR_MODE)
        except FileExistsError:
            pass
        os.chmod(directory, DIR_MODE)  # mkdir's mode is masked by the umask
    if tighten and not missing and path.stat().st_mode & 0o077:
        os.chmod(path, DIR_MODE)
    return path


def open_private(path: Path, mode: str = "ab", tighten_dir: bool = False) -> IO:
    """Open `path` for writing ("ab", "a", "wb", "w"), created 0600; an existing file is
    narrowed to 0600 too (an old world-readable log keeps no prompt readable)."""
    path = Path(path)
    private_dir(path.parent, tighten=tighten_dir)
    flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if mode.startswith("a") else os.O_TRUNC)
    fd = os.open(path, flags, FILE_MODE)
    try:
        os.fchmod(fd, FILE_MODE)
        return os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"}))
    except BaseException:
        os.close(fd)
        raise
