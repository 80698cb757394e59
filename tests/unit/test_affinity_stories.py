"""Session affinity on a tiny model: clients that rewrite their history, told as stories."""

import stories
from memrad.request import Identity
from stories import Client

CHUNK = 16


def make_engine(loaded, kind="llama", mode="exact", affinity=True, longest_prefix=False):
    """Affinity's own stories: the longest-prefix tier is off unless a test turns it on."""
    return stories.make_engine(loaded[kind], CHUNK, mode=mode, affinity=affinity, longest_prefix=longest_prefix)


SYSTEM = "You are a helpful coding assistant. Read the file, then answer. " * 3
QUESTIONS = [f"question {i}: list files, open README.md" for i in range(6)]


def test_a_rewriting_client_resumes_via_affinity_from_turn_three_and_cold_without_it(loaded):
    """Three arms: both tiers, affinity only, neither (the seed's baseline)."""
    both = Client(make_engine(loaded, longest_prefix=True), SYSTEM)
    on = Client(make_engine(loaded), SYSTEM)
    off = Client(make_engine(loaded, affinity=False), SYSTEM)
    previous, off_grid = None, 0
    for turn, question in enumerate(QUESTIONS, start=1):
        a, b, c = on.say(question), off.say(question), both.say(question)
        assert b.cached_tokens == 0 and b.decision.outcome == "cold"
        assert a.text == b.text == c.text  # exact mode: resumed output equals the cold arm's
        if turn == 1:
            assert a.decision.render() == "cold (nothing parked for this model and cache_salt)"
        elif turn == 2:  # system + first user message: 2 shared segments, under the bar
            assert a.decision.render() == "cold (no nomination: 2 shared segments < 3)"
            # ... but the longest common prefix covers the whole first prompt: it continues
            # that conversation, so it replaces its session
            assert c.decision.render() == (f"prefix: resumed (longest prefix with s1, {previous.prompt_tokens} "
                                           f"of {c.prompt_tokens}; replaces it)")
            assert c.cached_tokens == previous.prompt_tokens
        else:
            # Exact mode resumes where the previous prompt ended, right after its reply
            # header: prefill was cut there too (memrad.grid), and the client kept it all.
            resume = previous.prompt_tokens
            off_grid += resume % CHUNK != 0
            assert a.decision.render() == (f"affinity: resumed (implicit, {2 * turn - 2} shared segments; "
                                           f"checkpoint {resume}; primed {a.prompt_tokens - resume})")
            assert a.cached_tokens == resume
            assert c.decision.tier == "affinity" and c.cached_tokens == resume
        previous = a
    assert off_grid >= 1  # resumed at a reply anchor, not at the grid point below it
    assert len(on.engine.parking.pool.sessions()) == 2  # turn 1 and the conversation that resumed since turn 3
    assert len(both.engine.parking.pool.sessions()) == 1  # one conversation, replaced every turn


def test_a_named_client_resumes_from_turn_two(loaded):
    client = Client(make_engine(loaded), SYSTEM, identity=Identity("agent-1", "session_id"))
    first = client.say(QUESTIONS[0])
    second = client.say(QUESTIONS[1])
    resume = first.prompt_tokens
    assert second.decision.render() == (f'affinity: resumed (explicit, session_id "agent-1", 2 shared segments; '
                                        f"checkpoint {resume}; primed {second.prompt_tokens - resume})")
    assert (second.decision.nomination, second.decision.source) == ("explicit", "session_id")


def test_the_prompt_checkpoint_sits_before_the_init_feed(loaded):
    """Fast mode on a recurrent model resumes exactly at the previous prompt's end.

    Were the checkpoint captured one token later (after the first generated token is fed
    back), a client that drops the reply would diverge at P of checkpoint P + 1 and every
    turn would be declined.
    """
    engine = make_engine(loaded, "qwen3_next", mode="fast")
    client = Client(engine, SYSTEM, rewrite=lambda reply: "", identity=Identity("a", "user"))
    first = client.say(QUESTIONS[0])
    parked = engine.finished[-1].session
    assert parked.prompt_checkpoint == first.prompt_tokens
    assert first.prompt_tokens in parked.checkpoints
    second = client.say(QUESTIONS[1])
    assert second.decision.outcome == "resumed", second.decision.render()
    assert second.decision.checkpoint == first.prompt_tokens
    assert second.decision.divergence == first.prompt_tokens


def test_two_fresh_conversations_sharing_only_the_system_prompt_stay_apart(loaded):
    engine = make_engine(loaded)
    one, two = Client(engine, SYSTEM), Client(engine, SYSTEM)
    one.say("first conversation: list files")
    one.say("first conversation: open README.md")
    fresh = two.say("second conversation: run the tests")
    assert fresh.decision.render() == "cold (no nomination: 1 shared segments < 3)"
    assert fresh.cached_tokens == 0


def test_named_and_unnamed_never_cross(loaded):
    engine = make_engine(loaded)
    unnamed = Client(engine, SYSTEM)
    for q in QUESTIONS[:3]:
        unnamed.say(q)
    claimer = Client(engine, SYSTEM, identity=Identity("x", "user"))
    claimer.messages = list(unnamed.messages)  # the same history, but now with a name
    done = claimer.say(QUESTIONS[3])
    assert done.decision.render() == 'affinity: declined (named "x" vs unnamed parked session)'
    assert done.cached_tokens == 0


def test_an_agent_and_its_sub_agent_interleaved_both_keep_resuming(loaded):
    engine = make_engine(loaded)
    agent = Client(engine, SYSTEM)
    sub = Client(engine, "You are a sub-agent. Run one tool and report back briefly. " * 3)
    for turn in range(1, 5):
        a = agent.say(f"agent step {turn}: list files")
        s = sub.say(f"sub-agent step {turn}: run the tests")
        if turn >= 3:
            assert a.decision.outcome == s.decision.outcome == "resumed", (a.decision, s.decision)
            assert a.decision.candidate != s.decision.candidate
    assert len(engine.parking.pool.sessions()) == 4


def test_different_salts_never_share_even_when_named(loaded):
    engine = make_engine(loaded)
    a = Client(engine, SYSTEM, identity=Identity("same", "session_id"), salt="tenant-a")
    a.say(QUESTIONS[0])
    b = Client(engine, SYSTEM, identity=Identity("same", "session_id"), salt="tenant-b")
    b.messages = list(a.messages)
    done = b.say(QUESTIONS[1])
    assert done.decision.render() == "cold (nothing parked for this model and cache_salt)"
