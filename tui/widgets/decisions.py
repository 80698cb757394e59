"""The decision log, newest last, filterable by outcome: one row a request, with the decode
step its reply ran on (compiled, eager while the compiled step builds, or transformers)."""

from __future__ import annotations

import time

from rich.text import Text
from textual.widgets import DataTable

from memrad.protocol import DecisionEvent

STYLES = {"resumed": "green", "declined": "yellow", "cold": "red"}


class DecisionLog(DataTable):
    BORDER_TITLE = "decisions"

    def on_mount(self) -> None:
        self.cursor_type = "row"
        self.add_columns("time", "request", "outcome", "step", "reason")
        self.shown: list[DecisionEvent] = []

    def show(self, events: list[DecisionEvent], outcome: str) -> None:
        """Redraw; the cursor follows new decisions only while it sits on the newest one."""
        following = not self.shown or self.cursor_coordinate.row >= len(self.shown) - 1
        row = self.cursor_coordinate.row
        self.shown = list(events)
        self.clear()
        for i, e in enumerate(self.shown):
            d = e.decision
            head = f"{d.tier}: {d.outcome}" if d.tier else d.outcome
            # Text, not markup: the reason quotes session names, the request id is the client's.
            self.add_row(time.strftime("%H:%M:%S", time.gmtime(e.at)), Text(d.request_id[-8:]),
                         Text(head, style=STYLES[d.outcome]), Text(d.step or "-"), Text(d.reason), key=str(i))
        self.border_subtitle = f"filter: {outcome} (f)"
        if self.shown:
            self.move_cursor(row=len(self.shown) - 1 if following else min(row, len(self.shown) - 1))

    @property
    def selected(self) -> DecisionEvent | None:
        if not self.shown:
            return None
        return self.shown[self.cursor_coordinate.row]
