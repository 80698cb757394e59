"""memra-tui: a live inspector of memrad's cache decisions.

Records arrive from a source (the control socket, or a recorded file) as messages; the
pure InspectorState folds them in; widgets redraw from it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

from rich.text import Text
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.message import Message
from textual.widgets import Footer, Static

from tui.client import Status
from tui.model import OUTCOMES, InspectorState
from tui.screens import DecisionScreen, HelpScreen
from tui.widgets.chains import ChainView
from tui.widgets.decisions import DecisionLog
from tui.widgets.flights import FlightsTable
from tui.widgets.sessions import SessionsTable
from tui.widgets.ttft import TtftChart

Source = Callable[[], AsyncIterator[object]]


class RecordReceived(Message):
    def __init__(self, record: object) -> None:
        super().__init__()
        self.record = record


class MemraApp(App):
    CSS_PATH = "app.tcss"
    TITLE = "memra-tui"
    BINDINGS = [
        Binding("q", "quit", "quit"),
        Binding("f", "cycle_filter", "filter"),
        Binding("enter", "open_decision", "open decision", show=True),
        Binding("r", "refresh", "refresh"),
        Binding("question_mark", "help", "help"),
    ]

    def __init__(self, source: Source, title: str = "") -> None:
        super().__init__()
        self.source = source
        self.state = InspectorState()
        self.outcome = "all"
        self.status_text = title or "connecting…"
        self._screenshot: tuple[float, object] | None = None

    def compose(self) -> ComposeResult:
        yield Static(self.status_text, id="status")
        with Vertical(id="top-left"):
            yield FlightsTable(id="flights")
            yield SessionsTable(id="sessions")
        yield ChainView(id="chains")
        yield DecisionLog(id="decisions")
        yield TtftChart(id="ttft")
        yield Footer()

    def screenshot_after(self, seconds: float, path) -> None:
        """Save the screen as SVG `seconds` after mounting, then exit (for docs and CI)."""
        self._screenshot = (seconds, path)

    def on_mount(self) -> None:
        self.run_worker(self._consume(), exclusive=True, group="source")
        self.redraw()
        self.set_interval(5.0, self._redraw_sessions)  # ages move on even when nothing happens
        if self._screenshot is not None:
            seconds, path = self._screenshot
            self.set_timer(seconds, lambda: self._save_and_exit(path))

    def _save_and_exit(self, path) -> None:
        path.write_text(self.export_screenshot(title="memra-tui"))
        self.exit()

    async def _consume(self) -> None:
        async for record in self.source():
            self.post_message(RecordReceived(record))

    def on_record_received(self, message: RecordReceived) -> None:
        record = message.record
        if isinstance(record, Status):
            self.status_text = record.text
            down = not record.connected and not record.text.startswith("replay")
            self.query_one("#status", Static).set_class(down, "down")
        else:
            self.state.apply(record)
        self.redraw()

    def redraw(self) -> None:
        state = self.state
        flags = " ".join(f"{k}={v}" for k, v in state.flags)
        dropped = f" · {state.dropped} events dropped" if state.dropped else ""
        self.query_one("#status", Static).update(
            Text(f"{self.status_text} · {state.model} on {state.device} · {flags}{dropped}"))
        self._redraw_sessions()
        self.query_one(FlightsTable).show(list(state.flights.values()))
        self.query_one(DecisionLog).show(state.decisions_for(self.outcome), self.outcome)
        self.query_one(TtftChart).show(state.turns, state.names)
        self._redraw_chains()

    def _redraw_sessions(self) -> None:
        parked = list(self.state.sessions.values())
        self.query_one(SessionsTable).show(parked, [self.state.age_s(s) for s in parked])

    def _redraw_chains(self) -> None:
        selected = self.query_one(SessionsTable).selected_id
        session = self.state.sessions.get(selected) if selected else None
        self.query_one(ChainView).show(session, self.state.latest_decision_about(selected))

    def on_data_table_row_highlighted(self, event: SessionsTable.RowHighlighted) -> None:
        if isinstance(event.data_table, SessionsTable):
            self._redraw_chains()

    def on_data_table_row_selected(self, event: DecisionLog.RowSelected) -> None:
        if isinstance(event.data_table, DecisionLog):
            self.action_open_decision()

    def action_cycle_filter(self) -> None:
        self.outcome = OUTCOMES[(OUTCOMES.index(self.outcome) + 1) % len(OUTCOMES)]
        self.query_one(DecisionLog).show(self.state.decisions_for(self.outcome), self.outcome)

    def action_open_decision(self) -> None:
        event = self.query_one(DecisionLog).selected
        if event is not None:
            self.push_screen(DecisionScreen(event))

    def action_refresh(self) -> None:
        self.run_worker(self._consume(), exclusive=True, group="source")

    def action_help(self) -> None:
        self.push_screen(HelpScreen())
