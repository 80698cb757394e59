"""Continuous batching: several requests in flight on one engine, with the same bits as alone.

The same greedy requests (prompts of different lengths, two resumed from parked sessions) run
alone and in batches of 2, 3 and 4: identical tokens, identical first-token logits and
identical per-token log probabilities (which read every decode step's logits). A resumed
request batched with others still equals its cold run; cancelling one batched request
leaves the others' replies as they were alone; a short request admitted during a long
prefill gets its first token before that prefill ends (ordered by engine steps, not time).
The batched step compiled (its own AOTInductor package, the tiny int4 llama in bf16): an
exact-mode request waits for it, a second process opens it without building, and it keeps
the same bits alone and in batches of 2, 3 and 4 (within 0.01 of the eager batched step, not
bit for bit: another graph).
"""

import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from memrad.engine.decode import build_times, builder
from memrad.engine.decode import package as step_package
from memrad.engine.decode.batch import BatchStep
from memrad.engine.decode.decoder import cxx_compiler
from memrad.engine.model.loader import load_model
from memrad.request import GenerationRequest, SamplingParams
from stories import make_engine, recording, run_together

CHUNK = 16
SYSTEM = {"role": "system", "content": "You are terse."}


def conversation(topic: str, turns: int) -> list[dict]:
    messages = [SYSTEM]
    for i in range(turns):
        messages.append({"role": "user", "content": f"{topic} question {i}: " + "tell me more " * (3 + 4 * i)})
        messages.append({"role": "assistant", "content": f"{topic} answer {i} " * (2 + i)})
    return messages


def request(engine, messages, rid, max_tokens=8):
    text, ids = engine.chat.render(messages, None)
    return GenerationRequest(rid, engine.model_id, tuple(ids), text,
                             SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=2))


def engine_with_parked(tiny_loaded, **flags):
    """A batching engine whose pool holds turn 1 of conversations "a" and "b" (served alone)."""
    engine = recording(make_engine(tiny_loaded, CHUNK, max_batch=4, **flags))
    for topic in ("a", "b"):
        engine.generate(request(engine, conversation(topic, 1)[:-1], f"{topic}-1"), lambda _: None, lambda: False)
    return engine


def in_flight_together_as_alone(loaded) -> None:
    """Four requests, two resumed from parked sessions, decoding on the batched step together:
    each one's tokens, first logits and every step's scores are as when it runs alone."""
    engine = engine_with_parked(loaded)
    together = run_together(engine, second_turns(engine))
    assert {rid for rid, (c, _, _) in together.items() if c.decision.outcome == "resumed"} == {"a-2", "b-2"}
    for index in range(4):
        by_itself = engine_with_parked(loaded)
        request = second_turns(by_itself)[index]
        completion, state, scores = run_together(by_itself, [request])[request.request_id]
        their_completion, their_state, their_scores = together[request.request_id]
        assert state.generated_ids == their_state.generated_ids and len(state.generated_ids) > 1
        assert completion.cached_tokens == their_completion.cached_tokens
        assert torch.equal(state.prompt_logits, their_state.prompt_logits)
        assert torch.equal(scores, their_scores), request.request_id  # every decode step's logits


def second_turns(engine):
    """Four requests: two resume turn 1 of "a" / "b", two are fresh prompts of other lengths."""
    return [request(engine, conversation("a", 2)[:-1], "a-2"),
            request(engine, conversation("c", 1)[:-1], "c-1", max_tokens=5),
            request(engine, conversation("b", 2)[:-1], "b-2", max_tokens=11),
            request(engine, conversation("d", 3)[:-1], "d-3", max_tokens=6)]


def summary(completion, state, scores):
    return (state.generated_ids, completion.finish_reason, completion.cached_tokens,
            tuple(lp.logprob for lp in completion.logprobs), scores.shape)


@pytest.fixture(scope="module")
def alone(tiny_loaded):
    """Each second-turn request run alone on its own engine (padded to 4 rows)."""
    out = {}
    for index in range(4):
        engine = engine_with_parked(tiny_loaded)
        req = second_turns(engine)[index]
        out[req.request_id] = run_together(engine, [req])[req.request_id]
    return out


