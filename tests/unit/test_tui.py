"""memra-tui driven with Pilot against a recorded event stream (no daemon, no model)."""

import os
from pathlib import Path

import pytest

from memrad.protocol import (
    Decision, DecisionEvent, EvictEvent, FlightEvent, FlightInfo, ParkEvent, PoolStats, SegmentInfo, SessionInfo, StateSnapshot, TurnEvent,
    to_line,
)
from tui.app import MemraApp
from tui.client import Status, replay_records
from tui.screens import DecisionScreen, HelpScreen
from tui.widgets.chains import render_chains
from tui.widgets.decisions import DecisionLog
from tui.widgets.sessions import SessionsTable

SNAPSHOTS = Path(__file__).parent / "snapshots"
T0 = 1_790_000_000.0


def seg(label, start, end, h):
    return SegmentInfo(label, start, end, h)


SYSTEM, USER1, REPLY1, USER2 = (seg("<|im_start|>system", 0, 300, "a1a1a1a1a1a1a1a1"),
                                seg("<|im_start|>user", 300, 340, "b2b2b2b2b2b2b2b2"),
                                seg("<|im_start|>assistant", 340, 420, "c3c3c3c3c3c3c3c3"),
                                seg("<|im_start|>user", 420, 450, "d4d4d4d4d4d4d4d4"))
GEN = seg("<|im_start|>assistant", 450, 453, "e5e5e5e5e5e5e5e5")


def session(sid, identity, tokens, segments, hits=0):
    return SessionInfo(sid, identity, "session_id" if identity else None, "SmolLM2-135M-Instruct", None, tokens,
                       tokens - 24, 256, (), tokens * 46080, 12.0, hits, segments)


def decision_event(i, outcome, reason, candidate=None, divergence=None, context=None, tier="affinity", step=None):
    d = Decision(f"chatcmpl-{i:04d}", outcome, reason, 256 if outcome == "resumed" else 0, 197,
                 tier=None if outcome == "cold" else tier, candidate=candidate,
                 checkpoint=256 if outcome == "resumed" else None, divergence=divergence, step=step)
    return DecisionEvent(T0 + i, d, 453, None, (SYSTEM, USER1, REPLY1, USER2, GEN), context)


RECORDS = [
    StateSnapshot("SmolLM2-135M-Instruct", "cpu", 60.0, 3, PoolStats(1, 10, 32, 100),
                  (("reuse.mode", "exact"), ("affinity", "true")), (session("s1", None, 364, (SYSTEM, USER1, seg(
                      "<|im_start|>assistant", 340, 343, "f6f6f6f6f6f6f6f6"))),)),
    decision_event(1, "cold", "no nomination: 2 shared segments < 3", step="eager"),  # the compiled step was building
    ParkEvent(T0 + 1, session("s2", None, 364, (SYSTEM, USER1)), None),  # the engine parks, then reports the turn
    TurnEvent(T0 + 1, "chatcmpl-0001", "s2", None, 340, 0, 24, 0.91, "cold", "length"),
    decision_event(2, "resumed", "implicit, 4 shared segments; checkpoint 256; primed 197", candidate="s2",
                   step="compiled"),
    ParkEvent(T0 + 2, session("s3", None, 477, (SYSTEM, USER1, REPLY1, USER2, GEN), hits=1), "s2"),
    TurnEvent(T0 + 2, "chatcmpl-0002", "s3", None, 453, 256, 24, 0.41, "resumed", "stop"),
    decision_event(3, "declined", "history diverged at 12 of checkpoint 256", candidate="s3", divergence=12,
                   context=("You are a ▸ careless agent", "You are a ▸ careful agent")),
    ParkEvent(T0 + 3, session("s4", "agent-b", 494, (SYSTEM, USER1)), None),
    TurnEvent(T0 + 3, "chatcmpl-0003", "s4", "agent-b", 470, 0, 24, 1.2, "declined", "stop"),
    EvictEvent(T0 + 4, "s1", 364, 364 * 46080),
    Status(False, "replay of fixture: 11 events"),
]


def source():
    async def records():
        for record in RECORDS:
            yield record
    return records()


async def settle(pilot):
    for _ in range(5):
        await pilot.pause()


