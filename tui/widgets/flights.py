"""The requests on the model now (beside the parked sessions, top left): one row each, with
the conversation it continues, its phase and how far it got. Up to max_batch rows."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import DataTable

from memrad.protocol import FlightInfo


def progress(flight: FlightInfo) -> str:
    """'primed 512 of 9,310' while prefilling, 'decoded 37' while decoding."""
    if flight.phase == "prefill":
        return f"primed {flight.primed_tokens:,} of {flight.prompt_tokens:,}"
    return f"decoded {flight.generated_tokens:,}"


class FlightsTable(DataTable):
    BORDER_TITLE = "in flight"

    def on_mount(self) -> None:
        self.cursor_type = "none"
        self.add_columns("request", "identity", "conversation", "phase", "tokens so far")

    def show(self, flights: list[FlightInfo]) -> None:
        self.clear()
        for f in flights:
            self.add_row(Text(f.request_id[-12:]), Text(f.identity or "-"), Text(f.conversation or "new"), f.phase,
                         progress(f), key=f.request_id)
        self.border_subtitle = f"{len(flights)} on the model" if flights else "idle"
