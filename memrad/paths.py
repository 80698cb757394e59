"""Where memrad keeps its files: platformdirs runtime, state, log, cache and config dirs."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import platformdirs

APP = "memra"


def _runtime_dir() -> Path:
    with warnings.catch_warnings():
        # Without XDG_RUNTIME_DIR platformdirs falls back to /tmp/runtime-$UID and warns.
        warnings.simplefilter("ignore")
        return Path(platformdirs.user_runtime_dir(APP))


def runtime_dir() -> Path:
    """Owner-only directory for the pidfile, lock and control socket."""
    path = _runtime_dir()
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    return path


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
