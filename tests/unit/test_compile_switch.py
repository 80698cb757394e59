"""The compiled step landing while the daemon serves (compile = auto): no reply waits for it.

A request decodes on the step that was open when it was admitted, from its first token to its
last, and says which (the decision's `step`, the turn's, the flight's); one admitted after the
step landed decodes compiled. The stand-in for the compiled step here is the eager step with
its logits nudged, so its bits differ from eager's the way inductor's do, and a test can tell
which one ran. Parked state never depends on the step: a turn decoded eager, resumed after
the switch, equals the same turn run cold on the compiled step.
"""

import threading

import torch

from memrad.protocol import FlightEvent, TurnEvent
from memrad.request import GenerationRequest, SamplingParams
from stories import make_engine
from test_reuse import SYSTEM


class Nudged:
    """The compiled step's stand-in: the eager step's logits plus a fixed ramp (counted)."""

    def __init__(self, eager):
        self.eager, self.calls = eager, 0

    def __call__(self, *args):
        self.calls += 1
        logits = self.eager(*args)  # [1, V]
        return logits + torch.linspace(0, 2e-3, logits.shape[-1], dtype=logits.dtype)


def engine_with_a_pending_compile(tiny_loaded, monkeypatch):
    """An exact-mode engine under compile = auto whose build lands when `land` is set."""
    engine = make_engine(tiny_loaded, 16, compile="auto")
    decoder = engine.decoder
    land, nudged = threading.Event(), Nudged(decoder.eager)

    def build():
        assert land.wait(60)
        decoder._ready(nudged, decoder.current[1], "a test's build", 0.0)

    monkeypatch.setattr(decoder, "_open_package", lambda: False)  # an empty compile cache
    monkeypatch.setattr(decoder, "_compile", build)
    engine.start_background()
    assert decoder.choice.value == "compiling" and "new requests decode on the eager step" in decoder.choice.reason
    return engine, land, nudged


def request(engine, messages, rid, max_tokens=10, salt=None):
    text, ids = engine.chat.render(messages, None)
    return GenerationRequest(rid, engine.model_id, tuple(ids), text,
                             SamplingParams(temperature=0.0, max_tokens=max_tokens), cache_salt=salt)


def run(engine, req, on_step=None):
    """Drive one request by `step`s; `on_step(flight)` after each. Returns (completion, decision heard)."""
    heard = []
    flight = engine.admit(req, lambda _: None, lambda: False, on_decision=heard.append)
    while flight.completion is None and flight.error is None:
        engine.step()
        if on_step is not None:
            on_step(flight)
    assert flight.error is None, flight.error
    return flight.completion, heard[0]


MESSAGES = [SYSTEM, {"role": "user", "content": "turn 0: list files, then open README.md"}]


def test_a_request_admitted_before_the_compile_lands_decodes_eager_to_its_last_token(tiny_loaded, monkeypatch):
    engine, land, nudged = engine_with_a_pending_compile(tiny_loaded, monkeypatch)
    steps_seen = []

    def land_mid_reply(flight):
        steps_seen.append(flight.info().step)
        if len(flight.out.generated) == 3 and not land.is_set():
            land.set()
            engine.decoder.wait()  # landed: requests admitted from now on decode compiled
            assert engine.decoder.choice.value == "compiled"

    first, heard = run(engine, request(engine, MESSAGES, "a"), land_mid_reply)
    assert heard.step == "eager" and first.decision.step == "eager"  # said before the first byte, and at the end
    assert land.is_set() and first.completion_tokens == 10 and nudged.calls == 0  # never switched mid-reply
    assert set(steps_seen) == {"eager"}
    # the same reply as a request that never saw a compile (an engine whose build never lands)
    alone, never, _ = engine_with_a_pending_compile(tiny_loaded, monkeypatch)
    assert run(alone, request(alone, MESSAGES, "a"))[0].text == first.text
    never.set()

    later, heard = run(engine, request(engine, MESSAGES, "b", salt="another"))
    assert heard.step == later.decision.step == "compiled" and nudged.calls == later.completion_tokens - 1