@pytest.mark.parametrize("group", [g for size in (2, 3, 4) for g in itertools.combinations(range(4), size)][::2])
def test_a_request_decodes_the_same_bits_alone_and_batched(tiny_loaded, alone, group):
    engine = engine_with_parked(tiny_loaded)
    requests = [second_turns(engine)[i] for i in group]
    together = run_together(engine, requests)
    for req in requests:
        completion, state, scores = together[req.request_id]
        alone_completion, alone_state, alone_scores = alone[req.request_id]
        assert summary(completion, state, scores) == summary(alone_completion, alone_state, alone_scores)
        assert torch.equal(state.prompt_logits, alone_state.prompt_logits), req.request_id
        assert torch.equal(scores, alone_scores), req.request_id  # every decode step's logits, bit for bit
    resumed = {rid for rid, (c, _, _) in together.items() if c.decision.outcome == "resumed"}
    assert resumed == {"a-2", "b-2"} & {r.request_id for r in requests}


def test_every_row_of_the_batched_step_is_its_own_at_any_neighbours(tiny_loaded):
    """The fixed-shape claim itself: a row's logits do not change with the other rows' tokens."""
    rows_are_their_own(make_engine(tiny_loaded, CHUNK, max_batch=4), tiny_loaded.model, CHUNK)


def rows_are_their_own(engine, model, chunk: int) -> torch.Tensor:
    """Run four prompts through `engine`'s batched step of 4 rows in several groupings and
    check the first prompt's row is the same bits in each; returns that row's logits [V]
    (token 11 after range(5, 45))."""
    from memrad.engine.forward import prefill

    step = engine.decoder.batch_step(4)
    assert isinstance(step, BatchStep) and step.rows == 4
    assert engine.decoder.batch_step(4) is step  # one per (rows, attention): a request keeps its step
    prompts = [list(range(5, 45)), list(range(7, 20)), list(range(9, 90)), list(range(3, 33))]

    def logits(rows):
        caches = []
        for i in rows:
            cache = engine.new_cache()
            prefill(model, cache, prompts[i], 0, chunk)
            caches.append(cache)
        return step(caches, [11 + i for i in rows], [len(prompts[i]) for i in rows])

    first = logits([0])[0]
    assert torch.equal(logits([0, 1])[0], first)
    assert torch.equal(logits([0, 3, 2, 1])[0], first)
    assert torch.equal(logits([2, 0])[1], first)
    return first


def test_a_resumed_request_batched_with_others_equals_its_cold_run(tiny_loaded):
    engine = engine_with_parked(tiny_loaded)
    requests = second_turns(engine)
    together = run_together(engine, requests)
    completion, state, scores = together["a-2"]
    assert completion.decision.outcome == "resumed" and completion.cached_tokens > 0
    cold_engine = recording(make_engine(tiny_loaded, CHUNK, pool=False, max_batch=4))
    cold = run_together(cold_engine, [request(cold_engine, conversation("a", 2)[:-1], "a-2")])["a-2"]
    assert cold[0].cached_tokens == 0
    assert state.generated_ids == cold[1].generated_ids
    assert torch.equal(state.prompt_logits, cold[1].prompt_logits)
    assert [lp.logprob for lp in completion.logprobs] == [lp.logprob for lp in cold[0].logprobs]
    assert torch.equal(scores, cold[2])


def test_cancelling_one_batched_request_leaves_the_others_as_they_were_alone(tiny_loaded, alone):
    engine = engine_with_parked(tiny_loaded)
    requests = second_turns(engine)
    together = run_together(engine, requests, cancel_after={"b-2": 2})
    cancelled, _, _ = together["b-2"]
    assert cancelled.finish_reason == "cancelled" and cancelled.completion_tokens < 11
    for rid in ("a-2", "c-1", "d-3"):
        assert summary(*together[rid]) == summary(*alone[rid]), rid
        assert torch.equal(together[rid][2], alone[rid][2]), rid


