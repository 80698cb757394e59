"""The floor of a resumed turn: the bare forward of S new tokens after C cached ones.

    python -m memrad.bench.floor 514:254 2426:232 --reps 15

One process, the default model, one warm cache per pair (C random tokens primed once; each
rep rewinds to C and primes the same S tokens as one resumed suffix, as the engine does).
The pairs run interleaved, alternating their order every rep, so slow spells on a shared
machine hit every pair alike. Prints per-pair medians, each pair's ratio to the first, and
the share of one (profiled) forward spent in attention on the CPU, which is what grows with C.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from memrad.engine.engine import Engine
from memrad.engine.forward import crop_to, prefill
from memrad.engine.loader import load_model, resolve_threads
from memrad.engine.profile import operator_share


def pair(text: str) -> tuple[int, int]:
    context, _, suffix = text.partition(":")
    try:
        parsed = int(context), int(suffix)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected CONTEXT:SUFFIX token counts, got {text!r}") from None
    if parsed[0] < 0 or parsed[1] < 1:
        raise argparse.ArgumentTypeError(f"need CONTEXT >= 0 and SUFFIX >= 1, got {text!r}")
    return parsed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pairs", nargs="+", type=pair, metavar="CONTEXT:SUFFIX")
    parser.add_argument("--model", default="default")
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--reps", type=int, default=15)
    args = parser.parse_args(argv)
    loaded = load_model(args.model)
    engine = Engine(loaded, args.chunk, resolve_threads(0))
    engine.init_worker_thread()
    rng = random.Random(0)
    turns = [Turn(engine, [rng.randrange(3, engine.vocab_size) for _ in range(c + s)], c) for c, s in args.pairs]
    times: list[list[float]] = [[] for _ in turns]
    for rep in range(args.reps):
        order = range(len(turns)) if rep % 2 == 0 else reversed(range(len(turns)))
        for i in order:
            times[i].append(turns[i].run())
    medians = [statistics.median(t) for t in times]
    print(f"model={loaded.model_id} device={loaded.device.type} dtype={loaded.dtype_name} chunk={args.chunk} "
          f"reps={args.reps} (medians, interleaved)\n")
    print("| context | suffix | forward s | vs first | attention share |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for (context, suffix), turn, median in zip(args.pairs, turns, medians):
        # The profiler sees CPU operator time only: on a GPU the share would be launch time.
        share = f"{turn.attention_share():.0%}" if loaded.device.type == "cpu" else "-"
        print(f"| {context} | {suffix} | {median:.3f} | {median / medians[0]:.2f}x | {share} |", flush=True)
    return 0


class Turn:
    """A cache holding `context` tokens, and the resumed suffix primed after them."""

    def __init__(self, engine: Engine, ids: list[int], context: int) -> None:
        self.model, self.chunk, self.ids, self.context = engine.loaded.model, engine.prefill_chunk, ids, context
        self.cache = engine.new_cache()
        if context:
            prefill(self.model, self.cache, ids[:context], 0, self.chunk)

    def run(self) -> float:
        crop_to(self.cache, self.context)
        began = time.perf_counter()
        prefill(self.model, self.cache, self.ids[self.context :], self.context, self.chunk, on_grid=False)
        return time.perf_counter() - began

    def attention_share(self) -> float:
        """Fraction of one forward's operator time spent in scaled-dot-product attention."""
        return operator_share(self.run, "scaled_dot_product")

if __name__ == "__main__":
    raise SystemExit(main())