def test_the_step_is_in_the_turn_and_flight_events(tiny_loaded, monkeypatch):
    events = []
    engine, land, _ = engine_with_a_pending_compile(tiny_loaded, monkeypatch)
    engine.events = lambda make: events.append(make())  # the control socket's records, as published
    run(engine, request(engine, MESSAGES, "a", max_tokens=3))
    land.set()
    engine.decoder.wait()
    run(engine, request(engine, MESSAGES, "b", max_tokens=3, salt="s"))
    turns = [e for e in events if isinstance(e, TurnEvent)]
    assert [(t.request_id, t.step) for t in turns] == [("a", "eager"), ("b", "compiled")]
    flights = {(e.flight.request_id, e.flight.step) for e in events if isinstance(e, FlightEvent)}
    assert flights == {("a", "eager"), ("b", "compiled")}


def ask(engine, messages, rid, salt=None):
    completion, _ = run(engine, request(engine, messages, rid, max_tokens=8, salt=salt))
    return completion, engine.finished[-1]


def test_a_turn_decoded_eager_resumes_after_the_switch_as_a_cold_run_on_the_compiled_step(tiny_loaded, monkeypatch):
    engine, land, nudged = engine_with_a_pending_compile(tiny_loaded, monkeypatch)
    messages = list(MESSAGES)
    turn0, state0 = ask(engine, messages, "t0")
    assert turn0.decision.step == "eager" and turn0.decision.outcome == "cold"
    # exact mode parks no decoded KV: nothing past the prompt is reusable, so the step left no trace
    (session,) = engine.parking.pool.sessions()
    assert session.prompt_checkpoint == turn0.prompt_tokens
    assert session.exact_limit <= turn0.prompt_tokens and all(c <= turn0.prompt_tokens for c in session.checkpoints)
    land.set()
    engine.decoder.wait()
    messages += [{"role": "assistant", "content": turn0.text}, {"role": "user", "content": "turn 1: and then?"}]
    warm, warm_state = ask(engine, messages, "t1")
    cold, cold_state = ask(engine, messages, "c1", salt="cold")
    assert warm.decision.outcome == "resumed" and warm.cached_tokens == turn0.prompt_tokens
    assert cold.decision.outcome == "cold" and warm.decision.step == cold.decision.step == "compiled"
    assert nudged.calls > 0
    assert torch.equal(warm_state.prompt_logits, cold_state.prompt_logits)
    assert warm_state.generated_ids == cold_state.generated_ids and warm.text == cold.text


def test_resumed_equals_cold_on_the_eager_step_while_the_compile_is_pending(tiny_loaded, monkeypatch):
    engine, land, nudged = engine_with_a_pending_compile(tiny_loaded, monkeypatch)
    messages = list(MESSAGES)
    for turn in range(3):
        warm, warm_state = ask(engine, messages, f"t{turn}")
        cold, cold_state = ask(engine, messages, f"c{turn}", salt=f"cold-{turn}")
        assert warm.decision.outcome == ("resumed" if turn else "cold")
        assert warm.decision.step == cold.decision.step == "eager"
        assert torch.equal(warm_state.prompt_logits, cold_state.prompt_logits)
        assert warm_state.generated_ids == cold_state.generated_ids
        messages += [{"role": "assistant", "content": warm.text}, {"role": "user", "content": f"turn {turn + 1}"}]
    assert nudged.calls == 0 and engine.decoder.compiling()
    land.set()


def test_the_decision_names_the_step_before_the_batched_step_is_made(tiny_loaded, monkeypatch):
    # the first batched step of a kind is checked on a scratch request (seconds on a busy CPU):
    # the decision, with its step, leaves first, so a stream's headers carry it
    engine = make_engine(tiny_loaded, 16, max_batch=2)
    heard, made = [], []
    make = engine.decoder._batch_step

    def slow_to_make(*args):
        made.append(list(heard))
        return make(*args)

    monkeypatch.setattr(engine.decoder, "_batch_step", slow_to_make)
    flight = engine.admit(request(engine, MESSAGES, "a", max_tokens=2), lambda _: None, lambda: False,
                          on_decision=heard.append)
    assert [[d.step for d in seen] for seen in made] == [["eager"]] and flight.feed.step == "eager"
