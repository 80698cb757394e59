"""Time to first token against prompt length, one series per conversation, as text."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static

from memrad.protocol import TurnEvent

MARKERS = "*o+x#@%&"  # one cell wide in every terminal font
COLORS = ("cyan", "magenta", "yellow", "green", "blue", "red", "white", "bright_black")


def render_chart(series: dict[str, list[TurnEvent]], names: dict[str, str], width: int = 56,
                 height: int = 10) -> Text:
    points = {key: [(t.prompt_tokens, t.ttft_s) for t in turns if t.ttft_s is not None]
              for key, turns in series.items()}
    points = {k: v for k, v in points.items() if v}
    if not points:
        return Text("no turns yet", style="dim")
    max_x = max(x for pts in points.values() for x, _ in pts) or 1
    max_y = max(y for pts in points.values() for _, y in pts) or 1.0
    grid = [[(" ", "")] * width for _ in range(height)]
    for i, (key, pts) in enumerate(points.items()):
        mark, color = MARKERS[i % len(MARKERS)], COLORS[i % len(COLORS)]
        for x, y in pts:
            col = min(width - 1, round(x / max_x * (width - 1)))
            row = height - 1 - min(height - 1, round(y / max_y * (height - 1)))
            grid[row][col] = (mark, color)
    out = Text()
    for r, row in enumerate(grid):
        label = f"{max_y:.2f}s" if r == 0 else ("0.00s" if r == height - 1 else "")
        out.append(f"{label:>7} │")
        for ch, color in row:
            out.append(ch, style=color)
        out.append("\n")
    out.append(" " * 8 + "└" + "─" * width + "\n")
    out.append(" " * 9 + f"0{'prompt tokens':^{width - 10}}{max_x:>9}\n")
    for i, key in enumerate(points):
        turns = series[key]
        out.append(f"  {MARKERS[i % len(MARKERS)]} ", style=COLORS[i % len(COLORS)])
        out.append(f"{names.get(key, key)}: {len(turns)} turns, last TTFT {turns[-1].ttft_s or 0:.2f}s "
                   f"at {turns[-1].prompt_tokens} tokens{drafts(turns[-1])}\n")
    out.no_wrap = True
    return out


def drafts(turn: TurnEvent) -> str:
    """The turn's speculation figures (memrad.protocol.Speculation), where drafts were verified."""
    spec = turn.speculation
    if spec is None or not spec.on or not spec.drafted_tokens:
        return ""
    return f", drafts kept {spec.acceptance:.0%} of {spec.drafted_tokens}, {spec.tokens_per_step:.2f} tokens/step"


class TtftChart(Static):
    BORDER_TITLE = "TTFT per turn vs prompt tokens"

    def show(self, series: dict[str, list[TurnEvent]], names: dict[str, str]) -> None:
        self.update(render_chart(series, names))