def test_a_short_request_gets_its_first_token_before_a_long_prefill_ends(tiny_loaded):
    engine = make_engine(tiny_loaded, CHUNK, max_batch=4)
    long = request(engine, [SYSTEM, {"role": "user", "content": "go on " * 120}], "long", max_tokens=4)
    short = request(engine, [SYSTEM, {"role": "user", "content": "hi"}], "short", max_tokens=4)
    assert len(long.prompt_ids) > 8 * CHUNK > 2 * CHUNK >= len(short.prompt_ids)
    order = []
    slow = engine.admit(long, lambda _: None, lambda: False)
    engine.step()  # the long prompt's first chunk
    quick = engine.admit(short, lambda _: None, lambda: False)
    for step in range(200):
        engine.step()
        for name, flight in (("long", slow), ("short", quick)):
            if flight.out.ttft_s is not None and (name, "first token") not in order:
                order.append((name, "first token"))
        if slow.completion is not None and quick.completion is not None:
            break
    # Prefill turns go round the flights still prefilling, a new one first: the short prompt
    # (two chunks) is primed in the two steps after it arrives, while the long one has chunks left.
    assert order[0] == ("short", "first token"), order
    assert quick.completion.completion_tokens == 4 and slow.completion.completion_tokens == 4


def test_batch_decode_rows_runs_each_flight_on_the_one_row_step_with_the_same_bits(tiny_loaded):
    engine = recording(make_engine(tiny_loaded, CHUNK, max_batch=4, batch_decode="rows"))
    assert engine.runtime_choices["batch"]["value"] == "4 in flight, one row each"
    assert "batch_decode = rows" in engine.runtime_choices["batch"]["reason"]
    requests = [request(engine, conversation(t, 1)[:-1], f"{t}-1", max_tokens=6) for t in "ce"]
    probe = engine.admit(request(engine, conversation("p", 1)[:-1], "p-1", max_tokens=2), lambda _: None, lambda: False)
    assert probe.feed is not None and not isinstance(probe.feed, BatchStep)
    while probe.completion is None:
        engine.step()
    together = run_together(engine, requests)
    for req in requests:
        alone_engine = recording(make_engine(tiny_loaded, CHUNK, max_batch=4, batch_decode="rows"))
        alone = run_together(alone_engine, [request(alone_engine, conversation(req.request_id[0], 1)[:-1],
                                                    req.request_id, max_tokens=6)])[req.request_id]
        assert together[req.request_id][1].generated_ids == alone[1].generated_ids
        assert torch.equal(together[req.request_id][2], alone[2])
    batched = make_engine(tiny_loaded, CHUNK, max_batch=4)
    assert batched.runtime_choices["batch"]["value"] == "batched, 4 rows"
    assert make_engine(tiny_loaded, CHUNK).runtime_choices["batch"]["value"] == "one at a time"


def _counting_graph(engine, rows=4):
    """The engine's batched step of `rows` rows, its graphs (and its smaller twins') wrapped to
    count the steps they run: [(rows of the step, requests in it)]."""
    feed = engine.decoder.batch_step(rows)
    calls = []
    for step in (feed, *feed.smaller):
        def counted(graph, buffers, *args, run=step._run, rows=step.rows):
            calls.append((rows, len(buffers)))
            return run(graph, buffers, *args)
        step._run = counted
    return feed, calls


