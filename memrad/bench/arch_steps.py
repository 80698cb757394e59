"""The decode step against transformers' forward per architecture: `memrad bench arch-steps`.

    memrad bench arch-steps [--dtype bfloat16] [--steps 64] [--threads 1] [--arch qwen3 ...]

What it runs and why: memrad.engine.decode.step_speed (tiny random configs, one thread).
Prints one row per architecture: the step that decodes it, ms a token on the step and on
transformers' forward, their ratio, and for a mixture of experts the feed-forward KiB a token
reads (router and top-k experts) against every expert's.
"""

from __future__ import annotations

import argparse


def tiny_arguments(argv: list[str], prog: str, doc: str, timed: tuple[str, str], names: tuple[str, tuple[str, ...]]
                   ) -> argparse.Namespace:
    """The options of a bench over tiny random configs: --dtype, `timed` (flag, help: how many
    tokens are timed, 64 by default), --threads and `names` (flag, choices: which configs; all of them)."""
    parser = argparse.ArgumentParser(prog=prog, description=doc.split("\n\n")[0])
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument(timed[0], type=int, default=64, help=timed[1])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(names[0], nargs="*", choices=names[1], default=list(names[1]))
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    from memrad.engine.decode.step_speed import SHAPES, measure

    args = tiny_arguments(argv, "memrad bench arch-steps", __doc__, ("--steps", "decode steps timed per architecture"),
                          ("--arch", tuple(SHAPES)))
    print(f"dtype={args.dtype} threads={args.threads} steps={args.steps} (median ms a token after a 40-token prompt)")
    print(f"{'arch':10} {'step':10} {'step ms':>8} {'forward ms':>10} {'ratio':>6}  ffn KiB/token (every expert)")
    for arch in args.arch:
        speed = measure(arch, args.dtype, args.steps, args.threads)
        ffn = (f"  {speed.ffn_bytes[0] / 1024:,.0f} ({speed.ffn_bytes[1] / 1024:,.0f})" if speed.ffn_bytes else "")
        print(f"{speed.arch:10} {speed.step:10} {speed.step_ms:8.2f} {speed.forward_ms:10.2f} {speed.ratio:5.1f}x{ffn}")
    return 0
