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
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

import torch

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