def test_a_lone_request_runs_the_one_row_step_where_a_row_has_the_batched_steps_bits(q4_dir):
    # bf16 on the int4 kernel: a matmul's row is the same bits at any M, so the one-row step
    # computes what the batched step computes for a row (checked by the decoder on a scratch request)
    loaded = load_model(str(q4_dir), device="cpu", dtype="bfloat16", weights="int4")
    engine = recording(make_engine(loaded, CHUNK, max_batch=4))
    feed, calls = _counting_graph(engine)
    assert feed.alone is not None and [twin.rows for twin in feed.smaller] == [2]
    topics = (("c", 6), ("e", 3), ("f", 5))
    requests = [request(engine, conversation(t, 1)[:-1], f"{t}-1", max_tokens=m) for t, m in topics]
    alone = {r.request_id: run_together(engine, [r])[r.request_id] for r in requests}
    assert calls == []  # alone: no padded step ran
    for count in (2, 3):
        engine = recording(make_engine(loaded, CHUNK, max_batch=4))
        feed, calls = _counting_graph(engine)
        together = run_together(engine, [request(engine, conversation(t, 1)[:-1], f"{t}-1", max_tokens=m)
                                         for t, m in topics[:count]])
        # the fewest rows that hold the requests decoding together; the last one left alone
        assert calls and all(rows == (2 if n == 2 else 4) for rows, n in calls), calls
        assert {n for _, n in calls} == set(range(2, count + 1)), calls
        for rid, (completion, state, scores) in together.items():
            assert summary(completion, state, scores) == summary(*alone[rid])
            assert torch.equal(scores, alone[rid][2])


def test_a_lone_request_runs_padded_where_the_one_row_steps_bits_differ(tiny_loaded):
    # fp32 dense matmuls take another path at M = 1 than at M = 4: the check refuses the one-row step
    engine = recording(make_engine(tiny_loaded, CHUNK, max_batch=4))
    feed, calls = _counting_graph(engine)
    assert feed.alone is None and feed.smaller == []
    req = request(engine, conversation("c", 1)[:-1], "c-1", max_tokens=4)
    run_together(engine, [req])
    assert len(calls) >= 3 and set(calls) == {(4, 1)}  # every decode step after the first token: 4 rows


def test_a_request_admitted_while_the_eager_batched_step_is_checked_decodes_on_the_one_row_step(tiny_loaded):
    """A first start makes the eager batched step in the background (`warm_batch`, its checks
    take seconds on a busy machine): a request admitted meanwhile decodes its whole reply on
    the one-row eager step instead of waiting; once made, requests get the batched step."""
    engine = recording(make_engine(tiny_loaded, CHUNK, max_batch=4))
    decoder = engine.decoder
    with decoder._batch_lock:  # the check under way
        step, make = decoder.choose(4)
        assert step == "eager" and not isinstance(make(), BatchStep)
        flight = engine.admit(request(engine, conversation("w", 1)[:-1], "w-1", max_tokens=4), lambda _: None,
                              lambda: False)
        assert not isinstance(flight.feed, BatchStep) and flight.feed.step == "eager"
    while flight.completion is None:
        engine.step()
    assert flight.completion.decision.step == "eager"
    step, make = decoder.choose(4)
    assert step == "eager" and isinstance(make(), BatchStep)


# -- the batched step compiled (memrad.engine.decode.package, rows): the tiny int4 llama in bf16 --

needs_compiler = pytest.mark.skipif(cxx_compiler() is None, reason="building the package needs a C++ compiler")


