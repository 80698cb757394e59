import asyncio
import threading

import pytest

from memrad.request import Completion, GenerationRequest, SamplingParams
from memrad.scheduler import QueueFull, Scheduler, ShuttingDown
from fake_engine import OneAtATime


class FakeEngine(OneAtATime):
    """Emits one delta per step until told to stop or `steps` are done."""

    def __init__(self, steps=3, step_s=0.01):
        self.steps = steps
        self.step_s = step_s
        self.order = []
        self.release = threading.Event()
        self.release.set()

    def init_worker_thread(self):
        self.thread = threading.current_thread().name

    def generate(self, request, emit, cancelled, on_decision=None):
        self.release.wait(5)
        self.order.append(request.request_id)
        done = 0
        while done < self.steps and not cancelled():
            threading.Event().wait(self.step_s)
            emit(f"{request.request_id}:{done} ")
            done += 1
        reason = "cancelled" if done < self.steps else "length"
        return Completion("", reason, 1, done, 0, 0.0, 0.0)


def req(i):
    return GenerationRequest(f"r{i}", "m", (1, 2), "ab", SamplingParams())


async def drain(job):
    out = []
    while (item := await job.deltas.get()) is not None:
        out.append(item)
    return out


async def test_jobs_run_one_at_a_time_in_arrival_order():
    engine = FakeEngine()
    scheduler = Scheduler(engine, max_queue=4)
    jobs = [scheduler.submit(req(i)) for i in range(3)]
    texts = [await drain(j) for j in jobs]
    await asyncio.gather(*(j.result for j in jobs))
    assert engine.order == ["r0", "r1", "r2"]
    assert texts[1] == ["r1:0 ", "r1:1 ", "r1:2 "]
    assert scheduler.requests_served == 3 and scheduler.waiting == 0
    assert engine.thread.startswith("memrad-engine")
    await scheduler.close(1.0)


async def test_admission_is_one_running_plus_max_queue_waiting():
    engine = FakeEngine()
    engine.release.clear()
    scheduler = Scheduler(engine, max_queue=1)
    first, second = scheduler.submit(req(0)), scheduler.submit(req(1))
    with pytest.raises(QueueFull) as info:
        scheduler.submit(req(2))
    assert info.value.retry_after_s >= 1
    engine.release.set()
    await asyncio.gather(first.result, second.result)
    assert scheduler.can_admit()
    await scheduler.close(1.0)


async def test_close_cancels_waiting_jobs_and_then_the_running_one_after_the_grace():
    engine = FakeEngine(steps=10_000, step_s=0.001)
    scheduler = Scheduler(engine, max_queue=4)
    running, waiting = scheduler.submit(req(0)), scheduler.submit(req(1))
    await asyncio.sleep(0.05)
    await scheduler.close(grace_s=0.1)
    assert (await running.result).finish_reason == "cancelled"
    assert await waiting.result is None  # never reached the model
    assert engine.order == ["r0"]
    with pytest.raises(ShuttingDown):
        scheduler.submit(req(2))


class FakeBatchEngine:
    """An engine that batches: `admit` puts a request in flight, each `step` emits one token
    for every flight; records who was in flight at each step."""

    def __init__(self, max_batch=2, steps=3):
        self.max_batch, self.steps = max_batch, steps
        self.flights = []
        self.admitted = []
        self.in_flight_per_step = []
        self.go = threading.Event()  # the engine thread starts once the test has queued its jobs
        self.go.set()

    def init_worker_thread(self):
        self.go.wait(10)

    def holds(self, request):
        return False

    def admit(self, request, emit, cancelled, on_decision=None):
        assert len(self.flights) < self.max_batch
        flight = type("Flight", (), {})()
        flight.request, flight.emit, flight.cancelled, flight.done = request, emit, cancelled, 0
        flight.completion, flight.error = None, None
        self.flights.append(flight)
        self.admitted.append(request.request_id)
        return flight

    def step(self):
        self.in_flight_per_step.append(tuple(f.request.request_id for f in self.flights))
        ended = []
        for flight in self.flights:
            threading.Event().wait(0.005)
            flight.emit(f"{flight.request.request_id}:{flight.done} ")
            flight.done += 1
            if flight.done == self.steps or flight.cancelled():
                reason = "length" if flight.done == self.steps else "cancelled"
                flight.completion = Completion("", reason, 1, flight.done, 0, 0.0, 0.0)
                ended.append(flight)
        for flight in ended:
            self.flights.remove(flight)
        return ended


async def test_a_batching_engine_runs_max_batch_jobs_together_and_admits_in_arrival_order():
    engine = FakeBatchEngine(max_batch=2, steps=3)
    engine.go.clear()  # all three queued before the engine thread admits any: no race on who is first seen
    scheduler = Scheduler(engine, max_queue=4)
    assert scheduler.max_batch == 2
    jobs = [scheduler.submit(req(i)) for i in range(3)]
    engine.go.set()
    texts = [await drain(j) for j in jobs]
    completions = await asyncio.gather(*(j.result for j in jobs))
    assert [c.finish_reason for c in completions] == ["length"] * 3
    assert engine.admitted == ["r0", "r1", "r2"]
    assert engine.in_flight_per_step[:3] == [("r0", "r1")] * 3  # r2 waits for a free row
    assert ("r2",) in engine.in_flight_per_step
    assert texts[1] == ["r1:0 ", "r1:1 ", "r1:2 "]
    assert scheduler.requests_served == 3
    await scheduler.close(1.0)


async def test_a_batching_engine_admits_max_batch_running_plus_max_queue_waiting():
    engine = FakeBatchEngine(max_batch=2, steps=10_000)
    scheduler = Scheduler(engine, max_queue=1)
    jobs = [scheduler.submit(req(i)) for i in range(3)]
    with pytest.raises(QueueFull):
        scheduler.submit(req(3))
    await asyncio.sleep(0.05)
    assert [j.request.request_id for j in scheduler.running] == ["r0", "r1"] and scheduler.waiting == 1
    jobs[0].cancel()
    assert (await jobs[0].result).finish_reason == "cancelled"
    await asyncio.sleep(0.05)
    assert [j.request.request_id for j in scheduler.running] == ["r1", "r2"]
    await scheduler.close(grace_s=0.05)
    assert [(await j.result).finish_reason for j in jobs[1:]] == ["cancelled", "cancelled"]
