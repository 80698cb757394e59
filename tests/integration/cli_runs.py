"""One real agent CLI run against a real daemon, measured between two idle daemons (issue 20,
item 6; issue 21's done-when), for tests/integration/test_agent_cli_*.py.

The CLI runs with the tested configuration of docs/SERVING.md "Use with agent CLIs"
(tests/unit/test_agent_cli_runs.invocation: only the base URL, the model and a dummy key).
The daemon's request counts are read from /metrics once nothing waits or runs and two
scrapes agree, before and after, so a request the CLI walked away from (opencode does not
wait for its title request: the daemon counts it 499 and logs "client disconnected") is
charged to the CLI that left it.

How each CLI ends is its own: opencode and Qwen Code print what they got and exit 0; Codex
reports the model's `max_output_tokens` incompleteness and exits 1 (issue 20 allows it);
Claude Code asks the model to continue three times and then exits 1 with "response exceeded
the 32000 output token maximum" when every reply ran to the cap. Those exits are asserted as
they are, with their words: the server's part is that nothing was refused.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from memrad.server.metrics import parse_samples

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))

from test_agent_cli_runs import BIN, invocation, needs, sandbox  # noqa: E402

# What each CLI says when it exits 1 because the model's replies ran to the cap.
LENGTH_EXIT = {"claude": "output token maximum", "codex": "max_output_tokens"}
# How the daemon's log words a request whose client left (memrad.server.serving, app).
GONE_WORDS = ("client disconnected", "cancelled before it started", "client left before the answer")


@dataclass(frozen=True, slots=True)
class CliRun:
    """One CLI's run: its exit, what the daemon counted for it, its log lines, its wall time."""

    cli: str
    returncode: int
    stdout: str
    stderr: str
    made: dict[tuple[str, str], float]  # (route, status) -> requests this run added
    log: str  # the daemon's log lines written during the run
    wall_s: float

    def prompt_tokens(self) -> list[int]:
        """Every finished request's prompt length, as the daemon logged it."""
        return [int(line.split(" prompt=")[1].split()[0]) for line in self.log.splitlines() if " prompt=" in line]


def scrape(daemon) -> dict:
    with urllib.request.urlopen(daemon.url + "/metrics", timeout=30) as response:
        return parse_samples(response.read().decode())


def requests_by_status(samples: dict) -> dict[tuple[str, str], float]:
    return {(dict(labels)["route"], dict(labels)["status"]): value for (name, labels), value in samples.items()
            if name == "memra_http_requests_total" and dict(labels)["route"] not in ("/metrics", "/health")}


def settled(daemon, timeout_s: float = 300.0) -> dict[tuple[str, str], float]:
    """The request counts once nothing waits or runs and two scrapes agree."""
    deadline, last = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        samples = scrape(daemon)
        busy = samples[("memra_queue_depth", ())] + samples[("memra_running_requests", ())]
        counts = requests_by_status(samples)
        if not busy and counts == last:
            return counts
        last = counts
        time.sleep(0.5)
    raise AssertionError(f"the daemon was still busy after {timeout_s} s")


def run_cli(daemon, tmp_path: Path, cli: str) -> CliRun:
    """Run `cli`'s tested configuration in a fresh sandbox against `daemon`, between two idle
    states of it."""
    needs(cli)
    before, logged = settled(daemon), len(daemon.log_text())
    work = sandbox(tmp_path)
    argv, env = invocation(cli, tmp_path / "home")
    started = time.monotonic()
    run = subprocess.run(argv, cwd=work, env={"PATH": f"{BIN}:{os.environ['PATH']}", "PORT": str(daemon.port), **env},
                         stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=900)
    after, log = settled(daemon), daemon.log_text()[logged:]
    made = {key: after[key] - before.get(key, 0) for key in after if after[key] != before.get(key, 0)}
    return CliRun(cli, run.returncode, run.stdout, run.stderr, made, log, time.monotonic() - started)


def assert_every_request_served(run: CliRun) -> None:
    """Every request the run made was 2xx (or left by the CLI itself, and logged so), nothing
    was refused, and the CLI ended as it does when nothing was refused."""
    served = {key: n for key, n in run.made.items() if key[1].startswith("2")}
    left = sum(n for (_, status), n in run.made.items() if status == "499")
    assert served and sum(served.values()) + left == sum(run.made.values()), (run.made, run.log[-3000:])
    # Each request the CLI walked away from, the daemon logged as such.
    assert sum(run.log.count(words) for words in GONE_WORDS) >= left, (run.made, run.log[-3000:])
    assert "refused" not in run.log and "WARNING memrad.server" not in run.log, run.log[-3000:]
    if run.returncode != 0:
        assert run.cli in LENGTH_EXIT and LENGTH_EXIT[run.cli] in run.stdout + run.stderr, run.stderr[-2000:]
    else:
        assert run.stdout.strip()  # the model's answer, whatever the tiny model says
