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


# --- a name is a set of conversations (issue 22) ------------------------------------------

MAIN_SYSTEM = "You are the main coding agent. Plan, call tools, and edit files carefully. " * 3
SUB_SYSTEM = "You are a sub-agent. Search the code base and report findings briefly. " * 3
SIDE_SYSTEM = "Answer with one word: is this message a new topic? " * 2
TITLE_SYSTEM = "Generate a short title for the conversation below. " * 2
COMPACT_SYSTEM = "Summarize the conversation so far for a new agent to continue from. " * 2


def parked_as(engine):
    """The session the request just finished parked as."""
    return engine.finished[-1].session.session_id


def test_opencode_title_main_and_compaction_under_one_name_each_resume_their_own(loaded):
    """opencode sends its title, main-agent and compaction requests with one x-session-id:
    each kind resumes its own earlier request, and none is declined for a sibling's sake."""
    engine = make_engine(loaded, longest_prefix=True)
    name = Identity("ses_7f3a", "x-session-id")
    main = Client(engine, MAIN_SYSTEM, identity=name)
    title = Client(engine, TITLE_SYSTEM, identity=name)
    decisions = [title.say(f"title for: {QUESTIONS[0]}").decision]
    previous_main = previous_compaction = None
    for turn, question in enumerate(QUESTIONS[:5], start=1):
        done = main.say(question)
        decisions.append(done.decision)
        if previous_main is not None:
            session, prompt_tokens = previous_main
            assert (done.decision.candidate, done.cached_tokens) == (session, prompt_tokens), done.decision.render()
            assert done.decision.render().endswith(f"checkpoint {prompt_tokens}; primed "
                                                   f"{done.prompt_tokens - prompt_tokens})")
        previous_main = parked_as(engine), done.prompt_tokens
        if turn >= 2:  # compaction: the main history under its own system prompt, then "summarize"
            compaction = Client(engine, COMPACT_SYSTEM, identity=name)
            compaction.messages += main.messages[1:]
            summary = compaction.say("Provide a detailed summary of the conversation above.")
            decisions.append(summary.decision)
            if previous_compaction is not None:
                session, shared = previous_compaction
                assert summary.decision.candidate == session, summary.decision.render()
                assert summary.decision.outcome == "resumed" and summary.cached_tokens >= shared - CHUNK
            # the next compaction shares this one's prompt up to its "summarize" message
            previous_compaction = parked_as(engine), len(engine.chat.render(compaction.messages[:-2], None)[1])
    assert [d.outcome for d in decisions].count("declined") == 0, [d.render() for d in decisions]
    assert decisions[0].render() == "cold (nothing parked for this model and cache_salt)"
    names = {s.session_id for s in engine.parking.pool.sessions() if s.identity == name}
    assert previous_main[0] in names and previous_compaction[0] in names and len(names) == 6


def test_claude_code_main_agent_three_sub_agents_and_side_queries_under_one_session(loaded):
    """Claude Code sends its main agent, its sub-agents and its side queries with one
    metadata.user_id: every main-agent turn resumes the main agent, every sub-agent turn its
    own sub-agent, and no decline is caused by a sibling."""
    engine = make_engine(loaded, longest_prefix=True)
    name = Identity("user_0c1f_account__session_9d2e", "metadata.user_id")
    main = Client(engine, MAIN_SYSTEM, identity=name)
    subs = [Client(engine, SUB_SYSTEM, identity=name) for _ in range(3)]
    last: dict[int, tuple[str, int]] = {}  # client -> (its parked session, its prompt tokens)
    decisions = []
    for turn in range(1, 4):
        for client, text in [(main, f"main step {turn}: edit app.py"),
                             *((sub, f"sub-agent {k} step {turn}: grep for TODO in part {k}")
                               for k, sub in enumerate(subs))]:
            done = client.say(text)
            decisions.append(done.decision)
            if id(client) in last:
                session, prompt_tokens = last[id(client)]
                assert (done.decision.outcome, done.decision.candidate, done.cached_tokens) == (
                    "resumed", session, prompt_tokens), done.decision.render()
                assert "forked" not in done.decision.render()  # it replaced its own session
            last[id(client)] = parked_as(engine), done.prompt_tokens
        side = Client(engine, SIDE_SYSTEM, identity=name).say(f"is 'step {turn}' a new topic?")
        decisions.append(side.decision)
    assert [d.outcome for d in decisions].count("declined") == 0, [d.render() for d in decisions]
    parked = {s.session_id for s in engine.parking.pool.sessions()}
    assert {session for session, _ in last.values()} <= parked  # no sibling was replaced or evicted
    # sub-agents 2 and 3 forked sub-agent 1's system prompt on their first turn
    first_sub2 = decisions[2]
    assert first_sub2.outcome == "resumed" and "forked" in first_sub2.render(), first_sub2.render()


def test_an_agent_and_its_sub_agent_interleaved_affinity_on_never_reuses_less_than_off(loaded):
    """The most reuse wins: with affinity on (every tier) no turn reuses fewer tokens than
    with affinity off (the prefix tiers alone), named or not, and the texts are the same."""
    for identity in (None, Identity("agent-7", "session_id")):
        arms = {flag: make_engine(loaded, affinity=flag, longest_prefix=True) for flag in (True, False)}
        clients = {flag: (Client(engine, MAIN_SYSTEM, identity=identity),
                          Client(engine, MAIN_SYSTEM, identity=identity)) for flag, engine in arms.items()}
        reused = {True: [], False: []}
        for turn in range(1, 5):
            for who, text in ((0, f"agent step {turn}: list files"), (1, f"sub-agent step {turn}: run the tests")):
                done = {flag: clients[flag][who].say(text) for flag in arms}
                assert done[True].text == done[False].text
                for flag in arms:
                    reused[flag].append(done[flag].cached_tokens)
                if turn >= 2:  # each resumes its own previous turn, whole prompt, in both arms
                    previous = clients[True][who].messages[:-3]  # the previous prompt
                    own = len(arms[True].chat.render(previous, None)[1])
                    assert done[True].cached_tokens == done[False].cached_tokens == own, done[True].decision.render()
        assert all(on >= off for on, off in zip(reused[True], reused[False])), reused
        # the sub-agent's first turn forks the agent's shared system prompt, in both arms
        assert reused[True][1] == reused[False][1] > 0
