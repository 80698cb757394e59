"""Raw engine speed: prefill tok/s by prompt length and chunk size, decode tok/s, per dtype.

    python -m memrad.bench.engine_speed --dtypes float32 bfloat16 --lengths 512 2048 --chunks 64 256 512

Each cell is the median of --reps runs, all in one process, so the ratios are comparable.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from memrad.engine.engine import Engine
from memrad.engine.forward import decode_one_token, prefill
from memrad.engine.loader import load_model, resolve_threads


def median_s(fn, reps: int) -> float:
    """Median wall time of `reps` calls of `fn`."""
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--lengths", nargs="+", type=int, default=[512, 2048])
    parser.add_argument("--chunks", nargs="+", type=int, default=[64, 256, 512])
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args(argv)

    threads = resolve_threads(args.threads)
    rng = random.Random(0)
    print(f"model={args.model} threads={threads} reps={args.reps} (median)")
    print("| dtype | prompt tokens | chunk | prefill tok/s |")
    print("| --- | ---: | ---: | ---: |")
    decode_rows = []
    for dtype in args.dtypes:
        loaded = load_model(args.model, args.device, dtype)
        engine = Engine(loaded, args.chunks[0], threads)
        engine.init_worker_thread()
        vocab = engine.vocab_size
        for n in args.lengths:
            ids = [rng.randrange(3, vocab) for _ in range(n)]
            for chunk in args.chunks:
                seconds = median_s(lambda: prefill(loaded.model, engine.new_cache(), ids, 0, chunk), args.reps)
                print(f"| {loaded.dtype_name} | {n} | {chunk} | {n / seconds:.0f} |", flush=True)
        ids = [rng.randrange(3, vocab) for _ in range(max(args.lengths))]
        cache = engine.new_cache()
        prefill(loaded.model, cache, ids, 0, args.chunks[-1])

        def steps() -> None:
            for _ in range(args.decode_steps):
                decode_one_token(loaded.model, cache, 5, len(ids) + steps.done)
                steps.done += 1
        steps.done = 0
        seconds = median_s(steps, 1)
        decode_rows.append(f"| {loaded.dtype_name} | {len(ids)} | {args.decode_steps / seconds:.1f} |")
    print("\n| dtype | context tokens | decode tok/s |")
    print("| --- | ---: | ---: |")
    print("\n".join(decode_rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
