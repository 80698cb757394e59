"""Requests on the model: up to max_batch in flight together, the rest in a bounded FIFO.

The engine runs on one worker thread (torch releases the GIL), so the event loop keeps
serving /health, errors and streaming while requests decode. The engine (an EngineLike:
memrad.engine.engine) is driven one iteration at a time: jobs are admitted in arrival order
while it has room (max_batch; 1 runs one at a time), except a job the engine `holds` (a retry
waiting for the prefill of the prompt it repeats, to fork it: memrad.engine.attaching), and each `step` decodes one token for
every decoding request and prefills a chunk of the oldest one still prefilling. Text deltas
cross back to the loop with call_soon_threadsafe. Admission is check-then-act: `submit`
either queues the job or raises QueueFull, never half of each.

A waiting job whose client hung up (cancelled before it started) holds no place: the queue's
counts, QueueFull and its Retry-After leave it out at once, and the engine thread drops it
before its next step (its result is None).
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from memrad.protocol import Decision
from memrad.request import Completion, GenerationRequest, TokenLogprob

log = logging.getLogger("memrad.scheduler")


class FlightLike(Protocol):
    """A request the engine put in flight (memrad.engine.flight.Flight): one of the two is
    set once it ends."""

    completion: Completion | None
    error: BaseException | None


class EngineLike(Protocol):
    """What the scheduler drives (memrad.engine.engine.Engine). Every method runs on the
    engine thread and mutates the engine's flights."""

    max_batch: int  # flights in at once (1: one request at a time)

    def init_worker_thread(self) -> None:
        """Once, on the engine thread, before the first `admit`."""
        ...

    def holds(self, request: GenerationRequest) -> bool:
        """Whether a queued `request` waits for a flight's prefill to reach the state it forks
        (memrad.engine.attaching) instead of being admitted now; False with nothing in flight."""
        ...

    def admit(self, request: GenerationRequest, emit: Callable[[str | TokenLogprob], None],
              cancelled: Callable[[], bool], on_decision: Callable[[Decision], None] | None = None) -> FlightLike:
        """Put `request` in flight (fewer than max_batch are); `on_decision` hears its reuse
        decision, `emit` its text deltas (and TokenLogprobs) as later `step`s make them."""
        ...

    def step(self) -> list[FlightLike]:
        """One iteration over the flights; those that ended (completion or error set)."""
        ...


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
    dropped: bool = False  # cancelled while waiting and taken out of the queue (engine thread)

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
        self.max_batch = max(1, engine.max_batch)
        self._jobs: list[Job] = []  # FIFO: [running..., waiting...]; guarded by _wake
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._flights: dict[int, Job] = {}  # id(flight) -> its job (engine thread only)
        self._closing = False
        self._stopped = False
        self._mean_job_s = 5.0
        self.requests_served = 0

    @property
    def running(self) -> list[Job]:
        """The jobs on the model now, in admission order."""
        with self._wake:
            return [j for j in self._jobs if j.started_at is not None]

    @property
    def waiting(self) -> int:
        """Jobs waiting for the model whose clients are still there."""
        with self._wake:
            return sum(1 for j in self._jobs if j.started_at is None and not j.cancelled)

    def _holding(self) -> int:
        """Jobs that hold a place: running, or waiting for a client still there (under _wake)."""
        return sum(1 for j in self._jobs if j.started_at is not None or not j.cancelled)

    def can_admit(self) -> bool:
        with self._wake:
            return not self._closing and self._holding() < self.max_batch + self._max_queue

    def submit(self, request: GenerationRequest) -> Job:
        """Queue `request` or raise QueueFull / ShuttingDown."""
        if self._closing:
            raise ShuttingDown()
        if not self.can_admit():
            waiting = self.waiting
            raise QueueFull(waiting, max(1, math.ceil(self._mean_job_s * (waiting + 1) / self.max_batch)))
        loop = asyncio.get_running_loop()
        job = Job(request=request, submitted_at=time.monotonic(), result=loop.create_future())
        job.result.add_done_callback(lambda _: self._finished(job))
        with self._wake:
            self._jobs.append(job)
            if self._thread is None:
                self._loop = loop
                self._thread = threading.Thread(target=self._run, name="memrad-engine", daemon=True)
                self._thread.start()
            self._wake.notify()
        return job

    def _run(self) -> None:
        """The engine thread: admit in arrival order while there is room, step the engine."""
        self._engine.init_worker_thread()
        while True:
            with self._wake:
                while not self._stopped and not self._flights and not self._next_waiting() and not self._abandoned():
                    self._wake.wait()
                if self._stopped and not self._flights:
                    return
                dropped = self._abandoned()
                for job in dropped:
                    job.dropped = True
                admitted = []
                while len(self._flights) + len(admitted) < self.max_batch and (job := self._next_waiting()):
                    job.started_at = time.monotonic()
                    admitted.append(job)
            for job in dropped:  # their clients hung up while they waited: out before this step
                self._resolve(job, None)
            for job in admitted:
                self._start(job)
            if self._flights:
                for flight in self._step():
                    job = self._flights.pop(id(flight))
                    self._resolve(job, flight.completion, flight.error)

    def _next_waiting(self) -> Job | None:
        """The first live queued job the engine does not hold back (cancelled ones leave through _abandoned)."""
        return next((j for j in self._jobs if j.started_at is None and not j.cancelled and not self._engine.holds(j.request)),
                    None)

    def _abandoned(self) -> list[Job]:
        """Waiting jobs cancelled before they started, not yet dropped (under _wake)."""
        return [j for j in self._jobs if j.started_at is None and j.cancelled and not j.dropped]

    def _start(self, job: Job) -> None:
        if job.cancelled:
            return self._resolve(job, None)
        loop = self._loop
        put = lambda item: loop.call_soon_threadsafe(job.deltas.put_nowait, item)  # noqa: E731
        try:
            flight = self._engine.admit(job.request, put, job.cancel_event.is_set, on_decision=put)
            self._flights[id(flight)] = job
        except Exception as exc:
            self._resolve(job, None, exc)

    def _step(self) -> list[FlightLike]:
        try:
            return self._engine.step()
        except Exception as exc:  # the engine's own failures are per flight; this is the loop's
            log.exception("engine step failed: failing the requests in flight")
            ended = [job for job in self._flights.values()]
            self._flights.clear()
            for job in ended:
                self._resolve(job, None, exc)
            return []

    def _resolve(self, job: Job, completion: Completion | None, error: BaseException | None = None) -> None:
        """End a job's delta stream and settle its result (engine thread)."""
        def settle() -> None:
            job.deltas.put_nowait(None)
            if job.result.done():
                return
            if error is not None:
                job.result.set_exception(error)
            else:
                job.result.set_result(completion)

        self._loop.call_soon_threadsafe(settle)

    def _finished(self, job: Job) -> None:
        with self._wake:
            self._jobs.remove(job)
        if job.started_at is not None:
            self.requests_served += 1
            elapsed = time.monotonic() - job.started_at
            self._mean_job_s = 0.8 * self._mean_job_s + 0.2 * elapsed

    async def close(self, grace_s: float) -> None:
        """Stop admitting; cancel waiting jobs; give the running ones `grace_s`, then cancel them."""
        self._closing = True
        with self._wake:
            jobs = list(self._jobs)
        for job in jobs:
            if job.started_at is None:
                job.cancel()
        pending = [j.result for j in jobs if j.result is not None]
        if pending:
            done, not_done = await asyncio.wait(pending, timeout=grace_s)
            if not_done:
                log.info("shutdown: cancelling the in-flight requests after %.1f s", grace_s)
                for job in jobs:
                    job.cancel()
                await asyncio.wait(not_done)
        with self._wake:
            self._stopped = True
            self._wake.notify()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
