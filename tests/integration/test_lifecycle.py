"""`memrad start | status | logs | stop` against a real daemon, in the order a user runs them.

The tests share one daemon and run in file order: the last one stops it.
"""

from __future__ import annotations

import json

import pytest

from daemon_harness import MODEL_ID, expected_device, pid_alive, wait_until

pytestmark = pytest.mark.integration


def test_start_prints_url_model_and_pid(daemon):
    result = daemon.start_result
    assert result.returncode == 0, result.stderr
    report = daemon.status()
    assert report["running"] is True
    pid = report["pid"]
    assert f"memrad is serving {MODEL_ID} at {daemon.url}/v1" in result.stdout
    assert f"pid {pid}," in result.stdout
    assert json.loads(daemon.pidfile.read_text())["pid"] == pid
    assert pid_alive(pid)


def test_status_json_reports_the_running_daemon(daemon):
    result = daemon.cli("status", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["running"] is True
    assert report["state"] == "serving"
    assert report["url"] == daemon.url
    assert report["model"] == MODEL_ID
    assert (report["device"], report["dtype"]) == expected_device()
    assert report["log"] == str(daemon.log_file)
    assert report["requests_served"] == 0
    assert report["waiting"] == 0
    assert report["pid"] == daemon.get_json("/health")["pid"]

    # requests_served counts what the model ran.
    status, body = daemon.post("/v1/completions", {"prompt": "Hello", "max_tokens": 2, "temperature": 0})
    assert status == 200, body
    assert json.loads(daemon.cli("status", "--json").stdout)["requests_served"] == 1


def test_status_text(daemon):
    pid = daemon.status()["pid"]
    served = daemon.get_json("/health")["requests_served"]
    device, dtype = expected_device()
    result = daemon.cli("status")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].endswith(": serving")
    assert f"  pid       {pid}" in lines
    assert f"  url       {daemon.url}/v1" in lines
    assert f"  model     {MODEL_ID}" in lines
    assert f"  device    {device} ({dtype})" in lines
    assert f"  requests  {served} served, 0 waiting" in lines
    assert f"  log       {daemon.log_file}" in lines


def test_second_start_reports_already_running_and_starts_nothing(daemon):
    pid = daemon.status()["pid"]
    log_before = daemon.log_text()
    result = daemon.cli("start", "--port", str(daemon.port), "--threads", "2", timeout=120)
    assert result.returncode == 0, result.stderr
    assert f"memrad is already running (pid {pid}, {daemon.url})" in result.stdout
    assert "serving" not in result.stdout
    assert daemon.status()["pid"] == pid
    # A second daemon would have logged its own start (its first line: loading the model) to the
    # same log. The running one may log meanwhile: its background batched-step check and compile
    # finish when they finish (on a 2-core Zen 2 the check's line came during this test).
    after = daemon.log_text()
    assert after.startswith(log_before)
    assert not [line for line in after[len(log_before):].splitlines() if " memrad: loading " in line]
    assert daemon.log_text().count(f"serving {MODEL_ID} on {daemon.url}") == 1


def test_logs_prints_the_last_lines(daemon):
    for _ in range(3):  # each request adds a line, so the log has more than 5
        status, body = daemon.post("/v1/completions", {"prompt": "Hi", "max_tokens": 1})
        assert status == 200, body
    assert len(daemon.log_text().splitlines()) > 5
    result = daemon.cli("logs", "-n", "5")
    assert result.returncode == 0, result.stderr
    shown = result.stdout.splitlines()
    assert shown == daemon.log_text().splitlines()[-5:]
    assert len(shown) == 5
    everything = daemon.cli("logs", "-n", "0").stdout.splitlines()
    assert everything == daemon.log_text().splitlines()
    assert any(f"serving {MODEL_ID} on {daemon.url}" in line for line in everything)
    # Prompts' names and errors are in it: the owner's only.
    assert (daemon.log_file.stat().st_mode & 0o777, daemon.log_file.parent.stat().st_mode & 0o777) == (0o600, 0o700)


def test_stop_then_status_says_not_running(daemon):
    pid = daemon.status()["pid"]
    result = daemon.cli("stop", timeout=90)
    assert result.returncode == 0, result.stderr
    assert f"memrad stopped (pid {pid})" in result.stdout
    assert not daemon.pidfile.exists()
    assert wait_until(lambda: not pid_alive(pid), 10.0), "the daemon process outlived `memrad stop`"
    status = daemon.cli("status")
    assert status.returncode == 3
    assert "memrad is not running" in status.stdout
    report = json.loads(daemon.cli("status", "--json").stdout)
    files = list(daemon.sessions_dir.glob("*.safetensors"))  # what the stop wrote to the disk tier
    on_disk = {"SmolLM2-135M-Instruct": {"sessions": len(files), "bytes": sum(f.stat().st_size for f in files)}}
    assert report == {"running": False, "disk": {"dir": str(daemon.sessions_dir), "models": on_disk if files else {}}}
    assert not daemon.pidfile.exists()
    assert daemon.log_text().splitlines()[-1].endswith("memrad: stopped")
    # Stopping what is not running is fine.
    again = daemon.cli("stop")
    assert again.returncode == 0
    assert "memrad is not running" in again.stdout
