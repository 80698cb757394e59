"""Drafts come from the context: the longest earlier match of the tail wins, then the most recent;
the draft length follows what was accepted and backs off to plain decoding on misses."""

from hypothesis import given, settings
from hypothesis import strategies as st

from memrad.reuse.drafts import CANDIDATES, KEYS, DraftIndex, DraftLength


def reference(seq: list[int], k: int) -> list[int]:
    """Brute force over every earlier position: the longest match of at least 3 tokens (the
    key), then the most recent."""
    end, best, best_len = len(seq), None, 0
    for j in range(1, end):
        length = 0
        while length < j and seq[j - 1 - length] == seq[end - 1 - length]:
            length += 1
        if length >= KEYS[0] and length >= best_len:  # >=: a later j of the same length is more recent
            best, best_len = j, length
    return [] if best is None else seq[best : best + min(k, best_len)]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=30), st.integers(1, 10))
def test_a_draft_is_what_followed_the_longest_then_most_recent_match(seq, k):
    # 30 tokens: no key occurs CANDIDATES times, so the brute force sees what the index sees
    assert len(seq) < CANDIDATES
    assert DraftIndex(seq).propose(k) == reference(seq, k)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 5), max_size=25), st.lists(st.integers(0, 5), max_size=5))
def test_extending_token_by_token_equals_building_at_once(prompt, reply):
    grown = DraftIndex(prompt)
    for token in reply:
        grown.extend([token])
    assert grown.propose(8) == DraftIndex(prompt + reply).propose(8)


def test_a_rewrite_drafts_the_rest_of_the_line_it_is_copying():
    prompt = [10, 11, 12, 13, 14, 15, 16, 17, 2, 30, 31]  # ... the file, then the request
    index = DraftIndex(prompt)
    index.extend([10, 11, 12])  # the reply starts copying the file
    assert index.propose(8) == [13, 14, 15]  # no longer than the match
    index.extend([13, 14, 15, 16, 17])
    assert index.propose(4) == [2, 30, 31, 10]
    assert index.propose(100) == [2, 30, 31, 10, 11, 12, 13, 14]


def test_the_longer_match_beats_the_more_recent_one():
    #          [5 6 7] -> 1          [9 7] -> 2        tail [5 6 7]
    index = DraftIndex([5, 6, 7, 1, 9, 7, 2, 5, 6, 7])
    assert index.propose(1) == [1]
    #          equal matches [4 5 7]: the most recent wins
    assert DraftIndex([4, 5, 7, 1, 4, 5, 7, 2, 4, 5, 7]).propose(1) == [2]


def test_nothing_to_draft():
    assert DraftIndex([]).propose(4) == []
    assert DraftIndex([7, 8, 1, 7, 8]).propose(4) == []  # a 2-token match is chance on fresh text: no draft
    assert DraftIndex([1, 2, 3]).propose(4) == []  # 3 never occurred before the end
    assert DraftIndex([1, 2, 1]).propose(0) == []


def test_draft_length_grows_on_full_acceptance_and_shrinks_to_what_was_kept():
    length = DraftLength(start=2, most=8)
    length.record(2, 2)
    assert length.k == 4
    length.record(4, 4)
    length.record(8, 8)
    assert length.k == 8  # capped at `most`
    length.record(8, 3)
    assert (length.k, length.paused) == (4, 0)
    length.record(4, 0)
    assert (length.k, length.paused) == (1, 0)


def test_misses_at_length_one_pause_speculation_longer_each_time():
    length = DraftLength(start=1, most=8)
    pauses = []
    for _ in range(8):
        length.record(1, 0)
        pauses.append(length.paused)
        for _ in range(length.paused):
            length.plain_step()
        assert length.paused == 0
    assert pauses == [1, 2, 4, 8, 16, 32, 64, 64]
    length.record(1, 1)  # a hit ends the back-off
    assert length.k == 2
    length.record(2, 0)
    length.record(1, 0)
    assert length.paused == 1


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 4), max_size=40), st.lists(st.integers(0, 4), max_size=40), st.integers(0, 40))
def test_an_index_brought_to_the_next_turn_equals_one_built_from_scratch(parked, turn, shared):
    # the next turn keeps some of the parked tokens (the client re-rendered the reply) and adds its own
    turn = parked[:shared] + turn
    fresh = DraftIndex(turn)
    followed = DraftIndex(parked)
    followed.follow(turn)  # a resume that replaces its parent: in place
    assert followed == fresh and followed.propose(8) == fresh.propose(8)
    for token in (1, 2, 3):  # and it goes on growing as the fresh one does
        followed.extend([token])
        fresh.extend([token])
        assert followed == fresh and followed.propose(8) == fresh.propose(8)


def test_truncating_drops_every_position_past_the_length():
    index = DraftIndex([1, 2, 3, 1, 2, 3, 4])
    index.truncate(6)
    assert index == DraftIndex([1, 2, 3, 1, 2, 3])
    assert index.propose(8) == [1, 2, 3]  # [1 2 3] ended at 3 before, followed by 1 2 3
    index.truncate(0)
    assert index == DraftIndex() and index.propose(8) == []
