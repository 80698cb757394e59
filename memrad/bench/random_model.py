"""Build a model folder shaped like another, with random weights (for timing without weights).

    python -m memrad.bench.random_model --like default --shape-only --out .device/smollm2   # here
    python -m memrad.bench.random_model --like .device/smollm2 --out /tmp/smollm2-random  # there

`--like` takes `default` (the cached default model) or a folder holding at least a
config.json and the tokenizer files. `--shape-only` copies just those (a few MB, small enough
to carry to a machine that cannot fetch the weights). See memrad/engine/random_model.py.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from memrad.engine.loader import resolve_model_folder
from memrad.engine.random_model import copy_shape, write_random_model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--like", default="default", help="`default` or a model folder")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shape-only", action="store_true", help="copy config and tokenizer only")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    _, source = resolve_model_folder(args.like, print)
    if args.shape_only:
        print(f"copied {', '.join(copy_shape(source, args.out))} from {source} to {args.out}")
    else:
        write_random_model(source, args.out, args.seed)
        print(f"wrote {args.out}: the shape of {source}, random weights (seed {args.seed})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
