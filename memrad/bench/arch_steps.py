"""The decode step against transformers' forward per architecture: `memrad bench arch-steps`.

    memrad bench arch-steps [--dtype bfloat16] [--steps 64] [--threads 1] [--arch qwen3 ...]

What it runs and why: memrad.engine.decode.step_speed (tiny random configs, one thread).
Prints one row per architecture: the step that decodes it, ms a token on the step and on
transformers' forward, their ratio, and for a mixture of experts the feed-forward KiB a token
reads (router and top-k experts) against every expert's.
"""

from __future__ import annotations

import argparse


def main(argv: list[str]) -> int:
    from memrad.engine.decode.step_speed import SHAPES, measure

    parser = argparse.ArgumentParser(prog="memrad bench arch-steps", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--steps", type=int, default=64, help="decode steps timed per architecture")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--arch", nargs="*", choices=tuple(SHAPES), default=list(SHAPES))
    args = parser.parse_args(argv)
    print(f"dtype={args.dtype} threads={args.threads} steps={args.steps} (median ms a token after a 40-token prompt)")
    print(f"{'arch':10} {'step':10} {'step ms':>8} {'forward ms':>10} {'ratio':>6}  ffn KiB/token (every expert)")
    for arch in args.arch:
        speed = measure(arch, args.dtype, args.steps, args.threads)
        ffn = (f"  {speed.ffn_bytes[0] / 1024:,.0f} ({speed.ffn_bytes[1] / 1024:,.0f})" if speed.ffn_bytes else "")
        print(f"{speed.arch:10} {speed.step:10} {speed.step_ms:8.2f} {speed.forward_ms:10.2f} {speed.ratio:5.1f}x{ffn}")
    return 0
