"""TTFT against prompt tokens, one line per arm, as a PNG (needs the `bench` extra: matplotlib)."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def series_from_rows(rows: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """Per arm: (prompt tokens, median TTFT over reps) per turn, in turn order."""
    out: dict[str, list[tuple[int, float]]] = {}
    for arm in sorted({r["arm"] for r in rows}):
        turns = sorted({r["turn"] for r in rows if r["arm"] == arm})
        out[arm] = [(next(r["prompt_tokens"] for r in rows if r["arm"] == arm and r["turn"] == t),
                     statistics.median(r["ttft_s"] for r in rows if r["arm"] == arm and r["turn"] == t))
                    for t in turns]
    return out


def plot_ttft(rows: list[dict], path: Path, title: str) -> bool:
    """Write the plot; False (and a hint on stderr) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no plot: install the bench extra (python3 -m pip install -e '.[bench]')", file=sys.stderr)
        return False
    labels = {"on": "affinity on", "off": "affinity off (MEMRA_AFFINITY=0)"}
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    for arm, points in series_from_rows(rows).items():
        xs, ys = zip(*points)
        ax.plot(xs, ys, marker="o", markersize=3, label=labels.get(arm, arm))
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("TTFT (s), median over reps")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    """python -m memrad.bench.plot DIR: redraw DIR/ttft.png from DIR/rows.jsonl."""
    folder = Path((argv or sys.argv[1:])[0])
    rows = [json.loads(line) for line in (folder / "rows.jsonl").read_text().splitlines() if line.strip()]
    return 0 if plot_ttft(rows, folder / "ttft.png", f"TTFT per turn: {folder.name}") else 1


if __name__ == "__main__":
    raise SystemExit(main())
