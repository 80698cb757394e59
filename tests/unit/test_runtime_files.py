"""The lock, the pidfile and the control socket: one runtime directory decides all three, the
pid is checked to be memrad's before any signal, and only what memrad made is ever deleted
(issue 23 item 4, issue 26 item 5)."""

import fcntl
import json
import os
import socket
import subprocess

import pytest

from memrad import cli
from memrad.daemon import DaemonInfo, clean_stale_files, is_memrad, lock_holder
from memrad.paths import lockfile_path, pidfile_path, runtime_dir, runtime_dir_note, socket_path
from memrad.protocol import default_socket_path


@pytest.fixture
def runtime(tmp_path, monkeypatch):
    """An owner-only XDG_RUNTIME_DIR and a private TMPDIR (where the fallback would go)."""
    run = tmp_path / "run"
    run.mkdir()
    run.chmod(0o700)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(run))
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setattr("tempfile.tempdir", None)  # gettempdir() reads TMPDIR again
    return run


def the_three():
    return {lockfile_path().parent, pidfile_path().parent, socket_path().parent}


def test_an_owner_only_runtime_dir_holds_all_three_files(runtime):
    assert the_three() == {runtime / "memra"} and runtime_dir_note() is None
    assert default_socket_path() == str(socket_path())


def test_an_open_runtime_dir_is_replaced_by_one_fallback_for_all_three_and_said(runtime, tmp_path):
    runtime.chmod(0o755)
    fallback = tmp_path / "tmp" / f"runtime-{os.geteuid()}" / "memra"
    assert the_three() == {fallback}  # the lock used to stay in the open dir, pidfile and socket not
    assert default_socket_path() == str(fallback / "memrad.sock")  # the TUI finds it too
    assert oct(fallback.stat().st_mode & 0o777) == "0o700"
    assert runtime_dir_note() == (f"XDG_RUNTIME_DIR={runtime} is unsafe (mode 755, not 700): the lock, pidfile "
                                  f"and socket are in {fallback} instead")
    assert not (runtime / "memra").exists()


@pytest.fixture
def held_lock(runtime):
    """This process holds the daemon lock, as a running daemon does."""
    handle = open(lockfile_path(), "a")
    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    yield handle
    handle.close()


def test_stop_never_signals_a_pid_that_is_not_the_lock_holder(held_lock, capsys):
    bystander = subprocess.Popen(["sleep", "30"])
    try:
        DaemonInfo(pid=bystander.pid, started_at=0.0, log="x").write(pidfile_path())
        assert lock_holder() == os.getpid() and is_memrad(os.getpid()) and not is_memrad(bystander.pid)
        assert cli.main(["stop", "--timeout", "1"]) == 1
        assert bystander.poll() is None  # still alive: it used to be killed
        assert f"the pidfile names pid {bystander.pid}, which is not the memrad daemon (pid {os.getpid()} " \
               "holds the lock); not signalling it" in capsys.readouterr().err
    finally:
        bystander.kill()
        bystander.wait()
    DaemonInfo(pid=bystander.pid, started_at=0.0, log="x").write(pidfile_path())  # now a dead pid
    assert cli.main(["stop", "--timeout", "1"]) == 1  # refused, not ProcessLookupError


def test_nothing_named_in_a_pidfile_is_deleted(runtime, tmp_path):
    victim = tmp_path / "precious.txt"
    victim.write_text("keep me")
    DaemonInfo(pid=999999, started_at=0.0, log="x", socket=str(victim)).write(pidfile_path())
    assert clean_stale_files() == [pidfile_path()]
    assert victim.read_text() == "keep me"  # `memrad status` used to delete it


def test_only_a_dead_socket_at_the_socket_path_is_removed(runtime, capsys):
    path = socket_path()
    path.write_text("a regular file")
    assert clean_stale_files() == [] and path.read_text() == "a regular file"
    path.unlink()
    path.mkdir()
    assert clean_stale_files() == [] and path.is_dir()  # status and stop used to crash here
    assert cli.main(["status"]) == 3
    path.rmdir()
    live = socket.socket(socket.AF_UNIX)
    live.bind(str(path))
    live.listen()
    try:
        assert clean_stale_files() == [] and path.exists()  # a live foreign socket is not taken over
    finally:
        live.close()
    assert clean_stale_files() == [path] and not path.exists()  # nobody answers now: stale


@pytest.mark.parametrize("thing", ["file", "directory", "live socket"])
def test_something_else_at_the_socket_path_refuses_the_start_with_a_reason(runtime, thing):
    import asyncio

    from memrad.server.control import ControlServer, ControlSocketError, EventBus

    path = socket_path()
    live = None
    if thing == "file":
        path.write_text("x")
    elif thing == "directory":
        path.mkdir()
    else:
        live = socket.socket(socket.AF_UNIX)
        live.bind(str(path))
        live.listen()

    async def start():
        server = ControlServer(path, EventBus(asyncio.get_running_loop(), None), lambda: None)
        await server.start()

    clean_stale_files()
    try:
        with pytest.raises(ControlSocketError, match="not a socket|another process is serving"):
            asyncio.run(start())
    finally:
        if live is not None:
            live.close()


FAKE_DAEMON = """
import fcntl, os, signal, sys, time
from memrad.daemon import DaemonInfo, StopReport
from memrad.paths import lockfile_path, pidfile_path, stop_report_path
lock = open(lockfile_path(), "a")
fcntl.flock(lock, fcntl.LOCK_EX)
def stop(*_):
    StopReport(os.getpid(), ["s3 (812 tokens): RuntimeError: no file form"]).write(stop_report_path())
    pidfile_path().unlink()
    sys.exit(1)
signal.signal(signal.SIGTERM, stop)
DaemonInfo(pid=os.getpid(), started_at=0.0, log="x").write(pidfile_path())
print("ready", flush=True)
time.sleep(60)
"""


def test_stop_says_which_sessions_were_not_saved_and_exits_non_zero(runtime, capsys):
    import sys

    env = dict(os.environ, PYTHONPATH=os.getcwd())
    daemon = subprocess.Popen([sys.executable, "-c", FAKE_DAEMON], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert daemon.stdout.readline().strip() == "ready"
        assert cli.main(["stop", "--timeout", "10"]) == 1
        err = capsys.readouterr().err
        assert f"memrad stopped (pid {daemon.pid}), but 1 parked sessions were not saved to the disk tier" in err
        assert "  s3 (812 tokens): RuntimeError: no file form" in err
    finally:
        daemon.kill()
        daemon.wait()
