import pytest

from memrad.grid import grid_chunks, grid_floor, relative_chunks


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
