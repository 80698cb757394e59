"""One request on the model at a time; the rest wait in a bounded FIFO queue.

The engine runs on a single worker thread (torch releases the GIL), so the event loop
keeps serving /health, errors and streaming while a request decodes. Text deltas cross
back to the loop with call_soon_threadsafe. Admission is check-then-act: `submit` either
queues the job or raises QueueFull, never half of each.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

from memrad.protocol import Decision
from memrad.request import Completion, GenerationRequest, TokenLogprob

log = logging.getLogger("memrad.scheduler")


class EngineLike(Protocol):
    def init_worker_thread(self) -> None: ...
    def generate(self, request: GenerationRequest, emit: Callable[[str | TokenLogprob], None],
                 cancelled: Callable[[], bool],
                 on_decision: Callable[[Decision], None] | None = None) -> Completion: ...


class QueueFull(Exception):
    def __init__(self, waiting: int, retry_after_s: int) -> None:
        super().__init__(f"{waiting} requests are already waiting")
        self.waiting = waiting
        self.retry_after_s = retry_after_s


class ShuttingDown(Exception):
    pass


@dataclass(eq=False)
class Job:
    """A queued or running request.

    `deltas` yields the reuse Decision first, then text (and each token's TokenLogprob ahead
    of its text, where the request asks for logprobs), then None when generation ends.
    """

    request: GenerationRequest
    submitted_at: float
    deltas: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancel_event: threading.Event = field(default_factory=threading.Event)
    started_at: float | None = None
    result: asyncio.Future | None = None  # -> Completion | None (None: cancelled before start)

    def cancel(self) -> None:
        """Ask the engine to stop; it notices between prefill chunks and decode steps."""
        self.cancel_event.set()

    @property
    def cancelled(self) -> bool:
        return self.cancel_event.is_set()


class Scheduler:
    def __init__(self, engine: EngineLike, max_queue: int) -> None:
        self._engine = engine
        self._max_queue = max_queue
        self._executor = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="memrad-engine", initializer=engine.init_worker_thread
        )
        self._jobs: list[Job] = []  # FIFO: [running?, waiting...]
        self._closing = False
        self._mean_job_s = 5.0
        self.requests_served = 0

    @property
    def running(self) -> Job | None:
        return next((j for j in self._jobs if j.started_at is not None), None)

    @property
    def waiting(self) -> int:
        return sum(1 for j in self._jobs if j.started_at is None)

    def can_admit(self) -> bool:
        return not self._closing and len(self._jobs) < 1 + self._max_queue

    def submit(self, request: GenerationRequest) -> Job:
        """Queue `request` or raise QueueFull / ShuttingDown."""
        if self._closing:
            raise ShuttingDown()
        if not self.can_admit():
            waiting = self.waiting
            raise QueueFull(waiting, max(1, math.ceil(self._mean_job_s * (waiting + 1))))
        loop = asyncio.get_running_loop()
        job = Job(request=request, submitted_at=time.monotonic())
        self._jobs.append(job)
        job.result = loop.run_in_executor(self._executor, self._run, job, loop)
        job.result.add_done_callback(lambda _: self._finished(job))
        return job

    def _run(self, job: Job, loop: asyncio.AbstractEventLoop) -> Completion | None:
        """Worker thread: run one job; always ends its delta stream with None."""
        job.started_at = time.monotonic()
        try:
            if job.cancelled:
                return None
            put = lambda item: loop.call_soon_threadsafe(job.deltas.put_nowait, item)  # noqa: E731
            return self._engine.generate(job.request, put, job.cancel_event.is_set, on_decision=put)
        finally:
            loop.call_soon_threadsafe(job.deltas.put_nowait, None)

    def _finished(self, job: Job) -> None:
        self._jobs.remove(job)
        if job.started_at is not None:
            self.requests_served += 1
            elapsed = time.monotonic() - job.started_at
            self._mean_job_s = 0.8 * self._mean_job_s + 0.2 * elapsed

    async def close(self, grace_s: float) -> None:
        """Stop admitting; cancel waiting jobs; give the running one `grace_s`, then cancel it."""
        self._closing = True
        jobs = list(self._jobs)
        for job in jobs:
            if job.started_at is None:
                job.cancel()
        pending = [j.result for j in jobs if j.result is not None]
        if pending:
            done, not_done = await asyncio.wait(pending, timeout=grace_s)
            if not_done:
                log.info("shutdown: cancelling the in-flight request after %.1f s", grace_s)
                for job in jobs:
                    job.cancel()
                await asyncio.wait(not_done)
        self._executor.shutdown(wait=True)