async def test_sessions_chains_and_decisions_fill_from_the_stream():
    app = MemraApp(source)
    async with app.run_test(size=(150, 44)) as pilot:
        await settle(pilot)
        assert list(app.state.sessions) == ["s3", "s4"]  # s1 evicted, s2 replaced by s3
        table = app.query_one(SessionsTable)
        assert table.row_count == 2 and table.selected_id == "s3"
        assert [e.decision.outcome for e in app.query_one(DecisionLog).shown] == ["cold", "resumed", "declined"]
        log = app.query_one(DecisionLog)
        assert [str(log.get_row_at(row)[3]) for row in range(3)] == ["eager", "compiled", "-"]  # the step column
        assert app.state.root_of["s3"] == "s2"  # one conversation across the resume
        assert [t.ttft_s for t in app.state.turns["s2"]] == [0.91, 0.41]


async def test_select_a_session_open_a_decision_and_filter():
    app = MemraApp(source)
    async with app.run_test(size=(150, 44)) as pilot:
        await settle(pilot)
        await pilot.click("#sessions")
        await pilot.press("down")
        assert app.query_one(SessionsTable).selected_id == "s4"
        log = app.query_one(DecisionLog)
        log.focus()
        await pilot.press("enter")
        assert isinstance(app.screen, DecisionScreen)
        assert app.screen.event.decision.reason == "history diverged at 12 of checkpoint 256"
        await pilot.press("escape")
        assert not isinstance(app.screen, DecisionScreen)
        await pilot.press("f")
        assert app.outcome == "resumed" and [e.decision.outcome for e in log.shown] == ["resumed"]
        await pilot.press("f", "f", "f")
        assert app.outcome == "all" and len(log.shown) == 3
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)


def test_chains_mark_the_shared_run_and_the_bar():
    parked = session("s3", None, 477, (SYSTEM, USER1, REPLY1, USER2, GEN))
    event = decision_event(9, "resumed", "x", candidate="s3")
    table = render_chains(parked, event)
    assert table.caption == "5 shared leading segments: reaches the bar of 3"
    short = session("s2", None, 364, (SYSTEM, USER1, seg("<|im_start|>assistant", 340, 343, "0000000000000000")))
    assert render_chains(short, event).caption == "2 shared leading segments: below the bar of 3"


async def test_the_main_screen_matches_its_snapshot():
    app = MemraApp(source)
    async with app.run_test(size=(150, 44)) as pilot:
        await settle(pilot)
        svg = app.export_screenshot(title="memra-tui")
    path = SNAPSHOTS / "main_screen.svg"
    if os.environ.get("UPDATE_SNAPSHOTS") == "1" or not path.exists():
        path.parent.mkdir(exist_ok=True)
        path.write_text(svg)
        if os.environ.get("UPDATE_SNAPSHOTS") != "1":
            pytest.fail(f"wrote a new snapshot {path}: review it and commit it")
    assert svg == path.read_text()


async def test_replay_reads_a_recorded_file(tmp_path):
    path = tmp_path / "events.jsonl"
    path.write_bytes(b"".join(to_line(r) for r in RECORDS if not isinstance(r, Status)))
    got = [r async for r in replay_records(path)]
    assert got[:-1] == [r for r in RECORDS if not isinstance(r, Status)]
    assert got[-1] == Status(False, f"replay of {path}: 11 events")


async def test_no_daemon_is_said_plainly_and_retried(tmp_path):
    from tui.client import socket_records

    records = socket_records(str(tmp_path / "absent.sock"))
    first = await records.__anext__()
    assert first == Status(False, f"no daemon at {tmp_path / 'absent.sock'}: start one with `memrad start` "
                                  "(waiting for it)")
    await records.aclose()


def test_chains_compare_the_request_with_the_candidate_as_it_was():
    rewritten = seg("<|im_start|>assistant", 340, 400, "9999999999999999")  # the client cut reply 1
    event = DecisionEvent(T0, Decision("chatcmpl-9", "resumed", "x", 256, 100, tier="affinity", candidate="s2",
                                       divergence=371), 453, None, (SYSTEM, USER1, rewritten, USER2, GEN),
                          None, (SYSTEM, USER1, REPLY1, USER2, GEN))
    now_parked = session("s3", None, 477, (SYSTEM, USER1, rewritten, USER2, GEN))
    table = render_chains(now_parked, event)
    assert str(table.columns[1].header) == "parked s2"
    assert table.caption == "2 shared leading segments: below the bar of 3; tokens diverge at 371"