@pytest.fixture(scope="module")
def compiled_engines(q4_dir, tmp_path_factory):
    """Engines (exact mode, compile wait, max_batch 4, batched) over one compile cache that the
    first of them filled: its first request waited for the one-row package and decoded on it,
    alone, so no batched package was built; a second request beside it asked for them, decoded
    on the one-row step meanwhile, and they were built (each package in a child process)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path_factory.mktemp("compile")))
        torch.set_num_threads(1)
        loaded = load_model(str(q4_dir), device="cpu", dtype="bfloat16", weights="int4")
        first = make_engine(loaded, CHUNK, compile="wait", max_batch=4)
        assert first.decoder.batch_choice.value == "eager" and not first.decoder.compiling()
        alone = first.admit(request(first, conversation("a", 1)[:-1], "a-1"), lambda _: None, lambda: False)
        first.decoder.wait()
        before = (first.decoder.batch_choice.value, first.decoder._package(True, 2).is_file(),
                  first.decoder._package(True, 4).is_file())
        beside = first.admit(request(first, conversation("c", 1)[:-1], "c-1"), lambda _: None, lambda: False)
        building = (first.decoder.batch_choice.value, first.decoder.batch_choice.reason)
        first.decoder.wait()
        # speculation's run of up to 8 rows (the daemon's default, speculate = auto): its admission
        # alone asks for the packages, and the 8-row one is built beside the 2- and 4-row ones
        speculating = make_engine(loaded, CHUNK, compile="wait", max_batch=4, speculate="auto")
        speculating.decoder.start()  # as the daemon does before its first request: the one-row package opens
        speculating.admit(request(speculating, conversation("d", 1)[:-1], "d-1"), lambda _: None, lambda: False)
        speculating.decoder.wait()
        assert speculating.decoder.batch_sizes == (2, 4, 8) and speculating.decoder.batch_choice.value == "compiled"
        yield loaded, first, (alone, beside, before, building), lambda **flags: started(recording(make_engine(
            loaded, CHUNK, compile="auto", max_batch=4, **flags)))


def started(engine):
    """As the daemon does once it serves: open the packages in the compile cache (compile = auto
    no longer opens them on a first request: no reply waits)."""
    engine.start_background()
    engine.decoder.wait()
    return engine


@needs_compiler
def test_the_batched_packages_are_built_when_a_second_request_first_decodes_beside_another(compiled_engines):
    _, first, (alone, beside, before, building), _ = compiled_engines
    decoder = first.decoder
    assert before == ("on demand", False, False)  # one request alone: nothing batched was built
    assert building == ("compiling", "a second request decodes beside another: building the 2 and 4-row packages; "
                                     "each request on the one-row step until they are open")
    # neither waited for the batched build: both decode on the compiled one-row step (not the eager batched one)
    assert not isinstance(alone.feed, BatchStep) and not isinstance(beside.feed, BatchStep)
    assert alone.feed.step == beside.feed.step == "compiled"
    later = first.admit(request(first, conversation("b", 1)[:-1], "b-1"), lambda _: None, lambda: False)
    assert isinstance(later.feed, BatchStep) and later.feed.compiled and later.feed.rows == 4
    assert later.feed.alone is not None  # the compiled one-row step: a row's bits (INDUCTOR_OPTIONS)
    assert [(twin.rows, twin.compiled) for twin in later.feed.smaller] == [(2, True)]
    assert decoder.choice.value == "compiled" and decoder.batch_choice.value == "compiled"
    assert "-rows4-" in decoder.batch_choice.reason and "-rows2-" in decoder.batch_choice.reason
    assert decoder._package(True, 4).is_file() and decoder._package(True, 2).is_file()
    assert first.runtime_choices["batch"]["value"] == "batched, 4 rows"
    assert "compiled: AOTInductor package" in first.runtime_choices["batch"]["reason"]
    # each build's time is kept for the next estimate (memrad.engine.decode.build_times)
    for rows in (None, 2, 4):
        seconds = build_times.last_build_s(decoder._package(True, rows))
        assert seconds is not None and seconds > 0
        assert build_times.estimate(decoder._package(True, rows)) == f"~{seconds:.0f} s (the last build here)"


@needs_compiler
def test_a_second_process_opens_the_batched_package_without_building(compiled_engines, q4_dir):
    script = ("import torch; from memrad.engine.model.loader import load_model; "
              "from memrad.engine.decode.decoder import Decoder; torch.set_num_threads(1); "
              f"m = load_model({str(q4_dir)!r}, device='cpu', dtype='bfloat16', weights='int4'); "
              "d = Decoder(m.model, m.context_len, m.device, 'wait', batch_rows=4); d.start(); "
              "s = d.batch_step(4); print(d._thread is None, d.batch_choice.value, s.compiled)")
    child = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                           env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert child.stdout.split() == ["True", "compiled", "True"], child.stderr[-2000:]


def parked_compiled(new_engine):
    engine = new_engine()
    for topic in ("a", "b"):
        engine.generate(request(engine, conversation(topic, 1)[:-1], f"{topic}-1"), lambda _: None, lambda: False)
    return engine


@needs_compiler
def test_the_compiled_batched_step_gives_a_request_the_same_bits_alone_and_batched(compiled_engines, monkeypatch):
    _, _, _, new_engine = compiled_engines
    monkeypatch.setattr(step_package, "build", lambda *a, **k: pytest.fail("the package was built again"))
    monkeypatch.setattr(builder, "build_in_child", lambda *a, **k: pytest.fail("the package was built again"))
    alone = {}
    for index in range(4):
        engine = parked_compiled(new_engine)
        req = second_turns(engine)[index]
        alone[req.request_id] = run_together(engine, [req])[req.request_id]
        assert engine.decoder.batch_package is not None
    for group in ((0, 2), (1, 3, 0), (3, 2, 1, 0)):
        engine = parked_compiled(new_engine)
        requests = [second_turns(engine)[i] for i in group]
        together = run_together(engine, requests)
        for req in requests:
            completion, state, scores = together[req.request_id]
            assert summary(completion, state, scores) == summary(*alone[req.request_id]), (group, req.request_id)
            assert torch.equal(state.prompt_logits, alone[req.request_id][1].prompt_logits)
            assert torch.equal(scores, alone[req.request_id][2]), (group, req.request_id)


@needs_compiler
def test_compiled_and_eager_batched_steps_agree_within_the_compiled_tolerance(compiled_engines):
    """Not bit for bit (inductor fuses and rounds once where eager rounds each op, as for the
    one-row step): the same logits within 0.01, a one-token prompt's row (length 2) included."""
    loaded, first, _, _ = compiled_engines
    compiled = first.decoder.batch_step(first.decoder.batch_rows)
    eager = BatchStep(compiled.eager, compiled.rows, True, compiled.scratch, compiled.eager, False)
    assert compiled.compiled and not eager.compiled
    prompts = [list(range(5, 45)), [9], list(range(9, 90))]

    def run(step):
        from memrad.engine.forward import prefill
        caches = []
        for ids in prompts:
            cache = first.new_cache()
            prefill(loaded.model, cache, ids, 0, CHUNK)
            caches.append(cache)
        return step(caches, [11, 12, 13], [len(ids) for ids in prompts])

    got, want = run(compiled), run(eager)
    assert torch.isfinite(got).all() and (got - want).abs().max() <= 0.01


