"""Modal screens: a decision in full (with what the client changed), and help."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Static

from memrad.protocol import DecisionEvent


def render_decision(event: DecisionEvent) -> Table:
    """Every cell is a Text: a Rich table reads a plain string as markup, and names, reasons
    and the divergence text come from clients (`[/oops]` would raise, `[bold red]` style)."""
    d = event.decision
    table = Table(box=None, show_header=False, expand=True)
    table.add_column(style="bold", width=18)
    table.add_column(ratio=1)
    table.add_row("decision", Text(d.render()))
    for name in ("request_id", "outcome", "tier", "candidate", "nomination", "source", "shared_segments",
                 "checkpoint", "divergence", "reused_tokens", "primed_tokens"):
        value = getattr(d, name)
        table.add_row(name.replace("_", " "), Text("-" if value is None else str(value)))
    if d.weighed:  # the candidates every tier offered, and why the winner won
        for a in d.weighed:
            reuse = "declined" if a.reused_tokens is None else f"{a.reused_tokens:,} tokens"
            mark = " ◂ won" if a.candidate == d.candidate and a.tier == d.tier else ""
            table.add_row(Text(f"  {a.tier}"), Text(f"{a.candidate}: {reuse}{mark}"))
        table.add_row("won by", Text(d.won_by or "-"))
    table.add_row("cost", Text(d.render_cost()))
    table.add_row("ttft", "-" if d.ttft_s is None else f"{d.ttft_s:.3f} s")
    table.add_row("prompt tokens", str(event.prompt_tokens))
    table.add_row("identity", Text(event.identity or "-"))
    if event.divergence_context is not None:
        mine, parked = event.divergence_context
        table.add_row("", "")
        table.add_row("what changed", Text("the text around the first differing token (▸):", style="dim"))
        table.add_row("  this request", Text(mine, style="yellow"))
        table.add_row("  parked session", Text(parked, style="cyan"))
    return table


class DecisionScreen(ModalScreen):
    BINDINGS = [Binding("escape,q,enter", "app.pop_screen", "close")]

    def __init__(self, event: DecisionEvent) -> None:
        super().__init__()
        self.event = event

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog"):
            yield Static(render_decision(self.event), id="decision-detail")


HELP = """\
memra-tui: what memrad decided for each request, and why.

  ↑/↓, tab     move within / between panes
  enter        open the selected decision (what the client changed)
  f            filter decisions: all → resumed → declined → cold
  r            refresh the snapshot of parked sessions
  ?            this help          q   quit

Sessions: parked conversations, their tokens, prompt checkpoint, bytes.
Chains: the selected session's message hashes beside the latest request's;
  = shared, ≠ first difference. Unnamed requests need 3 shared to be nominated.
TTFT: time to first token per turn against prompt length, per conversation:
  a flat line is reuse working; a rising one is re-priming.
"""


class HelpScreen(ModalScreen):
    BINDINGS = [Binding("escape,q,question_mark", "app.pop_screen", "close")]

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog"):
            yield Static(HELP, id="help-text")
