"""Parking and resuming on tiny dense and hybrid models: exact means bit-identical."""

import pytest
import torch

from memrad.engine.state.kv import SlabLayer
from memrad.engine.model.loader import load_model
from memrad.engine.model.pull import ModelUnavailable
from memrad.engine.events import Publisher
from memrad.request import GenerationRequest, SamplingParams
from memrad.reuse.pool import ReusePool
from stories import ask, make_engine

CHUNK = 16
SYSTEM = {"role": "system", "content": "You are a helpful coding assistant. Read the file, then answer."}
KINDS = ["llama", "qwen3_next", "falcon_h1", "gemma3"]


def engine_for(loaded, kind, mode="exact", pool=True, max_bytes=10**9, max_sessions=16, **flags):
    return make_engine(loaded[kind], CHUNK, pool=pool, max_bytes=max_bytes, max_sessions=max_sessions, mode=mode,
                       **flags)


def conversation(engine, turns, cold_reference=True):
    """A client that sends every reply back verbatim; each turn is also run cold (fresh salt)."""
    messages = [SYSTEM]
    rows = []
    for turn in range(turns):
        messages.append({"role": "user", "content": f"turn {turn}: list files, then open README.md"})
        warm, warm_state = ask(engine, messages, f"t{turn}")
        row = {"warm": warm, "warm_state": warm_state}
        if cold_reference:
            row["cold"], row["cold_state"] = ask(engine, messages, f"c{turn}", salt=f"cold-{turn}")
        rows.append(row)
        messages.append({"role": "assistant", "content": warm.text})
    return rows


@pytest.mark.parametrize("kind", KINDS)
def test_exact_mode_resumes_every_turn_bit_identically_to_a_cold_run(loaded, kind):
    engine = engine_for(loaded, kind, "exact")
    rows = conversation(engine, 4)
    assert rows[0]["warm"].decision.outcome == "cold"
    for previous, row in zip(rows, rows[1:]):
        warm, state = row["warm"], row["warm_state"]
        assert warm.decision.outcome == "resumed", warm.decision.render()
        # the previous prompt's end: prefill was cut right after its reply header too
        assert warm.cached_tokens == previous["warm"].prompt_tokens
        assert warm.decision.primed_tokens == warm.prompt_tokens - warm.cached_tokens
        assert row["cold"].cached_tokens == 0 and row["cold"].decision.outcome == "cold"
        assert torch.equal(state.prompt_logits, row["cold_state"].prompt_logits)
        assert warm.text == row["cold"].text


@pytest.mark.parametrize("kind", KINDS)
def test_fast_mode_reuses_past_the_prompt_and_stays_close(loaded, kind):
    engine = engine_for(loaded, kind, "fast")
    rows = conversation(engine, 3)
    for previous, row in zip(rows, rows[1:]):
        warm = row["warm"]
        assert warm.decision.outcome == "resumed", warm.decision.render()
        assert warm.cached_tokens >= previous["warm"].prompt_tokens
        diff = (row["warm_state"].prompt_logits - row["cold_state"].prompt_logits).abs().max().item()
        assert diff < 1e-3


def test_a_resumed_conversation_keeps_one_parked_session(loaded):
    engine = engine_for(loaded, "llama")
    rows = conversation(engine, 4, cold_reference=False)
    (session,) = engine.parking.pool.sessions()
    last = rows[-1]["warm_state"]
    assert session is last.session and session.hits == 3
    assert session.prompt_checkpoint == rows[-1]["warm"].prompt_tokens
    assert session.token_ids == last.cache_token_ids


@pytest.mark.parametrize("kind", KINDS)
def test_the_parked_prompt_checkpoint_is_the_prompt_length_before_the_init_feed(loaded, kind):
    engine = engine_for(loaded, kind)
    done, state = ask(engine, [SYSTEM, {"role": "user", "content": "hi"}], "r", max_tokens=5)
    session = state.session
    assert session.prompt_checkpoint == done.prompt_tokens
    # max_tokens=5: four generated tokens were fed back, the fifth never was.
    assert session.num_tokens == done.prompt_tokens + 4
    assert session.token_ids[: done.prompt_tokens] == state.request.prompt_ids
    if kind != "llama":  # recurrent state: a snapshot at the exact checkpoint, the prompt's last cut
        assert done.prompt_tokens in session.checkpoints  # prefill was cut after the reply header


def test_parked_bytes_equal_the_tensors_held(loaded):
    engine = engine_for(loaded, "llama")
    _, state = ask(engine, [SYSTEM, {"role": "user", "content": "hi"}], "r")
    expected = sum(t.numel() * t.element_size() for layer in state.cache.layers for t in (layer.keys, layer.values))
    assert state.session.num_bytes == expected
    # bf16 rows under fp32 activations (model.kv_dtype), 2 layers, 2 kv heads x 16 dims, keys and values
    assert expected == state.session.num_tokens * 2 * 2 * 2 * 16 * 2


def test_parked_bytes_count_recurrent_snapshots(loaded):
    engine = engine_for(loaded, "qwen3_next")
    _, state = ask(engine, [SYSTEM, {"role": "user", "content": "hi"}], "r")
    parked = state.session.state
    linear, attention = {}, {}
    for snap in [parked.final, *parked.snapshots.values()]:
        for layer in snap.layers:
            for t in [*getattr(layer, "conv_states", {}).values(), *getattr(layer, "recurrent_states", {}).values()]:
                if t is not None:
                    linear[t.untyped_storage().data_ptr()] = t.numel() * t.element_size()
            if isinstance(layer, SlabLayer) and layer.slab is not None:
                # In-place attention buffers: the snapshot shares the final state's rows, and
                # only the rows written count (the reservation behind them holds no memory).
                row = sum(t.shape[1] * t.shape[3] * t.element_size() for t in (layer.keys, layer.values))
                attention[id(layer.slab)] = state.session.num_tokens * row
    assert attention and linear
    assert state.session.num_bytes == sum(linear.values()) + sum(attention.values())
    assert len(parked.snapshots) == 1