@needs_compiler
def test_the_compiled_batched_step_gives_a_request_the_one_row_steps_bits(compiled_engines, monkeypatch):
    """Every matmul computes a row alike at any M (torch's int4 kernel, memra's block kernel) and
    both packages round to bf16 where eager does (package.INDUCTOR_OPTIONS), so a request decodes
    the same tokens and logits on the compiled batched step, beside others, as on the compiled
    one-row step (the default model's logits differed by up to 0.5 without the rounding)."""
    _, _, _, new_engine = compiled_engines
    monkeypatch.setattr(step_package, "build", lambda *a, **k: pytest.fail("the package was built again"))
    monkeypatch.setattr(builder, "build_in_child", lambda *a, **k: pytest.fail("the package was built again"))
    rows = parked_compiled(lambda: new_engine(batch_decode="rows"))
    assert rows.runtime_choices["batch"]["value"] == "4 in flight, one row each"
    assert rows.decoder.choice.value == "compiled"
    one_row = {req.request_id: run_together(rows, [req])[req.request_id] for req in second_turns(rows)}
    engine = parked_compiled(new_engine)
    together = run_together(engine, second_turns(engine))
    assert engine.decoder.batch_choice.value == "compiled"
    for rid, (completion, state, scores) in together.items():
        assert summary(completion, state, scores) == summary(*one_row[rid]), rid
        assert torch.equal(scores, one_row[rid][2]), rid


