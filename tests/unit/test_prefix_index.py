"""The prefix index proposes, the tokens decide; boundary thinning only ever gets stricter."""

from memrad.engine.state.snapshot import RECENT_BOUNDARIES, thin_boundaries
from memrad.reuse.pool import Namespace, ParkedSession, ReusePool
from memrad.reuse.prefix_index import BLOCK, PrefixIndex, common_prefix_len

NS, OTHER = Namespace("m", None), Namespace("m", "salt")


def parked(sid, tokens, ns=NS):
    return ParkedSession(session_id=sid, namespace=ns, identity=None, token_ids=tuple(tokens), text="",
                         prompt_checkpoint=len(tokens), checkpoints=(), croppable=True, exact_limit=len(tokens),
                         fingerprint=(), num_bytes=1, created_at=0.0, last_used_at=0.0)


SYSTEM = list(range(100, 100 + 3 * BLOCK + 5))


def test_matches_are_the_sessions_sharing_a_block_with_their_real_common_prefix():
    pool = ReusePool(8, 100)
    pool.park(parked("s1", SYSTEM + [1] * 40))
    pool.park(parked("s2", SYSTEM + [2] * 40))
    pool.park(parked("s3", [7] * 80))                   # shares nothing
    pool.park(parked("s4", SYSTEM + [1] * 40, OTHER))   # another namespace
    prompt = tuple(SYSTEM + [1] * 10 + [9])
    found = {m.session.session_id: m.shared_tokens for m in pool.prefix_matches(NS, prompt)}
    assert found == {"s1": len(SYSTEM) + 10, "s2": len(SYSTEM)}


def test_removal_and_eviction_leave_the_index():
    pool = ReusePool(1, 100)
    pool.park(parked("s1", SYSTEM))
    pool.park(parked("s2", SYSTEM))  # evicts s1
    assert [m.session.session_id for m in pool.prefix_matches(NS, tuple(SYSTEM))] == ["s2"]
    pool.remove("s2")
    assert pool.prefix_matches(NS, tuple(SYSTEM)) == ()


def test_a_hash_collision_is_caught_by_the_token_comparison():
    index = PrefixIndex()
    index.add("s1", NS, SYSTEM)
    assert index.lookup(NS, SYSTEM) == {"s1": len(SYSTEM) // BLOCK}
    pool = ReusePool(4, 100)
    pool.park(parked("s1", SYSTEM))
    pool._index = index
    index._holders[next(iter(index._holders))].add("s9")  # a fake holder of block 0
    pool._sessions["s9"] = parked("s9", [5] * len(SYSTEM))
    assert [m.session.session_id for m in pool.prefix_matches(NS, tuple(SYSTEM))] == ["s1"]


def test_common_prefix_len_bisects_to_the_first_difference():
    a = tuple(range(1000))
    for cut in (0, 1, 255, 256, 257, 999):
        assert common_prefix_len(a, a[:cut] + (-1,) * 10) == cut
    assert common_prefix_len(a, a) == 1000 and common_prefix_len(a, list(a[:10])) == 10


def test_boundary_thinning_keeps_the_recent_and_a_geometric_tail_and_only_drops():
    kept_before = None
    for n in range(1, 200):
        anchors = tuple(range(10, 10 * n + 1, 10))
        candidates = anchors if kept_before is None else tuple(sorted(kept_before | {anchors[-1]}))
        kept = thin_boundaries(candidates, anchors)
        assert set(anchors[-RECENT_BOUNDARIES:]) <= kept
        assert len(kept) <= RECENT_BOUNDARIES + 2 * n.bit_length()
        # what the rule keeps from everything equals what it keeps from last turn's survivors
        assert kept == thin_boundaries(anchors, anchors)
        kept_before = kept
