"""The engine tests' shared cast: an engine that keeps what it finished, a one-call `ask`,
and the story `Client` that rewrites its history the way real agent clients do. Unit and
integration tests both import it (tests/ is on sys.path through tests/conftest.py)."""

from __future__ import annotations

import torch

from memrad.engine.engine import Engine, EngineOptions
from memrad.engine.parking import NoDisk
from memrad.request import GenerationRequest, SamplingParams
from memrad.reuse.pool import ReusePool


def make_engine(loaded, chunk, threads=1, *, pool=True, max_sessions=16, max_bytes=10**9, sessions_per_name=16,
                disk=None, events=None, **flags):
    """An Engine whose finished states land in `engine.finished`. `pool`: True for a fresh
    ReusePool(max_sessions, max_bytes, sessions_per_name), False for none, or a pool to share; `disk`: a disk
    tier, indexed here so new session ids stay clear of its files (as memrad.engine.build), or None for none;
    `events`: a Publisher (memrad.engine.events); `flags`: EngineOptions fields."""
    pool = ReusePool(max_sessions, max_bytes, sessions_per_name) if pool is True else pool or None
    if disk is None:
        disk = NoDisk()
    else:
        disk.index()
        pool.skip_ids_up_to(disk.session_ids())
    finished = []
    engine = Engine(loaded, EngineOptions(chunk, threads, **flags), pool, disk, events=events,
                    on_finished=finished.append)
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


def layer_contents(layer):
    """Everything a cache layer holds, comparable: tensors by name (with dtype and shape), and
    its plain attributes. A SlabLayer is its visible rows and length; a WindowLayer its visible
    window and the tokens it has seen (where the window sits in its buffer is not state)."""
    from memrad.engine.state.kv import SlabLayer
    from memrad.engine.state.window import WindowLayer

    if isinstance(layer, SlabLayer):
        return ({"keys": layer.keys, "values": layer.values} if layer.is_initialized else {}), {"length": layer.length}
    if isinstance(layer, WindowLayer):
        return (({"keys": layer.keys, "values": layer.values} if layer.is_initialized else {}),
                {"length": layer.cumulative_length, "initialized": layer.is_initialized})
    tensors, plain = {}, {}
    for name, value in vars(layer).items():
        if isinstance(value, torch.Tensor):
            tensors[name] = value
        elif isinstance(value, dict):
            for k, v in value.items():
                (tensors if isinstance(v, torch.Tensor) else plain)[f"{name}.{k}"] = v
        elif value is None or isinstance(value, (bool, int, float, str, torch.dtype, torch.device)):
            plain[name] = value
    return tensors, plain


def assert_same_state(loaded_state, parked_state):
    """Two parked states hold the same layers, snapshots, tensors (dtype, shape, bits) and attributes."""
    snaps = lambda s: {"final": s.final, **{f"at{p}": v for p, v in s.snapshots.items()}}
    got, want = snaps(loaded_state), snaps(parked_state)
    assert got.keys() == want.keys() and loaded_state.croppable == parked_state.croppable
    for tag in want:
        assert got[tag].num_tokens == want[tag].num_tokens
        assert [type(x).__name__ for x in got[tag].layers] == [type(x).__name__ for x in want[tag].layers]
        for i, (g, w) in enumerate(zip(got[tag].layers, want[tag].layers)):
            (gt, gp), (wt, wp) = layer_contents(g), layer_contents(w)
            assert gp == wp, (tag, i)
            assert gt.keys() == wt.keys(), (tag, i)
            for name in wt:
                assert gt[name].dtype == wt[name].dtype and gt[name].shape == wt[name].shape, (tag, i, name)
                assert torch.equal(gt[name], wt[name]), (tag, i, name)


def recording(engine):
    """Greedy sampling that keeps every step's logits [V] per request (by its SamplingParams)."""
    engine.scores = {}

    def sampler(scores, params, generator):
        engine.scores.setdefault(id(params), []).append(scores.clone())
        return int(scores.argmax())

    engine.sampler = sampler
    return engine


def run_together(engine, requests, cancel_after=None):
    """Admit `requests` at once on a `recording` engine and step until all are done:
    {rid: (completion, finished state, every step's logits [steps, V])}. `cancel_after`
    {rid: n}: that request is cancelled once it has emitted n deltas."""
    cancel_after = cancel_after or {}
    emitted = {r.request_id: 0 for r in requests}

    def emit_for(rid):
        def emit(_):
            emitted[rid] += 1
        return emit

    flights = [engine.admit(r, emit_for(r.request_id),
                            lambda rid=r.request_id: rid in cancel_after and emitted[rid] >= cancel_after[rid])
               for r in requests]
    while any(f.completion is None and f.error is None for f in flights):
        engine.step()
    states = {state.request.request_id: state for state in engine.finished}
    return {f.request.request_id: (f.completion, states.get(f.request.request_id),
                                   torch.stack(engine.scores[id(f.request.sampling)]))
            for f in flights}


def assert_second_turn_resumes_as_cold(engine, first_turn, follow_up, max_tokens=4):
    """Ask `first_turn`, then the turn after it (its reply, then `follow_up` from the user) twice:
    resumed from the first turn's parked state, and cold (another salt). Asserts the resume reused
    the whole first prompt and gave the cold run's logits and text bit for bit; returns the first
    turn's Completion."""
    first, _ = ask(engine, first_turn, "t1", max_tokens=max_tokens)
    second_turn = first_turn + [{"role": "assistant", "content": first.text}, {"role": "user", "content": follow_up}]
    warm, warm_state = ask(engine, second_turn, "t2", max_tokens=max_tokens)
    cold, cold_state = ask(engine, second_turn, "t2-cold", salt="cold", max_tokens=max_tokens)
    assert warm.decision.outcome == "resumed", warm.decision.render()
    assert warm.cached_tokens == first.prompt_tokens and cold.cached_tokens == 0
    assert torch.equal(warm_state.prompt_logits, cold_state.prompt_logits)
    assert warm.text == cold.text
    return first
