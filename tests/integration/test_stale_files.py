"""A daemon killed with SIGKILL leaves its pidfile; the CLI notices and cleans it up."""

from __future__ import annotations

import json
import os
import signal

import pytest

from daemon_harness import MODEL_ID, pid_alive, wait_until

pytestmark = pytest.mark.integration


def test_sigkilled_daemon_leaves_stale_files_that_status_and_start_clean(daemon):
    report = daemon.status()
    assert report["running"] is True
    pid = report["pid"]
    os.kill(pid, signal.SIGKILL)
    assert wait_until(lambda: not pid_alive(pid), 10.0)
    # SIGKILL runs no cleanup: the pidfile still names the dead daemon.
    assert json.loads(daemon.pidfile.read_text())["pid"] == pid

    status = daemon.cli("status")
    assert status.returncode == 3
    assert "memrad is not running" in status.stdout
    assert not daemon.pidfile.exists()
    assert json.loads(daemon.cli("status", "--json").stdout) == {
        "running": False, "disk": {"dir": str(daemon.sessions_dir), "models": {}}}

    # Start again, on the same port the dead daemon listened on.
    started = daemon.start()
    assert started.returncode == 0, f"{started.stdout}\n{started.stderr}\n{daemon.log_text()[-2000:]}"
    assert f"memrad is serving {MODEL_ID} at {daemon.url}/v1" in started.stdout
    again = daemon.status()
    assert again["running"] is True
    assert again["state"] == "serving"
    assert again["pid"] != pid
    assert pid_alive(again["pid"])
    status, body = daemon.post("/v1/completions", {"prompt": "Hello", "max_tokens": 2, "temperature": 0})
    assert status == 200, body
    assert body["usage"]["completion_tokens"] == 2 or body["choices"][0]["finish_reason"] == "stop"

    stopped = daemon.cli("stop", timeout=90)
    assert stopped.returncode == 0, stopped.stderr
    assert f"memrad stopped (pid {again['pid']})" in stopped.stdout
    assert daemon.cli("status").returncode == 3
    assert not daemon.pidfile.exists()
    assert wait_until(lambda: not pid_alive(again["pid"]), 10.0)


def test_status_when_nothing_ever_ran(make_daemon):
    fresh = make_daemon()
    result = fresh.cli("status", "--json")
    assert result.returncode == 3
    assert json.loads(result.stdout) == {"running": False, "disk": {"dir": str(fresh.sessions_dir), "models": {}}}
    logs = fresh.cli("logs")
    assert logs.returncode == 1
    assert "no log yet" in logs.stderr
