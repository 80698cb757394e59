"""KV layout A/B: transformers' torch.cat layers vs in-place slabs, grouped SDPA off vs on.

    python -m memrad.bench.kv_layout --context 3072 --suffix 231

One process, the default model; per arm: cold prefill of --context tokens on the grid, a
resumed suffix of --suffix tokens primed after them (the affinity case), and decode at that
context. Medians of --reps. TRANSFORMERS_SDPA_FORCE_GQA is read by transformers per call,
so the arms can toggle it in process.
"""

from __future__ import annotations

import argparse
import os
import random

from memrad.bench.engine_speed import median_s
from memrad.engine.engine import Engine
from memrad.engine.forward import crop_to, decode_one_token, prefill
from memrad.engine.loader import load_model, resolve_threads


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--context", type=int, default=3072)
    parser.add_argument("--suffix", type=int, default=231)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--current-only", action="store_true",
                        help="only the serving configuration (slabs, grouped SDPA): the bare cost of a resume")
    args = parser.parse_args(argv)
    loaded = load_model(args.model)
    engine = Engine(loaded, args.chunk, resolve_threads(0))
    engine.init_worker_thread()
    rng = random.Random(0)
    ids = [rng.randrange(3, engine.vocab_size) for _ in range(args.context + args.suffix)]
    n = args.context
    print(f"model={loaded.model_id} device={loaded.device.type} dtype={loaded.dtype_name} chunk={args.chunk} "
          f"reps={args.reps} (median)\n")
    print(f"| KV layers | grouped SDPA | cold prefill {n} tok/s | resume {args.suffix} after {n} s "
          f"| decode at {n} tok/s |")
    print("| --- | --- | ---: | ---: | ---: |")
    arms = [(True, "1")] if args.current_only else [(False, "0"), (False, "1"), (True, "0"), (True, "1")]
    for in_place, grouped in arms:
        os.environ["TRANSFORMERS_SDPA_FORCE_GQA"] = grouped
        cold = median_s(lambda: prefill(loaded.model, engine.new_cache(in_place), ids[:n], 0, args.chunk),
                        args.reps)
        cache = engine.new_cache(in_place)
        prefill(loaded.model, cache, ids[:n], 0, args.chunk)

        def resume() -> None:
            crop_to(cache, n)
            prefill(loaded.model, cache, ids[n:], n, args.chunk, on_grid=False)

        resumed = median_s(resume, args.reps)
        crop_to(cache, n)

        def steps() -> None:
            for i in range(args.decode_steps):
                decode_one_token(loaded.model, cache, 5, n + i)

        decode = median_s(steps, 1)
        print(f"| {'in-place slabs' if in_place else 'torch.cat (transformers)'} | "
              f"{'on' if grouped == '1' else 'off'} | {n / cold:.0f} | {resumed:.3f} | "
              f"{args.decode_steps / decode:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