def test_the_pool_never_exceeds_a_tiny_byte_cap(loaded):
    probe = engine_for(loaded, "llama")
    _, state = ask(probe, [SYSTEM, {"role": "user", "content": "hi"}], "r")
    cap = int(state.session.num_bytes * 1.5)  # room for one short session, never two
    engine = engine_for(loaded, "llama", max_bytes=cap)
    for i in range(5):
        ask(engine, [SYSTEM, {"role": "user", "content": f"question {i}"}], f"r{i}")
        assert engine.parking.pool.bytes_parked <= cap
        assert len(engine.parking.pool.sessions()) == 1
    rows = conversation(engine, 3, cold_reference=False)  # grows past the cap: not parked
    assert rows[-1]["warm_state"].session is None
    assert engine.parking.pool.bytes_parked <= cap


def test_different_salts_never_share_state(loaded):
    engine = engine_for(loaded, "llama")
    messages = [SYSTEM, {"role": "user", "content": "hi"}]
    first, _ = ask(engine, messages, "a", salt="tenant-a")
    messages += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "more"}]
    other, _ = ask(engine, messages, "b", salt="tenant-b")
    assert other.decision.render() == "cold (nothing parked for this model and cache_salt)"
    same, _ = ask(engine, messages, "c", salt="tenant-a")
    assert same.decision.outcome == "resumed" and same.cached_tokens > 0


def test_different_models_never_share_state(loaded):
    pool = ReusePool(8, 10**9)
    llama = make_engine(loaded["llama"], CHUNK, pool=pool)
    hybrid = make_engine(loaded["qwen3_next"], CHUNK, pool=pool)
    assert llama.model_id != hybrid.model_id
    messages = [SYSTEM, {"role": "user", "content": "hi"}]
    first, _ = ask(llama, messages, "a")
    messages += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "more"}]
    other, _ = ask(hybrid, messages, "b")
    assert other.decision.render() == "cold (nothing parked for this model and cache_salt)"


def test_with_the_pool_off_nothing_is_parked_and_every_turn_runs_cold(loaded):
    engine = engine_for(loaded, "llama", pool=False)
    rows = conversation(engine, 4, cold_reference=False)
    for row in rows:
        assert row["warm"].decision.render() == "cold (reuse pool disabled)"
        assert row["warm"].cached_tokens == 0 and row["warm_state"].session is None
    cancelled = engine.generate(ask_request(engine), lambda _: None, lambda: True)
    assert cancelled.finish_reason == "cancelled"


def ask_request(engine):
    text, ids = engine.chat.render([SYSTEM, {"role": "user", "content": "x"}], None)
    return GenerationRequest("x", engine.model_id, tuple(ids), text, SamplingParams(temperature=0.0, max_tokens=50))


def test_a_cancelled_request_is_parked_and_replaces_its_parent(loaded):
    engine = engine_for(loaded, "llama")
    messages = [SYSTEM, {"role": "user", "content": "hi"}]
    first, _ = ask(engine, messages, "a")
    messages += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "more"}]
    text, ids = engine.chat.render(messages, None)
    polls = []
    request = GenerationRequest("b", engine.model_id, tuple(ids), text,
                                SamplingParams(temperature=0.0, max_tokens=50))
    done = engine.generate(request, lambda _: None, lambda: polls.append(1) or len(polls) > 6)
    assert done.finish_reason == "cancelled" and done.decision.outcome == "resumed"
    (session,) = engine.parking.pool.sessions()
    assert session.prompt_checkpoint == len(ids) and session.hits == 1


def test_mamba_1_models_are_refused_at_load(tiny_dir):
    with pytest.raises(ModelUnavailable, match="is a mamba model: in transformers 5.x its multi-token forward"):
        load_model(str(tiny_dir("mamba")), device="cpu", dtype="float32")


def test_a_resume_checks_its_parent_out_and_a_failed_resume_drops_it(loaded):
    events = []
    engine = engine_for(loaded, "llama", events=Publisher(events.append))
    messages = [SYSTEM, {"role": "user", "content": "hi"}]
    first, first_state = ask(engine, messages, "a")
    parent = first_state.session
    messages += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "more"}]
    text, ids = engine.chat.render(messages, None)
    request = GenerationRequest("b", engine.model_id, tuple(ids), text, SamplingParams(temperature=0.0, max_tokens=4))
    listed_while_running = []
    pool = engine.parking.pool
    engine.generate(request, lambda _: listed_while_running.append([s.session_id for s in pool.sessions()]),
                    lambda: False)
    # The resumed request appends into the parent's buffers: the pool never lists the parent
    # while that happens, and the request's own state replaces it afterwards.
    assert listed_while_running and all(ids_now == [] for ids_now in listed_while_running)
    (child,) = engine.parking.pool.sessions()
    assert child.session_id != parent.session_id and child.hits == 1

    def boom(_):
        raise RuntimeError("client callback failed")

    messages += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "again"}]
    text, ids = engine.chat.render(messages, None)
    request = GenerationRequest("c", engine.model_id, tuple(ids), text, SamplingParams(temperature=0.0, max_tokens=4))
    with pytest.raises(RuntimeError, match="client callback failed"):
        engine.generate(request, boom, lambda: False)
    assert engine.parking.pool.sessions() == []
    dropped = [e for e in events if type(e).__name__ == "EvictEvent"]
    assert [e.session_id for e in dropped] == [child.session_id]
