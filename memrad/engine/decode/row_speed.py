"""What a row past the first costs in the multi-row decode step: `memrad bench rows` (memrad.bench.rows).

    memrad bench rows [--model default] [--rows 1 2 4 8] [--reps 15] [--threads 2] [--dtype bfloat16] [--no-step]

Arms of one loaded model, timed interleaved in one process (a burst of other work falls
on all), the fastest of --reps calls each:

  * `int4`: the 4-bit layers on torch's int4 kernel, the Q8_0 head on its plain blocks (main's
    choice on AVX512 before the interleaved kinds);
  * `blocks`: every 4-bit layer on memra's block kernel instead (BlockLinear from the same
    shipped blocks, one output row's blocks after another): forced for this measurement only;
  * `blocks x16`: the same on the kernel's interleaved kinds (16 rows' blocks side by side,
    block_linear.interleave), where the kernel runs them (AVX512, AVX2).

--dtype float32 is what an AVX2-only CPU runs (no native bf16); run it under
`ATEN_CPU_CAPABILITY=avx2` to time torch's and memra's AVX2 paths on an AVX-512 machine.

For each arm: the eager batched step (memrad.engine.decode.batch) at each --rows, its time
split by kernel (the layers' projections, the head, the rest) from forward hooks; then one
layer of each of the step's shapes alone at M = 1..8, the weights out of cache (a model's
worth of copies cycled so that none sits in L2; the Q8_0 head, plain and interleaved, streams
from memory by its size). Prints Markdown tables with each row count's
time over one row's.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch


def _fastest(calls: list[Callable[[], object]], reps: int) -> list[float]:
    """The fastest of `reps` runs of each call, the calls interleaved."""
    best = [float("inf")] * len(calls)
    for call in calls:
        call()
    for _ in range(reps):
        for i, call in enumerate(calls):
            started = time.perf_counter()
            call()
            best[i] = min(best[i], time.perf_counter() - started)
    return best


def _arms(model, folder) -> dict[str, dict]:
    """{arm: {module name: module}} over every 4-bit layer and the Q8_0 head, from the same shipped
    blocks: `int4` torch's int4 kernel for the layers and the head's plain blocks (main's choice
    on AVX512 before the interleaved kinds), `blocks` the plain blocks on memra's kernel, `blocks x16`
    the interleaved ones (block_linear.interleave) where the kernel runs them."""
    from memrad.engine.kernels import block_gemv
    from memrad.engine.model.block_linear import BlockLinear, packable
    from memrad.engine.model.quant import Int4Linear
    from memrad.engine.model.weights import _head_name, load_int4_cache, load_q8_cache

    modules = dict(model.named_modules())
    layers = {name: b for name, b in load_int4_cache(folder).items() if name in modules and packable(b)}
    heads = {name: b for name, b in load_q8_cache(folder).items() if name == _head_name(model)}
    arms = {"int4": {**{name: Int4Linear.from_blocks(modules[name], b, torch.bfloat16) for name, b in layers.items()},
                     **{name: BlockLinear.from_blocks(modules[name], b, False) for name, b in heads.items()}},
            "blocks": {name: BlockLinear.from_blocks(modules[name], b, False) for name, b in {**layers, **heads}.items()}}
    if block_gemv.interleaves():
        arms["blocks x16"] = {name: BlockLinear.from_blocks(modules[name], b, True)
                              for name, b in {**layers, **heads}.items()}
    return arms


def _swap(model, modules: dict) -> None:
    from memrad.engine.model.weights import _set_module

    for name, module in modules.items():
        _set_module(model, name, module)


def _steps(loaded, rows: list[int], reps: int, kernel_names: dict[str, str]) -> dict:
    """{(arm, rows): (step_s, {kernel: s})} for the eager batched step of each arm."""
    from memrad.engine.decode.decoder import Decoder
    from memrad.engine.engine import install_slabs
    from memrad.engine.forward import prefill
    from transformers import DynamicCache

    model = loaded.model
    arms = {}
    for arm, modules in kernel_names["arms"].items():
        _swap(model, modules)
        decoder = Decoder(model, loaded.context_len, loaded.device, "off", batch_rows=max(rows))
        decoder.start()
        kernel = decoder.current[1]
        arms[arm] = {r: decoder._new_batch_step(r, kernel, False) for r in rows}
    caches = []
    for i in range(max(rows)):
        cache = install_slabs(DynamicCache(config=model.config), loaded.context_len)
        prefill(model, cache, list(range(5 + i, 5 + i + 300)), 0, 256)
        caches.append(cache)
    spent: dict[str, float] = {}
    timing = {"on": False}

    def hook_pair(kind: str):
        def before(_module, _args):
            if timing["on"]:
                spent.setdefault("_start", time.perf_counter())
                timing["started"] = time.perf_counter()

        def after(_module, _args, _out):
            if timing["on"]:
                spent[kind] = spent.get(kind, 0.0) + time.perf_counter() - timing["started"]
        return before, after

    def call(arm: str, r: int) -> Callable[[], object]:
        step = arms[arm][r]

        def run() -> None:
            step(caches[:r], [11 + i for i in range(r)], [300] * r)
            for cache in caches[:r]:  # back to 300 rows: the next call writes row 300 again
                for layer in cache.layers:
                    layer.crop(-1)
        return run

    out = {}
    with torch.inference_mode():
        order = [(arm, r) for r in rows for arm in arms]
        best = _fastest([call(arm, r) for arm, r in order], reps)
        for (arm, r), seconds in zip(order, best):
            out[(arm, r)] = (seconds, {})
        # the split: hooks on every linear of the arm's step, the fastest of reps per kernel
        for arm, r in order:
            _swap(model, kernel_names["arms"][arm])
            handles = []
            for module in arms[arm][r].eager.modules():
                kind = kernel_names["kind"](module)
                if kind is not None:
                    before, after = hook_pair(kind)
                    handles += [module.register_forward_pre_hook(before), module.register_forward_hook(after)]
            split: dict[str, float] = {}
            for _ in range(reps):
                spent.clear()
                timing["on"] = True
                started = time.perf_counter()
                call(arm, r)()
                total = time.perf_counter() - started
                timing["on"] = False
                spent.pop("_start", None)
                spent["rest"] = total - sum(spent.values())
                if not split or total < split["_total"]:
                    split = {**spent, "_total": total}
            for handle in handles:
                handle.remove()
            split.pop("_total")
            out[(arm, r)] = (out[(arm, r)][0], split)
    return out


def _layers_alone(loaded, arms: dict[str, dict], reps: int, max_rows: int) -> dict:
    """{(arm, shape, M): seconds} for one layer of each shape at M = 1..max_rows, weights cycled
    over a model's worth of copies (all the layers of that shape in the model)."""
    dtype = next(loaded.model.parameters()).dtype
    out = {}
    by_shape: dict[tuple[int, int], dict[str, list]] = {}
    for arm, modules in arms.items():
        for module in modules.values():
            by_shape.setdefault((module.out_features, module.in_features), {}).setdefault(arm, []).append(module)
    with torch.inference_mode():
        for shape, members in sorted(by_shape.items()):
            for m in range(1, max_rows + 1):
                x = torch.randn(m, 1, shape[1], dtype=dtype)
                turn = {arm: 0 for arm in members}

                def cycled(arm: str) -> Callable[[], object]:
                    def run() -> None:
                        layers = members[arm]
                        turn[arm] = (turn[arm] + 1) % len(layers)
                        layers[turn[arm]](x)
                    return run

                best = _fastest([cycled(arm) for arm in members], reps * 3)
                for arm, seconds in zip(members, best):
                    out[(arm, shape, m)] = seconds
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="memrad bench rows", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 2, 4, 8])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                        help="the activations (float32: an AVX2-only CPU's)")
    parser.add_argument("--no-step", action="store_true", help="the layers alone only")
    parser.add_argument("--no-layers", action="store_true", help="the batched step only")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from memrad.engine.kernels import block_gemv
    from memrad.engine.model.block_linear import BlockLinear
    from memrad.engine.model.loader import load_model, resolve_model_folder
    from memrad.engine.model.quant import Int4Linear

    loaded = load_model(args.model, device="cpu", dtype=args.dtype, weights="int4")
    folder = resolve_model_folder(args.model, print, False)[1]
    arms = _arms(loaded.model, folder)
    as_loaded = {name: module for name, module in loaded.model.named_modules() if name in arms["int4"]}
    head = loaded.model.get_output_embeddings()
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    print(f"# {args.model}: {len(arms['blocks'])} layers and head; block kernel {block_gemv.path()}; "
          f"torch {torch.backends.cpu.get_cpu_capability()}; {args.dtype}; threads {args.threads}; load {' '.join(load)}")

    def kind(module) -> str | None:
        if module is head or getattr(module, "out_features", 0) == head.out_features:
            return "head"
        if isinstance(module, Int4Linear):
            return "layers int4"
        if isinstance(module, BlockLinear):
            return "layers blocks"
        return None

    if not args.no_step:
        steps = _steps(loaded, args.rows, args.reps, {"arms": arms, "kind": kind})
        print("\n| arm | rows | step ms | x one row | layers ms | head ms | rest ms |")
        print("|---|---|---|---|---|---|---|")
        for arm in arms:
            one = steps[(arm, args.rows[0])][0]
            for r in args.rows:
                seconds, split = steps[(arm, r)]
                layers = sum(v for k, v in split.items() if k.startswith("layers"))
                print(f"| {arm} | {r} | {seconds * 1e3:.2f} | {seconds / one:.2f} | {layers * 1e3:.2f} | "
                      f"{split.get('head', 0) * 1e3:.2f} | {split.get('rest', 0) * 1e3:.2f} |")
        _swap(loaded.model, as_loaded)
    if not args.no_layers:
        alone = _layers_alone(loaded, arms, args.reps, max(args.rows))
        shapes = sorted({shape for _, shape, _ in alone})
        print("\n| arm | N x K | " + " | ".join(f"M={m} us" for m in range(1, max(args.rows) + 1))
              + " | M=4 / M=1 | M=8 / M=1 |")
        print("|---|---|" + "---|" * (max(args.rows) + 2))
        for shape in shapes:
            for arm in arms:
                row = [alone[(arm, shape, m)] for m in range(1, max(args.rows) + 1)]
                print(f"| {arm} | {shape[0]} x {shape[1]} | " + " | ".join(f"{s * 1e6:.0f}" for s in row)
                      + f" | {row[3] / row[0]:.2f} | {row[-1] / row[0]:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
