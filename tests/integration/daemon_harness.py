"""Integration harness: a real `memrad` daemon on the default model, started the way a user
starts it (the `memrad` console script, detached), isolated from any daemon a developer runs.

Isolation: every daemon gets its own XDG_RUNTIME_DIR (mode 0700, or platformdirs ignores it),
XDG_STATE_HOME (log), XDG_CONFIG_HOME (no user memrad.toml) and XDG_CACHE_HOME (the disk
tier's parked sessions), a free port, and no inherited MEMRA_* settings. The model cache is
left alone (MEMRA_CACHE_DIR pins it), so the converted default model is reused.

The code: every daemon (and its compile child) imports memrad from this checkout, first on
PYTHONPATH. The console script alone would import whatever checkout the shared editable
install points at, which another `pip install -e` (or a merge into that tree) can change
between two starts of one test: a first start and a warm start then ran different code.
`code_id` fingerprints the checkout's sources, so a test comparing two starts can tell a
change of code from a change of bits.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from memrad.process import pid_alive  # noqa: F401  (re-exported for the tests)

MODEL_ID = "SmolLM2-135M-Instruct"
THREADS = 2
CLI_TIMEOUT_S = 300.0  # `memrad start` may have to fetch the default model on a fresh machine


def expected_device() -> tuple[str, str]:
    """(device, dtype) that `--device auto --dtype auto` picks on this machine."""
    import torch

    from memrad.engine.model.hardware import pick_dtype

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return device.type, pick_dtype("auto", device)[1].value


def memrad_script() -> str:
    """The console script installed next to this interpreter (else the one on PATH)."""
    beside = Path(sys.executable).parent / "memrad"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("memrad")
    if found is None:
        pytest.fail("the `memrad` console script is not installed: python3 -m pip install -e '.[test]'")
    return found


CHECKOUT = Path(__file__).resolve().parents[2]  # the tree these tests belong to


def code_id() -> str:
    """A fingerprint of the memrad sources in this checkout (Python and C++), as they are now."""
    digest = hashlib.sha256()
    for path in sorted((CHECKOUT / "memrad").rglob("*")):
        if path.suffix in (".py", ".cpp", ".toml") and path.is_file():
            digest.update(f"{path.relative_to(CHECKOUT)}\0".encode() + path.read_bytes())
    return digest.hexdigest()[:16]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def is_memrad_daemon(pid: int) -> bool:
    """Guard for the SIGKILL fallback: never kill a recycled pid that is not a memrad daemon."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"memrad" in argv and b"--foreground" in argv


def wait_until(predicate, timeout: float, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


class Daemon:
    """One isolated memrad instance: its env, its port, and the CLI pointed at it."""

    def __init__(self, root: Path) -> None:
        runtime = root / "runtime"
        runtime.mkdir(mode=0o700)
        runtime.chmod(0o700)  # mkdir's mode is masked by the umask; platformdirs wants exactly 0700
        state = root / "state"
        state.mkdir()
        config = root / "config"
        config.mkdir()
        from memrad.paths import cache_dir

        env = {k: v for k, v in os.environ.items()
               if not k.startswith("MEMRA_") or k == "MEMRA_CACHE_DIR"}
        env.update(XDG_RUNTIME_DIR=str(runtime), XDG_STATE_HOME=str(state),
                   XDG_CONFIG_HOME=str(config), XDG_CACHE_HOME=str(root / "cache"),
                   MEMRA_CACHE_DIR=str(cache_dir()), PYTHONUNBUFFERED="1",
                   PYTHONPATH=os.pathsep.join([str(CHECKOUT), *filter(None, [os.environ.get("PYTHONPATH")])]),
                   # A background compile would switch the decode step between two requests of
                   # one test; the compiled step has its own story (test_compiled_decode_daemon).
                   MEMRA_COMPILE="off")
        self.sessions_dir = root / "cache" / "memra" / "sessions"
        self.env = env
        self.runtime_dir = runtime / "memra"
        self.pidfile = self.runtime_dir / "memrad.pid"
        self.log_file = state / "memra" / "log" / "memrad.log"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.pids: set[int] = set()  # every daemon pid seen, for the teardown fallback
        self.start_result: subprocess.CompletedProcess | None = None
        self.code_ids: list[str] = []  # code_id() at each start

    def cli(self, *args: str, timeout: float = 60.0) -> subprocess.CompletedProcess:
        return subprocess.run([memrad_script(), *args], env=self.env, capture_output=True, text=True,
                              timeout=timeout, stdin=subprocess.DEVNULL)

    def start(self) -> subprocess.CompletedProcess:
        self.code_ids.append(code_id())
        result = self.cli("start", "--port", str(self.port), "--threads", str(THREADS),
                          timeout=CLI_TIMEOUT_S)
        self.start_result = result
        self._remember_pid()
        return result

    def status(self) -> dict:
        result = self.cli("status", "--json")
        report = json.loads(result.stdout)
        if report.get("running") and report.get("pid"):
            self.pids.add(report["pid"])
        return report

    def _remember_pid(self) -> None:
        try:
            pid = json.loads(self.pidfile.read_text())["pid"]
        except (OSError, ValueError, KeyError):
            return
        if pid > 0:
            self.pids.add(pid)

    def log_text(self) -> str:
        return self.log_file.read_text(errors="replace") if self.log_file.exists() else ""

    def get_json(self, path: str, timeout: float = 30.0) -> dict:
        with urllib.request.urlopen(self.url + path, timeout=timeout) as response:
            return json.loads(response.read())

    def post(self, path: str, body: bytes | dict, timeout: float = 60.0) -> tuple[int, dict]:
        """POST and return (status, parsed JSON body) for 2xx and 4xx/5xx alike."""
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, method="POST",
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as err:
            with err:
                return err.code, json.loads(err.read())

    def shutdown(self) -> None:
        """Stop gracefully; SIGKILL whatever daemon pid is still alive after that."""
        self._remember_pid()
        try:
            self.cli("stop", "--timeout", "20", timeout=40)
        except subprocess.TimeoutExpired:
            pass
        for pid in self.pids:
            if (pid_alive(pid) and not wait_until(lambda: not pid_alive(pid), 5.0)
                    and is_memrad_daemon(pid)):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                wait_until(lambda: not pid_alive(pid), 5.0)
