"""Where memrad keeps its files: platformdirs runtime, state, log, cache and config dirs."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import platformdirs

from memrad.protocol import runtime_base

APP = "memra"


class UnsafeRuntimeDir(RuntimeError):
    """No owner-only directory for the lock, pidfile and socket; the message says what to do."""


def runtime_dir() -> Path:
    """The owner-only (0700) directory of the lock, the pidfile and the control socket, all
    three (memrad.protocol.runtime_base decides; the TUI finds the socket the same way).
    Raises UnsafeRuntimeDir if even the fallback is not ours."""
    base = Path(runtime_base()[0])
    path = base / APP
    for directory in (base, path):
        directory.mkdir(exist_ok=True, mode=0o700)
        # The base may be a link to a directory of ours (some systems link XDG_RUNTIME_DIR);
        # memra's own folder inside it may not.
        st = directory.stat() if directory == base else directory.lstat()
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            raise UnsafeRuntimeDir(
                f"{directory} is not a directory of yours, so memrad has no private place for its lock, "
                "pidfile and socket: set XDG_RUNTIME_DIR to an owner-only (chmod 700) directory you own")
        if stat.S_IMODE(st.st_mode) != 0o700:
            directory.chmod(0o700)  # ours: mkdir's mode was masked by the umask, or it was made open
    return path


def runtime_dir_note() -> str | None:
    """Said at start when $XDG_RUNTIME_DIR was passed over, and where the files went instead."""
    why = runtime_base()[1]
    return None if why is None else f"{why}: the lock, pidfile and socket are in {runtime_dir()} instead"


def state_dir() -> Path:
    path = Path(platformdirs.user_state_dir(APP))
    path.mkdir(parents=True, exist_ok=True)
    return path


def log_dir() -> Path:
    path = Path(platformdirs.user_log_dir(APP))
    path.mkdir(parents=True, exist_ok=True)
    return path


def cache_dir() -> Path:
    """Converted models live here; override with MEMRA_CACHE_DIR."""
    path = Path(os.environ.get("MEMRA_CACHE_DIR") or platformdirs.user_cache_dir(APP))
    path.mkdir(parents=True, exist_ok=True)
    return path


def sessions_dir() -> Path:
    """The disk tier's files: platformdirs' cache dir, NOT MEMRA_CACHE_DIR (models stay put
    when a harness gives each daemon its own XDG_CACHE_HOME)."""
    return Path(platformdirs.user_cache_dir(APP)) / "sessions"


def config_dir() -> Path:
    return Path(platformdirs.user_config_dir(APP))


def pidfile_path() -> Path:
    return runtime_dir() / "memrad.pid"


def lockfile_path() -> Path:
    return runtime_dir() / "memrad.lock"


def socket_path() -> Path:
    return runtime_dir() / "memrad.sock"


def stop_report_path() -> Path:
    """What a stopping daemon could not save, for the `memrad stop` that stopped it."""
    return runtime_dir() / "memrad.stopped"


def log_path() -> Path:
    return log_dir() / "memrad.log"
