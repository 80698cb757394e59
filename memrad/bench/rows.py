"""What a row past the first costs in the multi-row decode step: `memrad bench rows`.

    memrad bench rows [--model default] [--rows 1 2 4 8] [--reps 15] [--threads 2] [--no-step]

What it runs and why: memrad.engine.decode.row_speed (the batched step and one layer of each
shape at M = 1..8 per kernel; torch stays inside the engine).
"""

from __future__ import annotations


def main(argv: list[str]) -> int:
    from memrad.engine.decode.row_speed import main as measure

    return measure(argv)
