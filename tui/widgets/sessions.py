"""The parked sessions table."""

from __future__ import annotations

from textual.widgets import DataTable

from memrad.protocol import SessionInfo


def human_bytes(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"


class SessionsTable(DataTable):
    BORDER_TITLE = "parked sessions"

    def on_mount(self) -> None:
        self.cursor_type = "row"
        self.add_columns("session", "identity", "tokens", "checkpoint", "bytes", "age", "hits")

    def show(self, sessions: list[SessionInfo], ages_s: list[float]) -> None:
        """Redraw from `sessions`, keeping the cursor on the same session when it survives."""
        selected = self.selected_id
        self.clear()
        for s, age_s in zip(sessions, ages_s):
            identity = f"{s.identity} ({s.identity_source})" if s.identity else "-"
            where = f"{s.session_id} (disk)" if s.on_disk else s.session_id
            self.add_row(where, identity, str(s.num_tokens), str(s.prompt_checkpoint),
                         human_bytes(s.num_bytes), f"{age_s:.0f}s", str(s.hits), key=s.session_id)
        if selected is not None and selected in {s.session_id for s in sessions}:
            self.move_cursor(row=self.get_row_index(selected))

    @property
    def selected_id(self) -> str | None:
        if self.row_count == 0:
            return None
        return str(self.coordinate_to_cell_key(self.cursor_coordinate).row_key.value)
