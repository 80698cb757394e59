import pytest

from memrad.reuse.pool import Namespace, ParkedSession, PoolFull, ReusePool

NS = Namespace("m", None)


def parked(sid, num_bytes=10, tokens=(1, 2, 3), prompt=3):
    return ParkedSession(session_id=sid, namespace=NS, identity=None, token_ids=tuple(tokens), text="",
                         prompt_checkpoint=prompt, checkpoints=(), croppable=True, exact_limit=0, fingerprint=(),
                         num_bytes=num_bytes, created_at=0.0, last_used_at=0.0)


def ids(pool):
    return [s.session_id for s in pool.sessions()]


def test_least_recently_used_is_evicted_first_by_count():
    pool = ReusePool(max_sessions=2, max_bytes=1000)
    assert pool.park(parked("a")) == []
    pool.park(parked("b"))
    evicted = pool.park(parked("c"))
    assert [s.session_id for s in evicted] == ["a"]
    assert ids(pool) == ["b", "c"]


def test_the_byte_cap_is_never_exceeded():
    pool = ReusePool(max_sessions=10, max_bytes=100)
    for i in range(20):
        pool.park(parked(f"s{i}", num_bytes=30 + i % 3))
        assert pool.bytes_parked <= 100
    assert len(pool.sessions()) == 3


def test_a_resumed_session_replaces_the_one_it_came_from():
    pool = ReusePool(max_sessions=2, max_bytes=1000)
    pool.park(parked("a"))
    pool.park(parked("b"))
    assert pool.park(parked("a2"), replaces="a") == []  # replacing frees a slot: nothing evicted
    assert ids(pool) == ["b", "a2"]


def test_check_then_act_a_session_larger_than_the_cap_is_refused_whole():
    pool = ReusePool(max_sessions=4, max_bytes=50)
    pool.park(parked("a", num_bytes=40))
    assert not pool.can_park(60)
    with pytest.raises(PoolFull):
        pool.park(parked("big", num_bytes=60))
    assert ids(pool) == ["a"]


def test_a_prompt_checkpoint_past_the_tokens_is_an_invariant_violation():
    pool = ReusePool(max_sessions=4, max_bytes=50)
    with pytest.raises(AssertionError, match="prompt checkpoint past the committed tokens"):
        pool.park(parked("bad", tokens=(1, 2), prompt=3))


def test_zero_sessions_parks_nothing():
    assert not ReusePool(max_sessions=0, max_bytes=50).can_park(1)


def test_a_name_holds_at_most_sessions_per_name_least_recently_used_first():
    from dataclasses import replace

    from memrad.request import Identity

    pool = ReusePool(max_sessions=10, max_bytes=1000, sessions_per_name=2)
    main, sub = Identity("claude-1", "metadata.user_id"), Identity("claude-1", "metadata.user_id")
    pool.park(replace(parked("main"), identity=main))
    pool.park(replace(parked("other"), identity=Identity("opencode-7", "x-session-id")))
    pool.park(parked("unnamed"))
    pool.park(replace(parked("sub1"), identity=sub))
    pool.touch("main")  # the main agent just ran again: the sub-agent is now the name's oldest
    evicted = pool.park(replace(parked("sub2"), identity=sub))
    assert [s.session_id for s in evicted] == ["sub1"]
    assert ids(pool) == ["other", "unnamed", "main", "sub2"]
    # replacing a session of the name frees its place: nothing else of the name goes
    assert pool.park(replace(parked("main2"), identity=main), replaces="main") == []
    assert ids(pool) == ["other", "unnamed", "sub2", "main2"]
    # unnamed sessions have no per-name cap
    for i in range(3):
        pool.park(parked(f"u{i}"))
    assert ids(pool) == ["other", "unnamed", "sub2", "main2", "u0", "u1", "u2"]
