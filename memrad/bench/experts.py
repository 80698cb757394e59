"""A mixture's experts for one token, dense against their shipped blocks: `memrad bench experts`.

    memrad bench experts [--dtype bfloat16] [--reps 64] [--threads 1] [--shape tiny wide q3-tiny q3-30b]

gpt-oss's MXFP4 experts (tiny, wide), Qwen3-MoE's Q4_K gate / up and Q6_K down (q3-tiny, q3-30b).

What it runs and why: memrad.engine.decode.expert_speed (one random layer's sparse block). Prints
one row per shape: ms a token dense and on the blocks, their ratio, and the bytes a token reads
of the experts each way.
"""

from __future__ import annotations

from memrad.bench.arch_steps import tiny_arguments


def main(argv: list[str]) -> int:
    from memrad.engine.decode.expert_speed import SHAPES, measure

    args = tiny_arguments(argv, "memrad bench experts", __doc__, ("--reps", "tokens timed per arm"),
                          ("--shape", tuple(SHAPES)))
    print(f"dtype={args.dtype} threads={args.threads} reps={args.reps} (median ms a token, one layer)")
    print(f"{'shape':7} {'hidden x width, top k of E':>27} {'dense ms':>9} {'blocks ms':>9} {'ratio':>6}  "
          "experts' bytes a token: dense, as shipped")
    for shape in args.shape:
        speed = measure(shape, args.dtype, args.reps, args.threads)
        s = SHAPES[shape]
        print(f"{shape:7} {f'{s.hidden} x {s.width}, {s.top_k} of {s.experts}':>27} {speed.dense_ms:9.3f} {speed.blocks_ms:9.3f} "
              f"{speed.ratio:5.1f}x  {speed.dense_bytes:,}, {speed.shipped_bytes:,}")
    return 0
