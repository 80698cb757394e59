"""Throwaway daemons for harnesses: isolated runtime/log dirs, a free port, started and
stopped through the real CLI, so what is measured is what a user runs."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Daemon:
    root: Path
    env: dict[str, str]
    url: str = ""

    @classmethod
    def create(cls, extra_env: dict[str, str] | None = None) -> "Daemon":
        root = Path(tempfile.mkdtemp(prefix="memra-daemon-"))
        runtime = root / "runtime"
        runtime.mkdir(mode=0o700)
        runtime.chmod(0o700)
        from memrad.paths import cache_dir

        env = {k: v for k, v in os.environ.items() if not k.startswith("MEMRA_") or k == "MEMRA_CACHE_DIR"}
        # Its own XDG_CACHE_HOME: no arm resumes another's parked sessions from disk; the
        # models stay where they are (MEMRA_CACHE_DIR).
        env.update(XDG_RUNTIME_DIR=str(runtime), XDG_STATE_HOME=str(root / "state"),
                   XDG_CONFIG_HOME=str(root / "config"), XDG_CACHE_HOME=str(root / "cache"),
                   MEMRA_CACHE_DIR=str(cache_dir()), **(extra_env or {}))
        return cls(root, env)

    def cli(self, *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "memrad", *args], env=self.env, capture_output=True,
                              text=True, timeout=timeout, stdin=subprocess.DEVNULL)

    def start(self, *flags: str, settled: bool = True) -> None:
        """`memrad start`; with `settled`, also wait until the decode step is no longer
        compiling (compile = auto compiles in the background: measure the steady state)."""
        port = free_port()
        result = self.cli("start", "--port", str(port), *flags)
        if result.returncode != 0:
            raise RuntimeError(f"memrad start failed:\n{result.stdout}{result.stderr}")
        self.url = f"http://127.0.0.1:{port}"
        while settled and self.compiling():
            time.sleep(0.5)

    def decode(self) -> dict:
        """The decode step /health reports: {value: compiled, compiling, eager or
        transformers, reason}."""
        with urllib.request.urlopen(f"{self.url}/health", timeout=10) as response:
            return json.loads(response.read())["choices"]["decode"]

    def compiling(self) -> bool:
        """Compiling, or about to: /health answers a moment before `compile = auto` starts; the
        batched step's package is built after the one-row one (its reason says compiling)."""
        with urllib.request.urlopen(f"{self.url}/health", timeout=10) as response:
            choices = json.loads(response.read())["choices"]
        decode = choices["decode"]
        return (decode["value"] == "compiling" or "not started" in decode["reason"]
                or "compiling:" in choices["batch"]["reason"])

    def status(self) -> dict:
        return json.loads(self.cli("status", "--json").stdout)

    @property
    def log_path(self) -> Path:
        return self.root / "state" / "memra" / "log" / "memrad.log"

    def stop(self) -> None:
        """Stop it and delete the sessions it wrote to its disk tier (a harness daemon's only)."""
        self.cli("stop", "--timeout", "30")
        shutil.rmtree(self.root / "cache", ignore_errors=True)
