"""The engine tests' shared cast: an engine that keeps what it finished, a one-call `ask`,
and the story `Client` that rewrites its history the way real agent clients do. Unit and
integration tests both import it (tests/ is on sys.path through tests/conftest.py)."""

from __future__ import annotations

from memrad.engine.engine import Engine
from memrad.request import GenerationRequest, SamplingParams
from memrad.reuse.pool import ReusePool


def make_engine(loaded, chunk, threads=1, *, pool=True, max_sessions=16, max_bytes=10**9, sessions_per_name=16,
                disk=None, **flags):
    """An Engine whose finished states land in `engine.finished`. `pool`: True for a fresh
    ReusePool(max_sessions, max_bytes, sessions_per_name), False for none, or a pool to share; `disk`: a disk
    tier, indexed here so new session ids stay clear of its files (as memrad.engine.build)."""
    pool = ReusePool(max_sessions, max_bytes, sessions_per_name) if pool is True else pool or None
    if disk is not None:
        pool.skip_ids_up_to([s.session_id for s in disk.index()])
    finished = []
    engine = Engine(loaded, chunk, threads, pool, disk=disk, on_finished=finished.append, **flags)
    engine.finished = finished
    return engine


def ask(engine, messages, rid, salt=None, max_tokens=6):
    """One greedy request for `messages`: (its Completion, the FinishedState it left)."""
    text, ids = engine.chat.render(messages, None)
    request = GenerationRequest(rid, engine.model_id, tuple(ids), text,
                                SamplingParams(temperature=0.0, max_tokens=max_tokens), cache_salt=salt)
    completion = engine.generate(request, lambda _: None, lambda: False)
    return completion, engine.finished[-1]


def strip_tail(reply: str) -> str:
    """What a reasoning-stripping client sends back: the first half of the reply."""
    return reply[: len(reply) // 2]


class Client:
    """A chat client that rewrites every earlier reply before sending the history again."""

    def __init__(self, engine, system, rewrite=strip_tail, identity=None, salt=None):
        self.engine, self.rewrite, self.identity, self.salt = engine, rewrite, identity, salt
        self.messages = [{"role": "system", "content": system}]
        self.turn = 0

    def say(self, text, max_tokens=8):
        self.turn += 1
        self.messages.append({"role": "user", "content": text})
        rendered, ids = self.engine.chat.render(self.messages, None)
        request = GenerationRequest(f"{id(self)}-{self.turn}", self.engine.model_id, tuple(ids), rendered,
                                    SamplingParams(temperature=0.0, max_tokens=max_tokens),
                                    identity=self.identity, cache_salt=self.salt)
        completion = self.engine.generate(request, lambda _: None, lambda: False)
        self.messages.append({"role": "assistant", "content": self.rewrite(completion.text)})
        return completion
