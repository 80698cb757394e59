"""No prefill done twice: a retry of a prompt still prefilling waits for that prefill and forks
it (memrad.reuse.attach, memrad.engine.attaching), or resumes what its cancel parked; either
way its reply equals a cold run's, bit for bit."""

import pytest
import torch

import stories
from memrad.request import GenerationRequest, SamplingParams
from memrad.reuse.attach import Attachment, fork_point

CHUNK = 16


def test_the_fork_point_is_the_last_cut_of_the_shared_prompt_with_a_token_left():
    source = tuple(range(100))
    assert fork_point(source, (), source, 16) == 96  # an identical retry: one token left at least
    assert fork_point(tuple(range(96)), (), tuple(range(96)), 16) == 80
    assert fork_point(source + (7, 8), (), source, 16) == 96  # extends it: up to the source's prompt
    assert fork_point(source + (7,) * 40, (), source, 16) == 96
    assert fork_point(source, (50,), source, 16) == 98  # the grid restarts at a reply anchor
    assert fork_point((1,) + source[1:], (), source, 16) is None  # diverges: not a retry
    assert fork_point(source[:50], (), source, 16) is None  # shorter than the source
    assert fork_point(tuple(range(10)), (), tuple(range(10)), 16) is None  # no cut above 0
    a = Attachment("req-a", 9185, 6144, 8960)
    assert a.forked(225) == "attached to a running prefill at 6,144 of 9,185 (req-a); forked at 8,960; primed 225"


def ask(engine, rid, salt=None):
    text, ids = engine.chat.render([{"role": "user", "content": "Read the file, then answer. " * 12}], None)
    return GenerationRequest(rid, engine.model_id, tuple(ids), text,
                             SamplingParams(temperature=0.0, max_tokens=6, logprobs=3), cache_salt=salt)


def cold(loaded, max_batch=4):
    """The request alone, cold, on an engine that decodes as the one under test (fp32 batched
    rows are not one-row bits: a lone request runs padded there)."""
    engine = stories.recording(stories.make_engine(loaded, CHUNK, pool=False, max_batch=max_batch))
    done = engine.generate(ask(engine, "cold"), lambda _: None, lambda: False)
    return done, torch.stack(engine.scores[id(engine.finished[-1].request.sampling)])


def drive(engine, a, b, a_cancelled=lambda: False, steps_before=2):
    """Admit `a`, step it `steps_before` times, then hold `b` until the engine lets it in and
    run both to the end: (a's flight, b's flight, whether b was held, the holds seen)."""
    first = engine.admit(a, lambda _: None, a_cancelled)
    for _ in range(steps_before):
        engine.step()
    held = engine.holds(b)
    seen = 0
    while engine.holds(b):
        seen += 1
        engine.step()
    second = engine.admit(b, lambda _: None, lambda: False)
    while any(f.completion is None and f.error is None for f in (first, second)):
        engine.step()
    return first, second, held, seen


def scores(engine, flight):
    return torch.stack(engine.scores[id(flight.request.sampling)])


def test_an_identical_retry_waits_for_the_running_prefill_and_forks_it(tiny_loaded):
    engine = stories.recording(stories.make_engine(tiny_loaded, CHUNK, max_batch=4))
    a, b = ask(engine, "a"), ask(engine, "b")
    n = len(a.prompt_ids)
    first, second, held, seen = drive(engine, a, b)
    target = (n - 1) // CHUNK * CHUNK
    assert held and seen == target // CHUNK - 2  # A ran 2 chunks; B waited for the rest up to target
    assert second.completion.decision.render() == (
        f"live: resumed (attached to a running prefill at {2 * CHUNK} of {n} (a); forked at {target}; "
        f"primed {n - target})")
    assert second.completion.cached_tokens == target
    reference, reference_scores = cold(tiny_loaded)
    for flight in (first, second):
        assert flight.completion.text == reference.text and flight.completion.logprobs == reference.logprobs
        assert torch.equal(scores(engine, flight), reference_scores)
    # the fork copied A's rows: both parked, each its own
    assert engine.stats().sessions == 2