async def test_the_socket_source_reattaches_after_a_daemon_restart(tmp_path):
    import asyncio

    from memrad.server.control import ControlServer, EventBus
    from tui.client import socket_records

    snapshot = RECORDS[0]
    path = tmp_path / "memrad.sock"

    async def serve():
        server = ControlServer(path, EventBus(asyncio.get_running_loop()), lambda: snapshot)
        await server.start()
        return server

    server = await serve()
    records = socket_records(str(path))
    assert await records.__anext__() == Status(True, f"connected to {path}")
    assert await records.__anext__() == snapshot
    await server.close()
    assert await asyncio.wait_for(records.__anext__(), 5) == Status(
        False, f"the daemon at {path} went away: reconnecting")
    server = await serve()
    assert await asyncio.wait_for(records.__anext__(), 5) == Status(True, f"connected to {path}")
    assert await records.__anext__() == snapshot
    await records.aclose()
    await server.close()


def test_the_tui_finds_the_socket_where_the_daemon_puts_it(tmp_path, monkeypatch):
    from memrad.paths import socket_path
    from memrad.protocol import default_socket_path

    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    runtime.chmod(0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    assert default_socket_path() == str(socket_path()) == str(runtime / "memra" / "memrad.sock")
    runtime.chmod(0o755)  # not owner-only: both fall back the same way
    assert default_socket_path() == str(socket_path())


def named(sid, name):
    return SessionInfo(sid, name, "metadata.user_id" if name else None, "SmolLM2-135M-Instruct", None, 400, 376, 256,
                       (), 400 * 46080, 5.0, 0, (SYSTEM, USER1))


# least recently used first: the main agent, an unnamed chat, a sub-agent, opencode, a side query
GROUPED = [named("s5", "claude-1"), named("s7", None), named("s6", "claude-1"), named("s8", "ses_7f3a"),
           named("s9", "claude-1")]


def test_parked_sessions_are_grouped_by_name_where_its_newest_stands():
    from tui.widgets.sessions import by_name

    assert [(s.session_id, cell) for s, cell in by_name(GROUPED)] == [
        ("s7", "-"), ("s8", "ses_7f3a (metadata.user_id)"), ("s5", "claude-1 (metadata.user_id) · 3"),
        ("s6", "  ″"), ("s9", "  ″")]


async def test_the_sessions_table_shows_a_name_as_one_group():
    def grouped_source():
        async def records():
            yield StateSnapshot("SmolLM2-135M-Instruct", "cpu", 60.0, 5, PoolStats(5, 10, 32, 100), (), tuple(GROUPED))
        return records()

    app = MemraApp(grouped_source)
    async with app.run_test(size=(150, 44)) as pilot:
        await settle(pilot)
        table = app.query_one(SessionsTable)
        rows = [[str(cell) for cell in table.get_row_at(i)[:2]] for i in range(table.row_count)]
        assert rows == [["s7", "-"], ["s8", "ses_7f3a (metadata.user_id)"], ["s5", "claude-1 (metadata.user_id) · 3"],
                        ["s6", "  ″"], ["s9", "  ″"]]
        await pilot.click("#sessions")
        await pilot.press("down", "down")
        assert table.selected_id == "s5"  # rows keep their sessions' keys


def test_the_decision_screen_lists_what_was_weighed():
    from memrad.protocol import Alternative
    from tui.screens import render_decision

    d = Decision("chatcmpl-7", "resumed", "longest prefix with s5, 2,654 of 2,700; forked; weighed affinity s3 at "
                 "1,886, prefix s5 at 2,654: most reuse", 2654, 46, tier="prefix", candidate="s5", checkpoint=2654,
                 weighed=(Alternative("affinity", "s3", 1886), Alternative("prefix", "s5", 2654)), won_by="most reuse")
    table = render_decision(DecisionEvent(T0, d, 2700, "claude-1", (SYSTEM,)))
    rows = dict(zip((str(c) for c in table.columns[0]._cells), (str(c) for c in table.columns[1]._cells)))
    assert (rows["  affinity"], rows["  prefix"], rows["won by"]) == ("s3: 1,886 tokens", "s5: 2,654 tokens ◂ won",
                                                                     "most reuse")


def flight(rid, phase, primed, generated, conversation=None, identity="agent"):
    return FlightInfo(rid, identity, conversation, phase, 9310, primed, generated, 1.5)


async def test_in_flight_rows_follow_the_requests_on_the_model():
    from tui.widgets.flights import FlightsTable

    snapshot = StateSnapshot("SmolLM2-135M-Instruct", "cpu", 60.0, 3, None, (), (),
                             flights=(flight("req-main", "decode", 9310, 12, conversation="s3"),))
    stream = [snapshot,
              FlightEvent(T0 + 1, flight("req-side", "prefill", 256, 0)),
              FlightEvent(T0 + 2, flight("req-side", "prefill", 512, 0)),
              FlightEvent(T0 + 3, flight("req-main", "decode", 9310, 28, conversation="s3"))]
    later = [FlightEvent(T0 + 4, flight("req-side", "done", 9310, 3)),
             TurnEvent(T0 + 5, "req-main", "s5", "agent", 9310, 9000, 40, 0.3, "resumed", "stop")]
    feed = list(stream)

    def records():
        async def gen():
            for record in feed:
                yield record
        return gen()

    app = MemraApp(records)
    async with app.run_test(size=(150, 44)) as pilot:
        await settle(pilot)
        table = app.query_one(FlightsTable)
        rows = [[str(cell) for cell in table.get_row_at(i)] for i in range(table.row_count)]
        assert rows == [["req-main", "agent", "s3", "decode", "decoded 28"],
                        ["req-side", "agent", "new", "prefill", "primed 512 of 9,310"]]
        assert table.border_subtitle == "2 on the model"
        for record in later:
            app.state.apply(record)
        app.redraw()
        await settle(pilot)
        assert table.row_count == 0 and table.border_subtitle == "idle"


HOSTILE_NAMES = ("[/oops]", "[bold red]styled?[/bold red]", "[link=file:///etc/passwd]x[/link]")


async def test_client_strings_are_shown_as_text_never_read_as_markup():
    """Issue 35, item 7: a session named `[/oops]` crashed memra-tui (MarkupError) and
    `[bold red]…` rendered styled. Names reach the sessions table, the in-flight table, the
    decision log's reasons and the decision screen: each shows them character for character."""
    from tui.screens import render_decision
    from tui.widgets.flights import FlightsTable

    sessions = tuple(session(f"s{i}", name, 300 + i, (SYSTEM, USER1)) for i, name in enumerate(HOSTILE_NAMES, 1))
    flights = tuple(flight(f"req-{i}", "decode", 300, 3, conversation=f"s{i}", identity=name)
                    for i, name in enumerate(HOSTILE_NAMES, 1))
    reason = f'declined (named "{HOSTILE_NAMES[0]}" vs unnamed parked session)'
    event = DecisionEvent(T0, Decision("chatcmpl-[/oops]", "declined", reason, 0, 300, tier="affinity"), 300,
                          HOSTILE_NAMES[1], (SYSTEM, USER1), None)

    def records():
        async def gen():
            yield StateSnapshot("SmolLM2-135M-Instruct", "cpu", 60.0, 3, PoolStats(3, 10, 32, 100), (), sessions,
                                flights=flights)
            yield event
        return gen()

    app = MemraApp(records)
    async with app.run_test(size=(150, 44)) as pilot:  # used to raise MarkupError here
        await settle(pilot)
        table = app.query_one(SessionsTable)
        cells = {str(table.get_row_at(i)[1]) for i in range(table.row_count)}
        assert cells == {f"{name} (session_id)" for name in HOSTILE_NAMES}
        assert all(not table.get_row_at(i)[1].spans for i in range(table.row_count))  # no style read from a name
        in_flight = app.query_one(FlightsTable)
        assert {str(in_flight.get_row_at(i)[1]) for i in range(in_flight.row_count)} == set(HOSTILE_NAMES)
        log = app.query_one(DecisionLog)
        assert [str(c) for c in log.get_row_at(0)[1:]] == ["-[/oops]", "affinity: declined", "-", reason]  # the step column: none
        await pilot.click("#decisions")
        await pilot.press("enter")
        await settle(pilot)
        assert isinstance(app.screen, DecisionScreen)
    table = render_decision(event)
    shown = {str(cell) for column in table.columns for cell in column.cells}
    assert f"affinity: declined ({reason})" in shown and HOSTILE_NAMES[1] in shown and "chatcmpl-[/oops]" in shown


def test_the_ttft_legend_shows_the_last_turns_drafts_where_they_were_verified():
    from memrad.protocol import Speculation, TurnEvent
    from tui.widgets.ttft import render_chart

    turn = lambda spec: TurnEvent(1.0, "r", "s1", None, 500, 0, 43, 0.25, "cold", "length", 2.0,  # noqa: E731
                                  speculation=spec)
    spec = Speculation(True, "on the eager step, up to 8 drafted", 40, 30, 6, 12, 42)
    legend = render_chart({"s1": [turn(spec)]}, {"s1": "agent"}).plain.splitlines()[-1]
    assert legend.endswith("agent: 1 turns, last TTFT 0.25s at 500 tokens, drafts kept 75% of 40, 3.50 tokens/step")
    plain = render_chart({"s1": [turn(Speculation(False, "speculate = off"))]}, {"s1": "agent"}).plain
    assert plain.splitlines()[-1].endswith("at 500 tokens")
