"""One team of intra-op threads in the daemon: the engine thread's.

torch's CPU kernels, the compiled step's extern calls and memra's kernels run their parallel
regions on OpenMP (libgomp in torch's wheels). Every thread that runs a parallel region with
more than one thread keeps a team of workers of its own, and libgomp counts all the workers
it manages: once they outnumber the CPUs, a waiting worker spins ~100 times instead of
~300,000 before it sleeps on a futex, so each of a decode step's hundreds of short parallel
regions pays a sleep and a wake. Measured (docs/BENCHMARKS.md, "One team of threads"): the
compiled step decoded 56-60 tok/s on a thread other than the one that had loaded the model,
against 114-118 on the loading thread, 2 threads on 2 cores; the daemon ran the first way.

So the engine thread is the only long-lived thread with a team. The daemon's main thread is
pinned to one thread before any torch work, the model loads on a thread that exits when it
is done (libgomp frees a thread's team when the thread ends), and the other long-lived
threads that may touch torch (the spill writer, the request-preparation lanes) are pinned to
one thread: their ops run inline, without a team.

The engine thread's team is resized per phase (`Team`, as memrad.engine.team decides): the
count follows the CPU actually free, so a step does not wait at every barrier for a thread
the kernel descheduled.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

from memrad.engine.team import Ceiling, Phase, TeamPolicy, ceiling_of, parse_cpu_max
from memrad.protocol import ThreadsEvent

log = logging.getLogger("memrad.engine")

T = TypeVar("T")


def pin(threads: int) -> None:
    """Fix this thread's intra-op thread count for good. torch applies its process-wide count
    (the last `set_num_threads` on any thread) to a thread lazily, at the thread's first
    parallel op; asking for the count first has it applied now, so the value set here stays."""
    torch.get_num_threads()
    torch.set_num_threads(threads)


def pin_to_one() -> None:
    """For a thread that must not form a team (an executor's `initializer`)."""
    pin(1)


def on_passing_thread(fn: Callable[[], T], threads: int, name: str = "memrad-load") -> T:
    """`fn()` on a new thread with `threads` intra-op threads, which ends when `fn` returns
    (and its team with it); its result, or its exception re-raised here."""
    outcome: list = []

    def run() -> None:
        pin(threads)
        try:
            outcome.append((True, fn()))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller as is
            outcome.append((False, exc))

    thread = threading.Thread(target=run, name=name)
    thread.start()
    thread.join()
    ok, value = outcome[0]
    if not ok:
        raise value
    return value


CGROUP_ROOT = Path("/sys/fs/cgroup")
LIMITS_EVERY_S = 5.0  # how often the affinity mask and the quota are read again


def quota_cpus(root: Path = CGROUP_ROOT, self_cgroup: Path = Path("/proc/self/cgroup")) -> float | None:
    """The tightest cgroup CPU quota over this process's cgroup and its ancestors, in CPUs
    (v2 `cpu.max`; v1 `cpu.cfs_quota_us` / `cpu.cfs_period_us` under the cpu controller's
    mount, from the process's own v1 cgroup up); None where there is none."""
    try:
        lines = self_cgroup.read_text().splitlines()
    except OSError:
        return None
    paths = {}  # controller list ("" for v2, "cpu", "cpu,cpuacct") -> the process's cgroup path
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        paths[controllers] = path
    found = [cpus for folder in _ancestors(root, paths.get("", "/"))
             if (cpus := _read(lambda: parse_cpu_max((folder / "cpu.max").read_text()))) is not None]
    for v1 in ("cpu", "cpu,cpuacct"):  # cgroup v1: cfs_quota_us of -1 is no quota
        own = next((path for controllers, path in paths.items() if v1 in controllers.split(",")), "/")
        for folder in _ancestors(root / v1, own):
            quota = _read(lambda: (int((folder / "cpu.cfs_quota_us").read_text()),
                                   int((folder / "cpu.cfs_period_us").read_text())))
            if quota is not None and quota[0] > 0 and quota[1] > 0:
                found.append(quota[0] / quota[1])
    return min(found) if found else None


def _ancestors(root: Path, path: str) -> list[Path]:
    """`root`/`path` and each folder above it up to `root` (a container's mount shows its own
    cgroup at the root, so a path from /proc/self/cgroup may not exist below it: skipped)."""
    parts = [p for p in path.strip("/").split("/") if p]
    return [root.joinpath(*parts[:depth]) for depth in range(len(parts), -1, -1)]


def _read(read: Callable[[], T]) -> T | None:
    try:
        return read()
    except (OSError, ValueError):
        return None


def cpu_ceiling() -> Ceiling:
    """What this process may run on now: its affinity mask, lowered to its cgroup quota."""
    return ceiling_of(len(os.sched_getaffinity(0)), quota_cpus())


class Team:
    """The engine thread's team, resized per phase as a TeamPolicy (memrad.engine.team) says.

    Call `size_for(phase)` before a step and `ran(...)` after it, on the engine thread. A
    count that changed is applied with `torch.set_num_threads` (libgomp resizes the team at
    the next parallel region: no thread is created or joined while the pool is warm), and a
    change is logged and handed to `on_change`.
    """

    def __init__(self, policy: TeamPolicy, on_change: Callable[[ThreadsEvent], None] = lambda change: None,
                 clock: Callable[[], float] = time.monotonic, ceiling: Callable[[], Ceiling] = cpu_ceiling) -> None:
        self.policy = policy
        self._on_change = on_change
        self._clock = clock
        self._ceiling = ceiling
        self._limits_at_s = clock()

    def size_for(self, phase: Phase) -> int:
        """Set the count `phase`'s next step runs at; returns it."""
        now = self._clock()
        if not self.policy.fixed and now - self._limits_at_s >= LIMITS_EVERY_S:
            self._limits_at_s = now
            ceiling = self._ceiling()
            if ceiling != self.policy.ceiling:
                for change in self.policy.set_ceiling(ceiling, now):
                    self._changed(change)
        threads = self.policy.threads_for(phase, now)
        if not self.policy.fixed and torch.get_num_threads() != threads:  # fixed: init_worker_thread's pin stays
            torch.set_num_threads(threads)
        return threads

    def ran(self, phase: Phase, threads: int, work: int, started_s: float) -> None:
        """A step of `phase` that `size_for` sized at `threads` ran `work` units since `started_s`."""
        now = self._clock()
        change = self.policy.observe(phase, threads, work, now - started_s, now)
        if change is not None:
            self._changed(change)

    def now(self) -> float:
        return self._clock()

    def _changed(self, change: ThreadsEvent) -> None:
        log.info("threads: %s", change.render())
        self._on_change(change)
