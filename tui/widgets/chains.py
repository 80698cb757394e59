"""A parked session's fingerprint chain beside the latest request's, aligned by segment."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text
from textual.widgets import Static

from memrad.protocol import DecisionEvent, SegmentInfo, SessionInfo

BAR = 3  # shared leading segments implicit nomination needs (memrad.reuse.identity)


def shared_run(a: tuple[SegmentInfo, ...], b: tuple[SegmentInfo, ...]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x.hash != y.hash:
            break
        n += 1
    return n


def render_chains(session: SessionInfo | None, event: DecisionEvent | None) -> Table | Text:
    if session is None:
        return Text("no parked session selected", style="dim")
    request = event.segments if event is not None else ()
    # Compare what the request was compared with: the candidate's chain at decision time
    # (the selected session may be the state that request left behind).
    parked = event.candidate_segments if event is not None and event.candidate_segments else session.segments
    parked_name = event.decision.candidate if event is not None and event.candidate_segments else session.session_id
    shared = shared_run(parked, request) if request else len(parked)
    table = Table(expand=True, box=None, pad_edge=False)
    table.add_column("#", justify="right", style="dim", width=3)
    # Headers as Text: a Rich table reads a string as markup, and a request id may be the client's.
    table.add_column(Text(f"parked {parked_name}"), ratio=1, no_wrap=True, overflow="ellipsis")
    table.add_column("", width=1)
    table.add_column(Text(f"request {event.decision.request_id[-8:]}" if event else "request"), ratio=1,
                     no_wrap=True, overflow="ellipsis")
    for i in range(max(len(parked), len(request))):
        left = parked[i] if i < len(parked) else None
        right = request[i] if i < len(request) else None
        if not request:
            mark, style = "", ""
        else:
            mark, style = ("=", "green") if i < shared else (("≠", "bold red") if i == shared else ("", "dim"))
        table.add_row(str(i), _cell(left, style), Text(mark, style=style), _cell(right, style))
    bar = "reaches" if shared >= BAR else "below"
    footer = f"{shared} shared leading segments: {bar} the bar of {BAR}" if request else \
        "no request compared with this session yet"
    if event is not None and event.decision.divergence is not None:
        footer += f"; tokens diverge at {event.decision.divergence}"
    table.caption = footer
    return table


def _cell(segment: SegmentInfo | None, style: str) -> Text:
    if segment is None:
        return Text("")
    return Text(f"{segment.label:<10} {segment.start:>5}-{segment.end:<5} {segment.hash[:6]}", style=style)


class ChainView(Static):
    BORDER_TITLE = "fingerprint chains"

    def show(self, session: SessionInfo | None, event: DecisionEvent | None) -> None:
        self.update(render_chains(session, event))
