"""Two daemons with different runtime dirs, one of them open (0755): each keeps its lock,
pidfile and socket in one private directory, they share no file, and each `memrad stop`
stops its own (issue 23 item 4)."""

from __future__ import annotations

import os

import pytest

from daemon_harness import pid_alive, wait_until

pytestmark = pytest.mark.integration


def files(directory):
    return sorted(p.name for p in directory.iterdir()) if directory.is_dir() else []


def test_two_daemons_with_different_runtime_dirs_share_no_file(make_daemon):
    private, open_one = make_daemon(), make_daemon()
    fallback_tmp = open_one.runtime_dir.parent.parent / "tmp"
    fallback_tmp.mkdir()
    open_one.runtime_dir.parent.chmod(0o755)
    open_one.env["TMPDIR"] = str(fallback_tmp)
    fallback = fallback_tmp / f"runtime-{os.geteuid()}" / "memra"
    for daemon in (private, open_one):
        result = daemon.start()
        assert result.returncode == 0, result.stderr
    assert f"is unsafe (mode 755, not 700): the lock, pidfile and socket are in {fallback}" in \
        open_one.start_result.stderr
    a, b = private.status(), open_one.status()
    assert a["socket"] == str(private.runtime_dir / "memrad.sock") and b["socket"] == str(fallback / "memrad.sock")
    assert files(private.runtime_dir) == ["memrad.lock", "memrad.pid", "memrad.sock"] == files(fallback)
    assert files(open_one.runtime_dir) == []  # nothing in the open directory
    assert a["pid"] != b["pid"]
    stopped = open_one.cli("stop")
    assert stopped.returncode == 0 and f"memrad stopped (pid {b['pid']})" in stopped.stdout
    assert wait_until(lambda: not pid_alive(b["pid"]), 20.0)  # its lock is freed just before it exits
    assert pid_alive(a["pid"]) and private.status()["running"] is True
    assert files(fallback) == ["memrad.lock"]  # its pidfile and socket are gone, the lock file stays
    stopped = private.cli("stop")
    assert stopped.returncode == 0 and f"memrad stopped (pid {a['pid']})" in stopped.stdout
