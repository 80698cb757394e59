import asyncio
import threading

import pytest

from memrad.request import Completion, GenerationRequest, SamplingParams
from memrad.scheduler import QueueFull, Scheduler, ShuttingDown


class FakeEngine:
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
