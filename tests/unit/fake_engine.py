"""A torch-free engine for server tests where the model is not the point (routing, limits,
the access guard): it implements memrad.server.context.ServingEngine and nothing more.
`OneAtATime` gives a fake with a blocking `generate` the scheduler's admit/step."""

from __future__ import annotations

from memrad.chat.reply import ReplyDelta
from memrad.protocol import Decision, PoolStats
from memrad.request import Completion


class FakeChat:
    """Characters as tokens; a conversation renders as role-tagged lines; replies are all content."""

    vocab_size = 0x110000

    def render(self, messages, tools, require_call=False, call_name=None):
        text = "".join(f"<{m['role']}>{m.get('content') or ''}\n" for m in messages) + "<assistant>"
        return text, self.encode(text)

    def encode(self, text):
        return [ord(c) for c in text]

    def decode(self, ids):
        return "".join(chr(i) for i in ids)

    def parser(self, prompt_text, parse_tools, tool_names=None):
        return FakeParser()

    def tool_constraint(self, tools, mode, name, parallel):
        return None  # no call syntax: replies stay free

    def grammar_error(self, constraint):
        return None

    compiling = None


class FakeParser:
    def feed(self, text):
        return [ReplyDelta("content", text)] if text else []

    def finish(self):
        return []


class FakeEvents:
    def __init__(self):
        self.sinks = []

    def subscribe(self, sink):
        self.sinks.append(sink)


class Done:
    """A flight `OneAtATime.admit` ran to its end (memrad.scheduler.FlightLike)."""

    def __init__(self, completion):
        self.completion, self.error = completion, None


class OneAtATime:
    """memrad.scheduler.EngineLike over a blocking `generate(request, emit, cancelled,
    on_decision)`: `admit` runs the whole request (its error raises there, as the real
    engine's admission errors do) and the next `step` hands it back; max_batch 1."""

    max_batch = 1

    def holds(self, request):
        return False  # nothing waits for another's prefill: one at a time

    def admit(self, request, emit, cancelled, on_decision=None):
        flight = Done(self.generate(request, emit, cancelled, on_decision))
        self.__dict__.setdefault("_done", []).append(flight)
        return flight

    def step(self):
        done, self._done = self.__dict__.get("_done", []), []
        return done


class FakeEngine(OneAtATime):
    """Answers every request with one word per token ("ok "), up to max_tokens (default 4)."""

    model_id = "fake-model"
    context_len = 4096
    runtime_choices = {"dtype": {"value": "none", "reason": "a fake engine"},
                       "context": {"value": "native", "reason": "4,096 tokens, within the model's native 4,096"}}

    def __init__(self):
        self.chat = FakeChat()
        self.events = FakeEvents()
        self.requests = []

    def init_worker_thread(self):
        pass

    def generate(self, request, emit, cancelled, on_decision=None):
        self.requests.append(request)
        decision = Decision(request.request_id, "cold", "a fake engine plans nothing", 0, request.num_prompt_tokens)
        if on_decision is not None:
            on_decision(decision)
        words = ["ok "] * (request.sampling.max_tokens or 4)
        for word in words:
            emit(word)
        return Completion(text="".join(words), finish_reason="length", prompt_tokens=request.num_prompt_tokens,
                          completion_tokens=len(words), cached_tokens=0, ttft_s=0.0, total_s=0.0, decision=decision)

    def stats(self):
        return PoolStats(0, 0, 0, 0)  # no pool, no disk tier

    def infos(self):
        return []

    def flight_infos(self):
        return []

    def close(self):
        return []


class SlowEngine(FakeEngine):
    """A FakeEngine with time: `prefill_chunks` chunks of `chunk_s` before the first token,
    then one token per `step_s`; `cancelled` is polled where the real engine polls it
    (between chunks, before each step). Records what ran and when the cancel was seen."""

    def __init__(self, step_s=0.01, prefill_chunks=0, chunk_s=0.1):
        super().__init__()
        self.step_s, self.prefill_chunks, self.chunk_s = step_s, prefill_chunks, chunk_s
        self.chunks_run = 0
        self.tokens = 0
        self.cancel_seen_at = None
        self.started = None  # set when a request starts (threading.Event)
        import threading

        self.started = threading.Event()

    def generate(self, request, emit, cancelled, on_decision=None):
        import time

        self.requests.append(request)
        self.chunks_run = self.tokens = 0
        decision = Decision(request.request_id, "cold", "a fake engine plans nothing", 0, request.num_prompt_tokens)
        if on_decision is not None:
            on_decision(decision)
        self.started.set()
        finish, max_tokens = "length", request.sampling.max_tokens or 4
        for _ in range(self.prefill_chunks):
            if cancelled():
                finish = "cancelled"
                break
            time.sleep(self.chunk_s)
            self.chunks_run += 1
        while finish != "cancelled" and self.tokens < max_tokens:
            if cancelled():
                finish = "cancelled"
                break
            time.sleep(self.step_s)
            self.tokens += 1
            emit("ok ")
        if finish == "cancelled":
            self.cancel_seen_at = time.monotonic()
        return Completion(text="ok " * self.tokens, finish_reason=finish, prompt_tokens=request.num_prompt_tokens,
                          completion_tokens=self.tokens, cached_tokens=0, ttft_s=0.0, total_s=0.0, decision=decision)
