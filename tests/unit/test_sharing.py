"""Reuse beyond nomination on tiny models: the longest-prefix tier, forks, boundary
checkpoints. Exact mode throughout: every resumed turn is compared with a cold run."""

import torch

import stories
from stories import ask

CHUNK = 16
SYSTEM = "You are a helpful coding assistant. Read the file, then answer. " * 4


def make_engine(loaded, kind="llama", max_bytes=10**9, max_sessions=64, affinity=True):
    return stories.make_engine(loaded[kind], CHUNK, max_sessions=max_sessions, max_bytes=max_bytes, mode="exact",
                               affinity=affinity)


def cold(engine, messages, rid, max_tokens=6):
    """The same request alone in its own namespace: nothing to reuse."""
    return ask(engine, messages, rid, salt=f"cold-{rid}", max_tokens=max_tokens)


def chat(system, *turns):
    out = [{"role": "system", "content": system}]
    for user, reply in turns:
        out.append({"role": "user", "content": user})
        if reply is not None:
            out.append({"role": "assistant", "content": reply})
    return out


def test_a_new_conversation_forks_a_shared_system_prompt_and_the_source_resumes_unchanged(loaded):
    engine, alone = make_engine(loaded), make_engine(loaded)
    first = chat(SYSTEM, ("conversation A: list files", None))
    a1, _ = ask(engine, first, "a1")
    ask(alone, first, "a1")
    source = engine.parking.pool.sessions()[0]
    source_bytes = source.num_bytes

    b = chat(SYSTEM, ("conversation B: run the tests", None))
    b1, b_state = ask(engine, b, "b1")
    b_cold, b_cold_state = cold(engine, b, "b1")
    d = b1.decision
    assert d.outcome == "resumed" and d.tier == "prefix" and d.candidate == source.session_id
    assert d.render().startswith(f"prefix: resumed (longest prefix with {source.session_id}, ")
    assert d.render().endswith(f" of {b1.prompt_tokens:,}; forked)")
    system_tokens = len(engine.chat.render(chat(SYSTEM), None)[1])
    assert system_tokens <= b1.cached_tokens == d.checkpoint
    assert torch.equal(b_state.prompt_logits, b_cold_state.prompt_logits) and b1.text == b_cold.text
    # the source is still parked, untouched, and counted once; the fork owns its own rows
    parked = {s.session_id: s for s in engine.parking.pool.sessions()}
    assert parked[source.session_id].num_bytes == source_bytes
    assert b_state.session.session_id in parked
    assert engine.parking.pool.bytes_parked == sum(s.num_bytes for s in parked.values())
    assert b_state.session.state.final.layers[0].slab is not source.state.final.layers[0].slab

    # conversation A continues: resumed from its own session, output as if B never ran
    second = first + [{"role": "assistant", "content": a1.text}, {"role": "user", "content": "now open README.md"}]
    a2, a2_state = ask(engine, second, "a2")
    a2_alone, a2_alone_state = ask(alone, second, "a2")
    assert a2.decision.tier in ("token-prefix", "text-prefix") and a2.decision.candidate == source.session_id
    assert a2.cached_tokens == a2_alone.cached_tokens == a1.prompt_tokens
    assert torch.equal(a2_state.prompt_logits, a2_alone_state.prompt_logits) and a2.text == a2_alone.text


def test_the_longest_prefix_wins_over_a_shorter_one(loaded):
    engine = make_engine(loaded)
    ask(engine, chat(SYSTEM, ("short question", None)), "x")
    long_user = "a much longer shared opening question about the repository layout " * 3
    ask(engine, chat(SYSTEM, (long_user + "first", None)), "y")
    longest = engine.parking.pool.sessions()[-1]
    done, state = ask(engine, chat(SYSTEM, (long_user + "second", None)), "z")
    assert done.decision.candidate == longest.session_id and done.decision.tier == "prefix"
    reference, ref_state = cold(engine, chat(SYSTEM, (long_user + "second", None)), "z")
    assert torch.equal(state.prompt_logits, ref_state.prompt_logits)


def strip(reply: str) -> str:
    return reply[: len(reply) // 2]


def test_a_hybrid_model_rewritten_at_turn_3_of_8_resumes_from_the_boundary_before_it(loaded):
    """Recurrent state cannot be cut back: only a boundary snapshot taken at turn 3's reply
    anchor lets a client that rewrites turn 3's reply resume there instead of at zero."""
    engine = make_engine(loaded, "qwen3_next")
    messages = [{"role": "system", "content": SYSTEM}]
    anchors = []
    for turn in range(1, 9):
        messages.append({"role": "user", "content": f"step {turn}: list files"})
        done, state = ask(engine, messages, f"t{turn}", max_tokens=4)
        anchors.append(done.prompt_tokens)  # the reply anchor: where reply `turn` begins
        messages.append({"role": "assistant", "content": done.text})
        assert done.decision.outcome == "resumed" or turn <= 2, done.decision.render()
    parked = state.session
    assert len(engine.parking.pool.sessions()) <= 2
    assert anchors[2] in parked.checkpoints, "the boundary before turn 3's reply is kept"
    assert len(parked.checkpoints) < len(anchors) + 2  # bounded: thinned, not one per turn forever
    # the client compacts turn 3's reply and asks turn 9
    messages[6] = {"role": "assistant", "content": "(compacted)"}
    messages.append({"role": "user", "content": "step 9: list files"})
    done, state = ask(engine, messages, "t9", max_tokens=4)
    reference, ref_state = cold(engine, messages, "t9", max_tokens=4)
    d = done.decision
    assert d.checkpoint == anchors[2], d.render()
    # the compacted history no longer holds the parked prompt: a fork, and the uncompacted
    # session stays parked (a sibling may still send it)
    assert f"of checkpoint {anchors[7]}; resumed from {anchors[2]}; primed {done.prompt_tokens - anchors[2]}; " \
           "forked)" in d.render()
    assert parked.session_id in {s.session_id for s in engine.parking.pool.sessions()}
    assert torch.equal(state.prompt_logits, ref_state.prompt_logits) and done.text == reference.text


def test_caps_hold_under_a_64_conversation_churn(loaded):
    engine = make_engine(loaded, max_bytes=3 * 10**6, max_sessions=8)
    for i in range(64):
        ask(engine, chat(SYSTEM, (f"conversation {i}: list files", None)), f"c{i}", max_tokens=2)
        assert engine.parking.pool.bytes_parked <= 3 * 10**6 and len(engine.parking.pool.sessions()) <= 8
    assert engine.finished[-1].completion.decision.tier == "prefix"
