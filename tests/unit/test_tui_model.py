"""The inspector's state folds records in (tui.model, pure): the header's threads flag follows
the engine's ThreadsEvents."""

from memrad.protocol import StateSnapshot, ThreadsEvent
from tui.model import InspectorState


def test_a_threads_change_replaces_the_snapshots_threads_flag_with_the_count_and_why():
    state = InspectorState()
    state.apply(StateSnapshot("SmolLM2", "cpu", 1.0, 0, None,
                              (("reuse.mode", "exact"), ("threads", "prefill 2, decode 2, batch 2")), ()))
    state.apply(ThreadsEvent(9.0, "decode", 2, 1, "steps 4.1x their quiet time for 3 s",
                             "prefill 2, decode 1, batch 2"))
    assert state.flags == (("reuse.mode", "exact"),
                           ("threads", "prefill 2, decode 1, batch 2 (decode 2 → 1: steps 4.1x their quiet time for 3 s)"))
