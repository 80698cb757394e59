"""The daemon's life: one instance per user (a held lock), a pidfile that says where it
serves, graceful stop on SIGTERM, and cleanup of what a killed daemon left behind."""

from __future__ import annotations

import asyncio
import fcntl
import json
import logging
import logging.handlers
import os
import signal
import stat
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from memrad.config import Settings
from memrad.loglines import SafeFormatter
from memrad.private import open_private
from memrad.paths import lockfile_path, log_path, pidfile_path, runtime_dir_note, socket_path, stop_report_path

log = logging.getLogger("memrad")

DETACHED_ENV = "MEMRA_DETACHED"


class AlreadyRunning(RuntimeError):
    pass


class StartupError(RuntimeError):
    """The daemon cannot start; the message says what to do."""


@dataclass(frozen=True, slots=True)
class DaemonInfo:
    """The pidfile's contents. `url` is None while the model is still loading."""

    pid: int
    started_at: float
    log: str
    url: str | None = None
    model: str | None = None
    device: str | None = None
    socket: str | None = None

    def write(self, path: Path) -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self)))
        tmp.replace(path)

    @classmethod
    def read(cls, path: Path) -> "DaemonInfo | None":
        try:
            return cls(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            return None


@dataclass(frozen=True, slots=True)
class StopReport:
    """Written by a daemon whose stop lost parked sessions, read by `memrad stop`."""

    pid: int
    unsaved: list[str]  # one line per session: "s3 (812 tokens): why"

    def write(self, path: Path) -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self)))
        tmp.replace(path)

    @classmethod
    def take(cls, path: Path, pid: int) -> "StopReport | None":
        """The report of daemon `pid` (removed once read), or None."""
        try:
            report = cls(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            return None
        path.unlink(missing_ok=True)
        return report if report.pid == pid else None


def lock_holder() -> int | None:
    """The pid holding the daemon lock, from the kernel's lock table (None: free, or no
    /proc/locks here). The lock, not the pidfile, says which process the daemon is."""
    try:
        st = os.stat(lockfile_path())
        key = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
        with open("/proc/locks") as table:
            for line in table:
                fields = line.split()
                if len(fields) > 5 and fields[1] == "FLOCK" and fields[5] == key:
                    return int(fields[4])
    except (OSError, ValueError):
        return None
    return None


def is_memrad(pid: int) -> bool:
    """Whether `pid` is the memrad daemon: the holder of the lock where the kernel says, else
    a process whose command line is `... memrad start ...`. Checked before any signal."""
    holder = lock_holder()
    if holder is not None:
        return holder == pid
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"start" in argv and any(Path(os.fsdecode(a)).name == "memrad" for a in argv)


def clean_stale_files() -> list[Path]:
    """Remove the pidfile and the default socket a killed daemon left; return what was removed.

    Call only while holding the lock, so a daemon that is starting cannot lose its pidfile.
    Only what memrad made is removed: the pidfile if it is a file, the socket only if it is a
    socket nobody answers on. A path named inside the pidfile is never deleted, and anything
    else at the socket path is left for the start to refuse with its reason.
    """
    from memrad.server.control import ControlSocketError, remove_stale_socket

    removed = []
    pidfile = pidfile_path()
    try:
        if not stat.S_ISDIR(pidfile.lstat().st_mode):
            pidfile.unlink()
            removed.append(pidfile)
    except FileNotFoundError:
        pass
    try:
        if remove_stale_socket(socket_path()):
            removed.append(socket_path())
    except (ControlSocketError, OSError):
        pass  # not a dead socket of ours: the control server's start says why it cannot start
    return removed


def find_running() -> DaemonInfo | None:
    """The running daemon's pidfile record, or None (cleaning stale files on the way).

    A live daemon holds the lock for its whole life and the kernel drops it when the
    process dies, so a lock we can take means any pidfile or socket is stale.
    """
    with open(lockfile_path(), "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            info = DaemonInfo.read(pidfile_path())
            # Locked but no pidfile yet: a daemon is between taking the lock and writing it.
            return info or DaemonInfo(pid=0, started_at=time.time(), log=str(log_path()))
        try:
            for path in clean_stale_files():
                log.debug("removed stale %s", path)
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
    return None


def _take_lock(handle, wait_s: float = 2.0) -> bool:
    """Take the daemon lock; wait briefly, since `find_running` holds it for an instant."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)


class PrivateRotatingFileHandler(logging.handlers.RotatingFileHandler):
    """The log file, size-capped, and 0600 however it is (re)created: it holds prompts' names
    and errors another local user must not read (memrad.private)."""

    def _open(self):
        return open_private(Path(self.baseFilename), "a", tighten_dir=True)


def configure_logging(level: str, detached: bool, max_bytes: int = 10 * 2**20, backups: int = 3) -> None:
    """Log to the rotated file, and attached also to the terminal. Detached, stderr is the
    file the parent opened (for what escapes logging); records go through the handler only.
    Every line is escaped to one line (memrad.loglines.SafeFormatter)."""
    handlers: list[logging.Handler] = [PrivateRotatingFileHandler(log_path(), maxBytes=max_bytes,
                                                                  backupCount=backups)]
    if not detached:
        handlers.append(logging.StreamHandler(sys.stderr))
    formatter = SafeFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    for handler in handlers:
        handler.setFormatter(formatter)
    logging.basicConfig(level=level.upper(), handlers=handlers, force=True)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)


def serve(settings: Settings) -> list[str]:
    """Run the daemon in this process until SIGTERM/SIGINT. Blocks. Returns the parked
    sessions the stop could not save (one line each; empty when all were written)."""
    from memrad.server.security import bind_refusal

    refused = bind_refusal(settings.security, settings.server.host)
    if refused is not None:
        raise StartupError(refused)
    lock = open(lockfile_path(), "a")
    if not _take_lock(lock):
        lock.close()
        info = DaemonInfo.read(pidfile_path())
        where = f" (pid {info.pid}, {info.url})" if info else ""
        raise AlreadyRunning(f"memrad is already running{where}; `memrad stop` stops it") from None
    for path in clean_stale_files():
        log.info("removed stale %s left by a daemon that did not stop cleanly", path)
    note = runtime_dir_note()
    if note is not None:
        log.warning("%s", note)
    if pidfile_path().is_dir():
        lock.close()
        raise StartupError(f"{pidfile_path()} is a directory; memrad will not remove it: remove it yourself")
    stop_report_path().unlink(missing_ok=True)
    info = DaemonInfo(pid=os.getpid(), started_at=time.time(), log=str(log_path()))
    info.write(pidfile_path())
    engine, unsaved = None, []
    try:
        engine, device, dtype = _load(settings)
        from memrad.server.app import make_app

        app = make_app(settings, engine, device, dtype)
        unsaved = asyncio.run(_run(app, settings, info, engine.model_id, device))
    finally:
        clean_stale_files()
        lock.close()
    if engine is not None and engine.running_torch:
        # Still compiling in this process (the torch.compile fallback; a package build runs in
        # a child, stopped by engine.close), or checking the eager batched step (warm_batch):
        # interpreter teardown under a thread in torch aborts in C++ ("terminate called
        # without an active exception", exit 134).
        # Everything is written and logged by now, so the process just ends.
        logging.shutdown()
        os._exit(1 if unsaved else 0)
    return unsaved


def _load(settings: Settings):
    """Load on a thread that ends with the load, this thread pinned to one intra-op thread:
    the engine thread's is then the only team of workers (memrad.engine.threads)."""
    from memrad.engine.build import build_engine
    from memrad.engine.decode.decoder import CompileFailed
    from memrad.engine.model.loader import resolve_threads
    from memrad.engine.threads import on_passing_thread, pin_to_one

    pin_to_one()
    try:
        engine = on_passing_thread(lambda: build_engine(settings), resolve_threads(settings.model.threads))
    except CompileFailed as exc:
        raise StartupError(str(exc)) from None
    return engine, engine.loaded.device.type, engine.loaded.dtype_name


async def _run(app, settings: Settings, info: DaemonInfo, model_id: str, device: str) -> list[str]:
    from aiohttp import web

    from memrad.server.context import CONTEXT

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    from memrad.server.app import connection_limits
    from memrad.server.connections import Listener, limit_accept_errors

    limit_accept_errors(loop)
    runner = web.AppRunner(app, handle_signals=False, access_log=None,
                           shutdown_timeout=settings.server.shutdown_grace_s + 5)
    await runner.setup()
    listener = Listener(runner, connection_limits(settings))
    try:
        await listener.start(settings.server.host, settings.server.port)
    except OSError as exc:
        await runner.cleanup()
        raise StartupError(
            f"cannot listen on {settings.server.host}:{settings.server.port} ({exc.strerror}); "
            "another program uses that port: pick another with --port or MEMRA_PORT") from None
    url = f"http://{settings.server.host}:{listener.port}"
    control = await _start_control(app, settings, loop)
    DaemonInfo(pid=info.pid, started_at=info.started_at, log=info.log, url=url, model=model_id,
               device=device, socket=str(control.path)).write(pidfile_path())
    log.info("serving %s on %s (pid %d); control socket %s", model_id, url, info.pid, control.path)
    # compile = auto compiles now, in the background: not before, where its tracing would
    # hold the interpreter while the daemon is still getting ready to answer.
    app[CONTEXT].engine.start_background()
    await stop.wait()
    log.info("stopping: finishing or cancelling in-flight requests")
    await control.close()
    await listener.close()
    await runner.cleanup()  # closes the scheduler: nothing runs on the engine any more
    unsaved = await asyncio.to_thread(app[CONTEXT].engine.close)
    if unsaved:
        log.error("stopped, but %d parked sessions were not saved to the disk tier and are lost: %s",
                  len(unsaved), "; ".join(unsaved))
        StopReport(info.pid, unsaved).write(stop_report_path())
    else:
        log.info("stopped")
    return unsaved


async def _start_control(app, settings: Settings, loop):
    from memrad.server.context import CONTEXT, state_snapshot
    from memrad.server.control import ControlServer, ControlSocketError, EventBus

    ctx = app[CONTEXT]
    record = Path(settings.control.record).expanduser() if settings.control.record else None
    bus = EventBus(loop, record)
    ctx.event_sinks.append(bus.publish_threadsafe)
    path = Path(settings.control.socket).expanduser() if settings.control.socket else socket_path()
    control = ControlServer(path, bus, lambda: state_snapshot(ctx))
    try:
        await control.start()
    except OSError as exc:
        raise StartupError(f"cannot create the control socket {path} ({exc.strerror}); "
                           "set another path with MEMRA_SOCKET") from None
    except ControlSocketError as exc:
        raise StartupError(str(exc)) from None
    if record is not None:
        log.info("recording control events to %s", record)
    return control