@needs_compiler
def test_the_llama_shaped_packages_are_compiled_to_round_where_eager_rounds(tiny_loaded, monkeypatch):
    import torch._inductor

    from memrad.engine.kernels import decode_attention
    from memrad.engine.decode.steps import new_step

    assert decode_attention.load(cxx_compiler()) is None  # the batched graph calls memra's attention op

    class Stop(Exception):
        pass

    asked = []

    def recording(module, *args, options=None):
        asked.append(options)
        raise Stop

    monkeypatch.setattr(torch._inductor, "aot_compile", recording)
    step = new_step(tiny_loaded.model, 64)
    heard = []
    for rows in (None, 4):
        with pytest.raises(Stop):
            step_package.build(step, tiny_loaded.model.config, 64, True, Path("unused"), rows=rows, phase=heard.append)
    assert [o.get("emulate_precision_casts") for o in asked] == [True, True]
    # No line tables (-g1: they doubled the wrapper's compile and change no code g++ emits).
    assert [o.get("aot_inductor.enable_line_tables") for o in asked] == [False, False]
    assert heard == ["exporting the graph", "compiling (inductor's codegen, then g++)"] * 2  # each as it starts


@needs_compiler
def test_speculation_runs_its_drafts_on_the_compiled_batched_step_with_its_bits(compiled_engines, monkeypatch):
    """A run of a request's pending token and its drafts as rows of the compiled batched step,
    on its own slab (memrad.engine.speculation: row j attends the rows written before it in the
    same step): the compiled graph writes every row's KV before the attention reading it, so the
    replies, alone and beside 3 others, are speculate = off's bits (every step's logits); on the
    compiled one-row step (batch_decode = rows) a reply decodes plain and says why."""
    _, _, _, new_engine = compiled_engines
    monkeypatch.setattr(step_package, "build", lambda *a, **k: pytest.fail("the package was built again"))
    monkeypatch.setattr(builder, "build_in_child", lambda *a, **k: pytest.fail("the package was built again"))

    def copying(engine):  # a reply that copies its prompt's tokens from the 4th on, one token changed at 9
        def sampler(scores, params, generator):
            seen = engine.scores.setdefault(id(params), [])
            seen.append(scores.clone())
            script = list(engine.prompts[id(params)][3:40])
            script[9] = 7
            return script[len(seen) - 1] if len(seen) <= len(script) else int(scores.argmax())
        engine.sampler, engine.prompts = sampler, {}
        return engine

    def requests(engine):
        made = [request(engine, conversation(topic, turns)[:-1], f"{topic}-{turns}", max_tokens=tokens)
                for topic, turns, tokens in (("a", 2, 30), ("b", 1, 13), ("c", 1, 7), ("d", 3, 21))]
        engine.prompts.update({id(r.sampling): r.prompt_ids for r in made})
        return made

    out = {}
    for arm in ("off", "auto"):
        engine = copying(new_engine(speculate=arm))
        lone = requests(engine)[0]
        out[arm] = {"alone": run_together(engine, [lone])[lone.request_id], **run_together(engine, requests(engine))}
        assert engine.decoder.batch_step(engine.decoder.batch_rows).compiled
    for rid, (completion, state, scores) in out["off"].items():
        spec = out["auto"][rid]
        assert summary(*spec) == summary(completion, state, scores), rid
        assert torch.equal(spec[2], scores), rid
    alone = out["auto"]["alone"][0]
    assert alone.decision.step == "compiled"
    assert alone.speculation.reason == ("on the compiled batched step of 8 rows, up to 7 drafted in the rows its "
                                        "neighbours leave")
    assert alone.speculation.accepted_tokens > alone.speculation.verify_steps > 0  # runs of several kept
    assert sum(out["auto"][rid][0].speculation.accepted_tokens for rid in ("a-2", "b-1", "c-1", "d-3")) > 0
    rows = new_engine(speculate="auto", batch_decode="rows")
    flight = rows.admit(request(rows, conversation("a", 1)[:-1], "r"), lambda _: None, lambda: False)
    assert flight.feed.step == "compiled" and flight.speculating is None
    assert flight.speculation().reason.startswith("the compiled one-row step: its multi-row twin is the compiled")
