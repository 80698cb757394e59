"""Eager decode step against its compiled form, bit for bit: `memrad bench step-bits`.

    memrad bench step-bits [--model default] [--steps 100] [--emulate-precision-casts]

What it runs and why: memrad.engine.decode.bits. Prints how many logit rows are
bit-identical, how many argmaxes agree and the largest difference.
"""

from __future__ import annotations

import argparse


def main(argv: list[str]) -> int:
    from memrad.engine.decode.bits import compare

    parser = argparse.ArgumentParser(prog="memrad bench step-bits", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--steps", type=int, default=100, help="decode positions compared")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--emulate-precision-casts", action="store_true",
                        help="inductor rounds where eager rounds between fused low-precision ops")
    args = parser.parse_args(argv)
    bits = compare(args.model, args.steps, args.threads, args.emulate_precision_casts)
    print(f"model={bits.model} dtype={bits.dtype} weights={bits.weights} kernel={bits.kernel} "
          f"threads={args.threads} emulate_precision_casts={args.emulate_precision_casts}")
    print(f"{bits.steps} positions: logit rows bit-identical {bits.identical_rows}/{bits.steps}, argmax equal "
          f"{bits.equal_argmax}/{bits.steps}, max |eager - compiled| {bits.max_abs_diff:.4g}; "
          f"{bits.eager_ms:.1f} vs {bits.compiled_ms:.1f} ms a step")
    return 0
