import pytest

from memrad.grid import (canonical_chunks, cut_floor, cuts_up_to, find_anchors, grid_chunks, grid_floor, is_cut,
                         relative_chunks)


def test_cold_prefill_is_cut_at_multiples_of_the_chunk():
    assert grid_chunks(0, 1100, 256) == [(0, 256), (256, 512), (512, 768), (768, 1024), (1024, 1100)]


def test_a_resume_off_the_grid_first_reaches_the_grid_then_follows_it():
    assert grid_chunks(300, 1100, 256) == [(300, 512), (512, 768), (768, 1024), (1024, 1100)]


def test_a_resume_on_the_grid_runs_the_same_chunks_as_a_cold_run_from_there():
    cold = grid_chunks(0, 1100, 256)
    assert grid_chunks(512, 1100, 256) == [span for span in cold if span[0] >= 512]


def test_edges():
    assert grid_chunks(7, 7, 4) == []
    assert grid_chunks(0, 3, 4) == [(0, 3)]
    assert grid_chunks(4, 8, 4) == [(4, 8)]
    with pytest.raises(ValueError):
        grid_chunks(5, 4, 4)
    with pytest.raises(ValueError):
        grid_chunks(0, 4, 0)


def test_grid_floor():
    assert grid_floor(511, 256) == 256
    assert grid_floor(512, 256) == 512
    assert grid_floor(3, 256) == 0


def test_relative_chunks_count_from_the_start():
    assert relative_chunks(2426, 2658, 256) == [(2426, 2658)]
    assert relative_chunks(300, 1100, 256) == [(300, 556), (556, 812), (812, 1068), (1068, 1100)]
    assert relative_chunks(0, 600, 256) == grid_chunks(0, 600, 256)


def test_the_grid_restarts_at_each_reply_anchor():
    # anchors 21 and 40: cuts at 16 | 21, 37 | 40, 56 (C counted from 0, then from each anchor)
    assert canonical_chunks(0, 70, 16, (21, 40, 70)) == [(0, 16), (16, 21), (21, 37), (37, 40), (40, 56),
                                                         (56, 70)]
    assert cuts_up_to(70, 16, (21, 40)) == [16, 21, 37, 40, 56] == [p for p in range(1, 71) if is_cut(p, 16, (21, 40))]
    # A resume from an anchor runs exactly the cold run's chunks from there on ...
    cold = canonical_chunks(0, 70, 16, (21, 40))
    assert canonical_chunks(21, 70, 16, (21, 40)) == [span for span in cold if span[0] >= 21]
    # ... and a suffix of up to C tokens after an anchor is one chunk, wherever it sits.
    assert canonical_chunks(40, 56, 16, (21, 40)) == [(40, 56)]
    assert canonical_chunks(5, 9, 16, ()) == grid_chunks(5, 9, 16)
    assert cuts_up_to(50, 16) == [16, 32, 48] and cuts_up_to(0, 16) == []


def test_anchors_follow_each_reply_header_and_cut_floor_takes_the_last_cut():
    header = (1, 520)
    ids = [1, 9, 5, 2, 1, 520, 7, 2, 1, 9, 2, 1, 520]
    assert find_anchors(ids, header) == (6, 13)  # right after each header: where a reply begins
    assert find_anchors(ids, ()) == ()
    assert cut_floor(13, 8, (6, 13)) == 13 and cut_floor(12, 8, (6, 13)) == 6 and cut_floor(5, 8, (6,)) == 0
    assert cut_floor(20, 8, (6,)) == 14
    assert is_cut(13, 8, (6, 13)) and is_cut(16, 8) and not is_cut(16, 8, (6,)) and not is_cut(12, 8, (6, 13))
