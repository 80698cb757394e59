"""`memrad bench weights`: per tensor group of a GGUF model, each candidate weight format's
single-token speed and its error against the float weights (memrad.engine.model.format_costs).

    memrad bench weights --model gemma3-270m [--threads 2] [--reps 50]

Never run in CI: numbers go to docs/BENCHMARKS.md with the command and the CPU.
"""

from __future__ import annotations

import argparse


def main(argv: list[str] | None = None) -> int:
    from memrad.engine.model.format_costs import CANDIDATES, MAX_ERROR, measure

    parser = argparse.ArgumentParser(prog="memrad bench weights", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--reps", type=int, default=50)
    args = parser.parse_args(argv)
    print(f"{args.model}: {args.threads} thread(s), {'CPU' if args.threads == 1 else 'wall'} ms per call, "
          f"error budget {MAX_ERROR:.2e}")
    print(f"{'group':<34} {'type':<5} {'N x K':>13}  " + "  ".join(f"{c:>21}" for c in CANDIDATES) + "  pick")
    for cost in measure(args.model, args.threads, args.reps):
        row = "  ".join(f"{cost.cells[c][0]:>7.3f} ms {cost.cells[c][1]:.1e}" if c in cost.cells else f"{'-':>21}"
                        for c in CANDIDATES)
        print(f"{cost.role.removeprefix('model.layers.*.'):<34} {cost.kind:<5} {cost.shape[0]:>6} x "
              f"{cost.shape[1]:<5} {row}  {cost.pick}", flush=True)
    return 0
