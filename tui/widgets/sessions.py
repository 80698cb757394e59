"""The parked sessions table, grouped by name: a name is a set of conversations (a main
agent, its sub-agents, side queries), so its sessions sit together under one label."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import DataTable

from memrad.protocol import SessionInfo


def human_bytes(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"


def by_name(sessions: list[SessionInfo]) -> list[tuple[SessionInfo, str]]:
    """Each session with its identity cell, grouped by name. `sessions` is least recently
    used first: a group stands where its most recent session does, its members in their
    own order; unnamed sessions keep their places. The group's first row carries the label
    (name, source, count); the others a ditto mark."""
    groups: dict[str, list[SessionInfo]] = {}
    for s in sessions:
        if s.identity is not None:
            groups.setdefault(s.identity, []).append(s)
    slots: list[tuple[int, list[SessionInfo]]] = []
    for i, s in enumerate(sessions):
        if s.identity is None:
            slots.append((i, [s]))
        elif groups[s.identity][-1] is s:
            slots.append((i, groups[s.identity]))
    rows = []
    for _, members in sorted(slots, key=lambda slot: slot[0]):
        head = members[0]
        if head.identity is None:
            rows.append((head, "-"))
            continue
        count = f" · {len(members)}" if len(members) > 1 else ""
        rows.append((head, f"{head.identity} ({head.identity_source}){count}"))
        rows += [(s, "  ″") for s in members[1:]]
    return rows


class SessionsTable(DataTable):
    BORDER_TITLE = "parked sessions"

    def on_mount(self) -> None:
        self.cursor_type = "row"
        self.add_columns("session", "identity", "tokens", "checkpoint", "bytes", "age", "hits")

    def show(self, sessions: list[SessionInfo], ages_s: list[float]) -> None:
        """Redraw from `sessions`, keeping the cursor on the same session when it survives."""
        selected = self.selected_id
        self.clear()
        age_of = {s.session_id: age_s for s, age_s in zip(sessions, ages_s)}
        for s, identity in by_name(sessions):
            age_s = age_of[s.session_id]
            where = f"{s.session_id} (disk)" if s.on_disk else s.session_id
            # Text, not str: a DataTable reads a string cell as markup, and names are clients'.
            self.add_row(Text(where), Text(identity), str(s.num_tokens), str(s.prompt_checkpoint),
                         human_bytes(s.num_bytes), f"{age_s:.0f}s", str(s.hits), key=s.session_id)
        if selected is not None and selected in {s.session_id for s in sessions}:
            self.move_cursor(row=self.get_row_index(selected))

    @property
    def selected_id(self) -> str | None:
        if self.row_count == 0:
            return None
        return str(self.coordinate_to_cell_key(self.cursor_coordinate).row_key.value)