def test_a_retry_whose_source_is_cancelled_resumes_what_the_cancel_parked(tiny_loaded):
    engine = stories.recording(stories.make_engine(tiny_loaded, CHUNK, max_batch=4))
    a, b = ask(engine, "a"), ask(engine, "b")
    n = len(a.prompt_ids)
    gone = {"now": False}
    first = engine.admit(a, lambda _: None, lambda: gone["now"])
    engine.step(), engine.step()
    assert engine.holds(b)
    gone["now"] = True  # A's client hung up: its cancel lands in the next step and parks 2 chunks
    engine.step()
    assert first.completion.finish_reason == "cancelled" and not engine.holds(b)
    second = engine.admit(b, lambda _: None, lambda: False)
    while second.completion is None:
        engine.step()
    assert second.completion.decision.render() == (
        f"token-prefix: resumed (attached to a running prefill at {2 * CHUNK} of {n} (a), which ended first; "
        f"session s1; checkpoint {2 * CHUNK}; primed {n - 2 * CHUNK})")
    reference, reference_scores = cold(tiny_loaded)
    assert second.completion.text == reference.text and second.completion.logprobs == reference.logprobs
    assert torch.equal(scores(engine, second), reference_scores)


def test_a_request_extending_one_that_already_decodes_forks_it_at_once(tiny_loaded):
    engine = stories.recording(stories.make_engine(tiny_loaded, CHUNK, max_batch=4))
    a = ask(engine, "a")
    first = engine.admit(a, lambda _: None, lambda: False)
    while first.phase == "prefill":
        engine.step()
    longer = GenerationRequest("b", engine.model_id, a.prompt_ids + a.prompt_ids[:20], a.prompt_text,
                               SamplingParams(temperature=0.0, max_tokens=4))
    assert not engine.holds(longer)
    second = engine.admit(longer, lambda _: None, lambda: False)
    n = len(a.prompt_ids)
    target = n  # A's prompt ends with the reply header: a reply anchor, so a cut (memrad.grid)
    assert second.completion is None and second.pre.start == target
    assert second.decided.decision.render() == (
        f"live: resumed (attached to a running prefill at {n} of {n} (a); forked at {target}; "
        f"primed {n + 20 - target})")


def test_nothing_attaches_across_salts_with_the_pool_off_or_where_the_pool_offers_as_much(tiny_loaded):
    engine = stories.make_engine(tiny_loaded, CHUNK, max_batch=4)
    first = engine.admit(ask(engine, "a"), lambda _: None, lambda: False)
    engine.step()
    assert not engine.holds(ask(engine, "b", salt="other"))
    assert not engine.holds(GenerationRequest("c", engine.model_id, (5,) * 80, "x", SamplingParams(max_tokens=2)))
    off = stories.make_engine(tiny_loaded, CHUNK, pool=False, max_batch=4)
    off.admit(ask(off, "a"), lambda _: None, lambda: False)
    off.step()
    assert off.attacher is None and not off.holds(ask(off, "b"))
    while first.completion is None:
        engine.step()
    assert not engine.holds(ask(engine, "d"))  # nothing in flight


def test_a_hybrid_source_snapshots_the_cut_its_retry_forks_at(loaded):
    model = loaded["qwen3_next"]
    engine = stories.recording(stories.make_engine(model, CHUNK, max_batch=4))
    a, b = ask(engine, "a"), ask(engine, "b")
    first, second, held, _ = drive(engine, a, b, steps_before=1)
    n = len(a.prompt_ids)
    target = (n - 1) // CHUNK * CHUNK
    assert held and not first.croppable and second.pre.start == target
    assert second.completion.decision.outcome == "resumed" and second.completion.decision.tier == "live"
    reference_engine = stories.recording(stories.make_engine(model, CHUNK, pool=False, max_batch=4))
    reference = reference_engine.generate(ask(reference_engine, "cold"), lambda _: None, lambda: False)
    assert second.completion.text == reference.text and second.completion.logprobs == reference.logprobs
    assert torch.equal(scores(engine, second), torch.stack(list(reference_engine.scores.values())[-1]))
