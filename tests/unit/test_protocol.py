import pytest

from memrad.protocol import (
    RECORDS, Alternative, Decision, DecisionEvent, Dropped, EvictEvent, FlightEvent, FlightInfo, ParkEvent, PoolStats, ProtocolError, SegmentInfo,
    SessionInfo, Speculation, StateSnapshot, ThreadsEvent, TurnEvent, from_line, to_line,
)

SEG = SegmentInfo("<|im_start|>user", 7, 14, "00ff00ff00ff00ff")
SESSION = SessionInfo("s3", "agent-1", "session_id", "SmolLM2", None, 530, 512, 512, (), 23_000_000, 4.5, 2,
                      (SEG, SegmentInfo("<|im_start|>assistant", 14, 18, "0123456789abcdef")))
DECISION = Decision("chatcmpl-1", "declined", "history diverged at 12233 of checkpoint 12234", 0, 12300,
                    tier="affinity", candidate="s3", nomination="implicit", shared_segments=7, divergence=12233)
WEIGHED = Decision("chatcmpl-2", "resumed", "longest prefix with s5, 2,654 of 2,700; forked; weighed affinity s3 "
                   "at 1,886, prefix s5 at 2,654: most reuse", 2654, 46, tier="prefix", candidate="s5",
                   checkpoint=2654, weighed=(Alternative("affinity", "s3", 1886), Alternative("prefix", "s5", 2654),
                                             Alternative("text-prefix", "s2", None)), won_by="most reuse")
FLIGHT = FlightInfo("chatcmpl-2", "agent-1", "s3", "decode", 12300, 12300, 37, 4.2)
EXAMPLES = [
    DECISION,
    WEIGHED,
    WEIGHED.weighed[0],
    SEG,
    SESSION,
    PoolStats(3, 10_000, 32, 2**30),
    StateSnapshot("SmolLM2", "cpu", 12.5, 9, PoolStats(1, 5, 32, 6), (("reuse.mode", "exact"),), (SESSION,)),
    StateSnapshot("SmolLM2", "cpu", 1.0, 0, None, (), ()),
    StateSnapshot("SmolLM2", "cpu", 1.0, 0, None, (), (), flights=(FLIGHT,)),
    FLIGHT,
    FlightEvent(2.0, FlightInfo("chatcmpl-3", None, None, "prefill", 16806, 512, 0, 0.8)),
    DecisionEvent(1.5, DECISION, 12300, None, (SEG,), ("…user said ▸ this", "…user said ▸ that")),
    TurnEvent(2.5, "chatcmpl-1", "s4", "agent-1", 12300, 12288, 40, 0.42, "resumed", "stop"),
    TurnEvent(2.5, "chatcmpl-1", "s4", "agent-1", 12300, 12288, 40, 0.42, "resumed", "stop", 3.1,
              Speculation(True, "on the eager step, up to 8 drafted", 30, 21, 9, 18, 39)),
    Speculation(False, "speculate = off"),
    ParkEvent(3.0, SESSION, "s2"),
    EvictEvent(4.0, "s1", 100, 4_608_000),
    Dropped(12),
    ThreadsEvent(5.0, "decode", 2, 1, "steps 4.1x their quiet time for 3 s", "prefill 2, decode 1, batch 2"),
    ProtocolError("unknown op 'x'"),
]


def test_every_record_kind_has_an_example():
    assert {type(e).__name__ for e in EXAMPLES} == set(RECORDS)


@pytest.mark.parametrize("record", EXAMPLES, ids=lambda r: type(r).__name__)
def test_every_record_round_trips_through_one_json_line(record):
    line = to_line(record)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert from_line(line) == record


@pytest.mark.parametrize("line, message", [
    (b"{not json", "not JSON"),
    (b'{"type": "Nope"}', "not a memra record"),
    (b'{"type": "Dropped", "wrong": 1}', "malformed Dropped"),
])
def test_anything_else_is_a_value_error(line, message):
    with pytest.raises(ValueError, match=message):
        from_line(line)


def test_the_protocol_imports_only_the_standard_library():
    import memrad.protocol as protocol

    source = open(protocol.__file__).read()
    modules = {line.split()[1].split(".")[0] for line in source.splitlines() if line.startswith(("import ", "from "))}
    assert modules == {"__future__", "json", "dataclasses", "typing"}


def test_a_threads_change_renders_its_phase_counts_and_reason():
    event = ThreadsEvent(5.0, "decode", 2, 1, "steps 4.1x their quiet time for 3 s", "prefill 2, decode 1, batch 2")
    assert event.render() == "decode 2 → 1: steps 4.1x their quiet time for 3 s"
