"""`memrad bench speed`: engine speed per weight format x dtype, against llama.cpp if given.

    memrad bench speed                                   # the arms this machine supports
    memrad bench speed --peer LLAMA_BENCH --gguf GGUF    # + llama.cpp on the same GGUF, ratios
    memrad bench speed --floor 514:254 2426:232          # the floor of resumed turns
    memrad bench speed --kv-layout                       # torch.cat vs in-place KV, grouped SDPA
    memrad bench speed --random-like default --out DIR [--shape-only]   # a random-weight model
    memrad bench speed --random-like qwen3-next --out DIR   # a hybrid shape (NAMED_SHAPES), scaled down
    memrad bench speed --startup                         # daemon start: ready and compiled times
    memrad bench speed --arms int4:bfloat16:compiled --prefill 8192 16384 32768 \
        --resume-after 8192 20480 --decode-at 16384 32768 --peer LLAMA_BENCH --gguf GGUF
                                                         # agent-sized contexts (yarn x4 past 8k)
    memrad bench speed --prefill-attention torch ...     # the same with torch's SDPA in prefill
    memrad bench speed --grammar                         # decode with a JSON-schema / tool grammar
    memrad bench speed --spec                            # a file rewrite and a fresh reply, plain vs speculative

Per arm, in one process: cold prefill tok/s at each --prefill length (one grid prefill of the
longest, timed at each mark: its seconds are the cold TTFT minus one step and HTTP), a
resumed --suffix after the longest or each --resume-after prefix (its TTFT minus HTTP),
decode tok/s at each --decode-at context, load time, model bytes and the resident-memory
growth of loading it. Arms run interleaved (order reversed every rep), llama-bench once per
rep between them, so slow spells on a shared machine hit every arm alike; cells are medians.
The decode floor is the bytes one step reads (weights, and the KV rows of its context) over
the measured copy bandwidth.
Never run in CI: numbers go to docs/BENCHMARKS.md with the command and the CPU.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

from memrad.bench.daemons import Daemon
from memrad.engine.model.hardware import native_bf16
from memrad.engine.model.kv_dtype import MODES as KV_DTYPES
from memrad.engine.model.loader import load_model, resolve_model_folder, resolve_threads
from memrad.engine.threads import pin
from memrad.engine.model.random_model import NAMED_SHAPES, copy_shape, write_named_shape, write_random_model
from memrad.engine.timing import (DECODES, Arm, Turn, current_rss_bytes, decode_bytes_per_token, kv_bytes_per_token,
                                 median_s, memory_bandwidth_bytes_s, model_bytes)


def pair(text: str) -> tuple[int, int]:
    context, _, suffix = text.partition(":")
    try:
        parsed = int(context), int(suffix)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected CONTEXT:SUFFIX token counts, got {text!r}") from None
    if parsed[0] < 0 or parsed[1] < 1:
        raise argparse.ArgumentTypeError(f"need CONTEXT >= 0 and SUFFIX >= 1, got {text!r}")
    return parsed


def arm_spec(text: str) -> tuple[str, str, str, str]:
    """WEIGHTS[:DTYPE[:DECODE[:KV]]] -> (weights, dtype, decode, kv); dtype defaults to auto, decode
    to the eager step, kv (model.kv_dtype: the cache rows' dtype) to auto."""
    parts = text.split(":")
    weights, dtype, decode = parts[0], (parts[1:2] or ["auto"])[0], (parts[2:3] or ["eager"])[0]
    kv = (parts[3:4] or ["auto"])[0]
    if len(parts) > 4 or decode not in DECODES or kv not in KV_DTYPES:
        raise SystemExit(f"arm {text}: expected WEIGHTS:DTYPE:DECODE[:KV] with DECODE one of {', '.join(DECODES)} "
                         f"and KV one of {', '.join(KV_DTYPES)}")
    return weights, dtype, decode, kv


def default_arms() -> list[str]:
    """weights:dtype:decode arms: what `auto` picks here with the step compiled and eager (the
    compile A/B), with transformers' forward (the step's A/B), and fp32 float weights through
    transformers' forward (the engine before #13: the baseline every ratio is taken against)."""
    dtype = "bfloat16" if native_bf16().value == "yes" else "float32"
    return [f"int4:{dtype}:compiled", f"int4:{dtype}:eager", f"int4:{dtype}:transformers",
            "float:float32:transformers"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="memrad bench speed", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--threads", type=int, default=0, help="0: all available cores")
    parser.add_argument("--arms", nargs="+",
                        help="WEIGHTS:DTYPE:DECODE, e.g. int4:bfloat16:compiled float:float32:transformers "
                             "(DECODE: compiled, eager or transformers)")
    parser.add_argument("--prefill", nargs="+", type=int, default=[512, 2048, 4096])
    parser.add_argument("--decode-at", nargs="+", type=int, default=[512, 4096])
    parser.add_argument("--suffix", type=int, default=256, help="resumed suffix primed after the longest prefill")
    parser.add_argument("--resume-after", nargs="+", type=int,
                        help="prime the suffix after each of these prefixes (default: the longest prefill)")
    parser.add_argument("--prefill-attention", choices=("auto", "memra", "torch"), default="auto",
                        help="engine.prefill_attention for every arm: auto (memra's kernel where auto takes it), memra (on any of "
                             "its paths) or torch")
    parser.add_argument("--context", type=int, default=0,
                        help="the context served (model.context; 0: the model's default, 32768 for `default`)")
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--peer", type=Path, help="llama.cpp's llama-bench (or llama-server next to it)")
    parser.add_argument("--gguf", type=Path, help="the GGUF llama.cpp runs (the one --model came from)")
    parser.add_argument("--peer-max-depth", type=int, default=None,
                        help="run llama-bench's resume and decode arms only at depths up to this (each depth "
                             "arm prefills its depth untimed first: at 2 threads a 32k depth is ~10 minutes)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a dry run of every step")
    parser.add_argument("--floor", nargs="+", type=pair, metavar="CONTEXT:SUFFIX")
    parser.add_argument("--kv-layout", action="store_true")
    parser.add_argument("--random-like", help="write a random-weight model shaped like this (`default`, a folder, "
                                              f"or a hybrid shape: {', '.join(NAMED_SHAPES)})")
    parser.add_argument("--out", type=Path, help="where --random-like writes")
    parser.add_argument("--shape-only", action="store_true", help="--random-like: config and tokenizer only")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--startup", action="store_true",
                        help="time `memrad start` until /health answers and until decode is compiled")
    parser.add_argument("--grammar", action="store_true",
                        help="decode tok/s with a JSON-schema and a tool-call grammar (each also with the mask "
                             "computed ahead on a worker thread) against unconstrained, at each --decode-at "
                             "(the first --arms arm, default the compiled step of what auto picks)")
    parser.add_argument("--spec", action="store_true",
                        help="a file-rewrite and a fresh reply, decode tok/s plain vs speculative "
                             "(memrad.bench.speculation; --max-tokens, --reps)")
    parser.add_argument("--max-tokens", type=int, default=400, help="--spec: tokens per reply")
    args = parser.parse_args(argv)
    if args.random_like:
        return _random_model(args)
    if args.quick:
        args.prefill, args.decode_at, args.suffix, args.decode_steps, args.reps = [64, 128], [64, 128], 32, 4, 1
        args.chunk, args.resume_after = 64, [64, 128] if args.resume_after else None
    threads = resolve_threads(args.threads)
    if args.startup:
        return _startup(args, threads)
    if args.floor:
        return _floor(args, threads)
    if args.kv_layout:
        return _kv_layout(args, threads)
    if args.grammar:
        return _grammar(args, threads)
    if args.spec:
        return _spec(args, threads)
    return _speed(args, threads)


def _speed(args: argparse.Namespace, threads: int) -> int:
    marks = sorted(args.prefill)
    longest = marks[-1]
    resumes = sorted(args.resume_after or [longest])
    if any(m % args.chunk for m in marks) or any(c > longest for c in [*args.decode_at, *resumes]):
        raise SystemExit("--prefill lengths must be multiples of --chunk and cover every --decode-at and --resume-after")
    arms: list[Arm] = []
    loads: dict[str, tuple[float, int]] = {}
    pin(threads)  # as the daemon does before it loads: what is measured at load runs on the threads served
    for spec in args.arms or default_arms():
        weights, dtype, decode, kv = arm_spec(spec)
        rss, started = current_rss_bytes(), time.perf_counter()
        loaded = load_model(args.model, args.device, dtype, progress=lambda _: None, weights=weights,
                            context=args.context, prefill_attention=args.prefill_attention, kv_dtype=kv)
        loads[spec] = (time.perf_counter() - started, current_rss_bytes() - rss)
        arms.append(Arm(spec, loaded, args.chunk, threads, decode))
    rng = random.Random(0)
    ids = [rng.randrange(3, arms[0].engine.chat.vocab_size) for _ in range(longest + args.suffix)]
    keys = ([f"prefill {m} tok/s" for m in marks] + [f"cold prefill {m} s" for m in marks]
            + [f"resume {args.suffix} after {a} s" for a in resumes]
            + [f"decode at {at} tok/s" for at in sorted(args.decode_at)])
    # Each resume and decode rewinds the one cold cache, which only shrinks: run them from the
    # longest position down.
    rewinds = sorted([(a, "resume") for a in resumes] + [(at, "decode") for at in args.decode_at], reverse=True)
    cells: dict[str, dict[str, list[float]]] = {arm.name: {key: [] for key in keys} for arm in arms}
    peer_cells: dict[str, list[float]] = {}
    for arm in arms:  # warm up: first calls pay allocation and kernel selection
        cache, _ = arm.prefill_marks(ids[:args.chunk], [])
        arm.decode_rate(cache, args.chunk, 2)
    for rep in range(args.reps):
        for arm in arms if rep % 2 == 0 else reversed(arms):
            row = cells[arm.name]
            cache, seen = arm.prefill_marks(ids[:longest], marks, keep=args.decode_at)
            for mark in marks:
                row[f"prefill {mark} tok/s"].append(mark / seen[mark])
                row[f"cold prefill {mark} s"].append(seen[mark])
            for at, kind in rewinds:
                if kind == "resume":
                    row[f"resume {args.suffix} after {at} s"].append(arm.resume_s(cache, ids[:at + args.suffix], at))
                else:
                    row[f"decode at {at} tok/s"].append(arm.decode_rate(cache, at, args.decode_steps))
        if args.peer is not None:
            for key, value in _llama_bench(args, threads, marks, resumes).items():
                peer_cells.setdefault(key, []).append(value)
        print(f"rep {rep + 1}/{args.reps} done", flush=True)
    _report(args, threads, arms, cells, peer_cells, loads)
    return 0


def _grammar(args: argparse.Namespace, threads: int) -> int:
    from memrad.bench import grammar_cost

    spec = (args.arms or [default_arms()[0]])[0]  # the step the daemon decodes with once compiled
    weights, dtype, decode, kv = arm_spec(spec)
    loaded = load_model(args.model, args.device, dtype, progress=lambda _: None, weights=weights,
                        context=args.context, kv_dtype=kv)
    arm = Arm(spec, loaded, args.chunk, threads, decode)
    print(f"model={args.model} arm={spec} context={loaded.context.describe()} threads={threads} cpu={_cpu_name()} "
          f"step={arm.engine.decoder.choice.value} ({arm.engine.decoder.choice.reason})", flush=True)
    grammar_cost.run(arm, args.decode_at, args.decode_steps, args.reps)
    return 0


def _spec(args: argparse.Namespace, threads: int) -> int:
    from memrad.bench import speculation

    weights, dtype, _, kv = arm_spec((args.arms or [default_arms()[0]])[0])
    loaded = load_model(args.model, args.device, dtype, progress=lambda _: None, weights=weights, context=args.context,
                        kv_dtype=kv)
    speculation.run(loaded, threads, args.chunk, args.max_tokens, args.reps, _cpu_name())
    return 0


def _report(args, threads, arms, cells, peer_cells, loads) -> None:
    bandwidth = memory_bandwidth_bytes_s()
    served = arms[0].loaded.context
    print(f"\nmodel={args.model} context={served.num_tokens} ({served.describe()}) threads={threads} "
          f"reps={args.reps} chunk={args.chunk} (medians, interleaved)")
    print(f"cpu={_cpu_name()} bf16: {native_bf16().reason}; copy bandwidth {bandwidth / 1e9:.1f} GB/s")
    print(f"prefill attention: {arms[0].loaded.attention.value} ({arms[0].loaded.attention.reason})")
    for arm in arms:
        print(f"KV cache of {arm.name}: {arm.loaded.kv.value} ({arm.loaded.kv.reason})")
    names = [arm.name for arm in arms]
    base = names[-1]
    header = "| measure | " + " | ".join(names) + (" | llama.cpp |" if peer_cells else " |")
    print("\n" + header + "\n|" + " --- |" * (len(names) + 1 + bool(peer_cells)))
    for key in cells[names[0]]:
        values = [statistics.median(cells[name][key]) for name in names]
        peer = statistics.median(peer_cells[key]) if key in peer_cells else None
        row = [_fmt(v) for v in values] + ([_fmt(peer) if peer is not None else "-"] if peer_cells else [])
        print(f"| {key} | " + " | ".join(row) + " |")
    for name in names:
        seconds, rss = loads[name]
        arm = arms[names.index(name)]
        compiled = f" / compile {arm.compile_s:.1f} s" if arm.compile_s is not None else ""
        print(f"| {name}: load s / model MiB / RSS growth MiB | {seconds:.1f} / "
              f"{model_bytes(arm.loaded) / 2**20:.0f} / {rss / 2**20:.0f}{compiled} |")
    print("\nratios (each arm's median over the baseline arm's, and over llama.cpp's where it ran):")
    for name in names:
        for key in cells[name]:
            ours = statistics.median(cells[name][key])
            parts = [f"{_ratio(ours, statistics.median(cells[base][key]), key):.2f}x {base}"]
            if key in peer_cells:
                parts.append(f"{_ratio(ours, statistics.median(peer_cells[key]), key):.2f}x llama.cpp")
            print(f"  {name:<15} {key:<28} " + ", ".join(parts))
    print("\ndecode floor ((weight bytes + KV bytes of the context) per token / copy bandwidth):")
    for arm in arms:
        weights, kv_row = decode_bytes_per_token(arm.loaded), kv_bytes_per_token(arm.loaded)
        for at in sorted(args.decode_at):
            per_token = weights + at * kv_row
            floor, got = bandwidth / per_token, statistics.median(cells[arm.name][f"decode at {at} tok/s"])
            print(f"  {arm.name:<28} at {at:>5}: {weights / 2**20:.0f} + {at * kv_row / 2**20:.0f} MiB/token "
                  f"-> floor {floor:.0f} tok/s; decode {got:.1f} tok/s = {got / floor:.0%} of the floor")


def _ratio(ours: float, theirs: float, key: str) -> float:
    """Speed ratio >1 = we are faster; for seconds (resume) the inverse."""
    return theirs / ours if key.endswith(" s") else ours / theirs


def _fmt(value: float) -> str:
    return f"{value:.3f}" if value < 10 else f"{value:.1f}" if value < 100 else f"{value:.0f}"


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _llama_bench(args: argparse.Namespace, threads: int, marks: list[int], resumes: list[int]) -> dict[str, float]:
    """One repetition of llama-bench on the same GGUF: prefill at each mark (its seconds: the cold
    TTFT), the suffix prefilled after each resume depth (a resumed turn), decode at depths.
    llama-bench takes no RoPE flags: past the GGUF's 8,192 it rotates unscaled, which costs the
    same arithmetic as YaRN (scaling changes the rotation's frequencies, not its work)."""
    binary = args.peer
    if binary.name == "llama-server":
        binary = binary.with_name("llama-bench")
    if args.gguf is None:
        raise SystemExit("--peer needs --gguf: the GGUF llama.cpp should run (llama-peer.sh prints it)")
    base = [str(binary), "-m", str(args.gguf), "-t", str(threads), "-r", "1", "-o", "json"]
    within = [d for d in resumes if args.peer_max_depth is None or d <= args.peer_max_depth]
    decode_at = [d for d in args.decode_at if args.peer_max_depth is None or d <= args.peer_max_depth]
    runs = [base + ["-p", ",".join(map(str, marks)), "-n", "0"]]
    runs += [base + ["-p", str(args.suffix), "-n", "0", "-d", ",".join(map(str, within))]] if within else []
    runs += [base + ["-p", "0", "-n", str(args.decode_steps), "-d", ",".join(map(str, decode_at))]] if decode_at else []
    out: dict[str, float] = {}
    for cmd in runs:
        done = subprocess.run(cmd, capture_output=True, text=True, check=True)
        for test in json.loads(done.stdout):
            if test["n_gen"] == 0 and test["n_depth"] == 0:
                out[f"prefill {test['n_prompt']} tok/s"] = test["avg_ts"]
                out[f"cold prefill {test['n_prompt']} s"] = test["n_prompt"] / test["avg_ts"]
            elif test["n_gen"] == 0:
                out[f"resume {test['n_prompt']} after {test['n_depth']} s"] = test["n_prompt"] / test["avg_ts"]
            else:
                out[f"decode at {test['n_depth']} tok/s"] = test["avg_ts"]
    return out


def _floor(args: argparse.Namespace, threads: int) -> int:
    """Interleaved floors of resumed turns: the bare forward of S tokens after C cached ones."""
    from memrad.engine.build import engine_for, in_process

    loaded = load_model(args.model, args.device, "auto", progress=lambda _: None)
    engine = engine_for(loaded, in_process(args.chunk, threads=threads), threads)
    engine.init_worker_thread()
    rng = random.Random(0)
    turns = [Turn(engine, [rng.randrange(3, engine.chat.vocab_size) for _ in range(c + s)], c) for c, s in args.floor]
    times: list[list[float]] = [[] for _ in turns]
    for rep in range(args.reps):
        for i in range(len(turns)) if rep % 2 == 0 else reversed(range(len(turns))):
            times[i].append(turns[i].run())
    medians = [statistics.median(t) for t in times]
    print(f"model={loaded.model_id} device={loaded.device.type} dtype={loaded.dtype_name} "
          f"weights={loaded.weights_name} chunk={args.chunk} reps={args.reps} (medians, interleaved)\n")
    print("| context | suffix | forward s | vs first | attention share |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for (context, suffix), turn, median in zip(args.floor, turns, medians):
        share = f"{turn.attention_share():.0%}" if loaded.device.type == "cpu" else "-"
        print(f"| {context} | {suffix} | {median:.3f} | {median / medians[0]:.2f}x | {share} |", flush=True)
    return 0


def _kv_layout(args: argparse.Namespace, threads: int) -> int:
    """torch.cat layers vs in-place slabs, grouped SDPA off vs on: cold prefill, resume, decode."""
    import os

    from memrad.engine.build import engine_for, in_process
    from memrad.engine.forward import crop_to, decode_one_token, prefill

    loaded = load_model(args.model, args.device, "auto", progress=lambda _: None)
    engine = engine_for(loaded, in_process(args.chunk, threads=threads), threads)
    engine.init_worker_thread()
    n, suffix = max(args.prefill), args.suffix
    rng = random.Random(0)
    ids = [rng.randrange(3, engine.chat.vocab_size) for _ in range(n + suffix)]
    print(f"model={loaded.model_id} dtype={loaded.dtype_name} weights={loaded.weights_name} reps={args.reps}\n")
    print(f"| KV layers | grouped SDPA | cold prefill {n} tok/s | resume {suffix} after {n} s | decode at {n} tok/s |")
    print("| --- | --- | ---: | ---: | ---: |")
    for in_place, grouped in [(False, "0"), (False, "1"), (True, "0"), (True, "1")]:
        os.environ["TRANSFORMERS_SDPA_FORCE_GQA"] = grouped  # read by transformers per call
        cold = median_s(lambda: prefill(loaded.model, engine.new_cache(in_place), ids[:n], 0, args.chunk), args.reps)
        cache = engine.new_cache(in_place)
        prefill(loaded.model, cache, ids[:n], 0, args.chunk)

        def resume() -> None:
            crop_to(cache, n)
            prefill(loaded.model, cache, ids[n:], n, args.chunk, on_grid=False)

        resumed = median_s(resume, args.reps)
        crop_to(cache, n)
        decode = median_s(lambda: [decode_one_token(loaded.model, cache, 5, n + i) for i in range(args.decode_steps)], 1)
        print(f"| {'in-place slabs' if in_place else 'torch.cat'} | {'on' if grouped == '1' else 'off'} | "
              f"{n / cold:.0f} | {resumed:.3f} | {args.decode_steps / decode:.1f} |", flush=True)
    return 0


def _random_model(args: argparse.Namespace) -> int:
    if args.out is None:
        raise SystemExit("--random-like needs --out DIR")
    if args.random_like in NAMED_SHAPES:  # the default model's tokenizer and chat template
        _, tokens = resolve_model_folder("default", print)
        write_named_shape(args.random_like, tokens, args.out, args.seed)
        print(f"wrote {args.out}: the {args.random_like} shape (memrad.engine.model.random_model), random weights "
              f"(seed {args.seed}), bfloat16, the tokenizer of {tokens.name}")
        return 0
    _, source = resolve_model_folder(args.random_like, print)
    if args.shape_only:
        print(f"copied {', '.join(copy_shape(source, args.out))} from {source} to {args.out}")
    else:
        write_random_model(source, args.out, args.seed)
        print(f"wrote {args.out}: the shape of {source}, random weights (seed {args.seed}), Q4_1 int4 cache")
    return 0


def _startup(args: argparse.Namespace, threads: int) -> int:
    """Start the daemon four times on one fresh compile cache: compile = auto twice (the first
    start compiles, the second finds the cache), compile = on (compiled before it answers),
    and compile = off (imports and the model load only: the floor of any start); then a first
    start in fast mode on another empty cache (it answers eager while it compiles; exact mode
    waits for the compiled step: docs/ARCHITECTURE.md, "The decode step").
    Prints seconds until /health answers, until the first reply (one chat sent as soon as
    it answers) and until /health reports the decode step compiled."""
    print(f"cpu={_cpu_name()} threads={threads} model={args.model}")
    print("| start | compile | answers s | first reply s | decode compiled s |\n| --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory(prefix="memra-startup-") as tmp:
        for label, mode, cache in (("first (empty compile cache)", "auto", "compile"), ("second", "auto", "compile"),
                                   ("third", "on", "compile"), ("fourth: the floor, no compile", "off", "compile"),
                                   ("first, fast mode (another empty cache)", "auto", "compile-fast")):
            reuse = "fast" if "fast" in label else "exact"
            ready_s, reply_s, compiled_s = _time_start(Path(tmp) / cache, mode, threads, args.model, reuse)
            print(f"| {label} | {mode} | {ready_s:.1f} | {reply_s:.1f} | {_fmt(compiled_s) if compiled_s else '-'} |",
                  flush=True)
    return 0


def _time_start(cache: Path, mode: str, threads: int, model: str, reuse: str) -> tuple[float, float, float | None]:
    """`memrad start` (detached, as a user runs it) in isolated dirs with compile cache `cache`:
    seconds until it returns serving, until a first chat is answered, and until /health
    reports decode compiled."""
    daemon = Daemon.create({"TORCHINDUCTOR_CACHE_DIR": str(cache), "MEMRA_DISK": "0", "MEMRA_REUSE_MODE": reuse})
    started = time.perf_counter()
    try:
        daemon.start("--compile", mode, "--threads", str(threads), "--model", model, settled=False)
        ready_s = time.perf_counter() - started
        body = json.dumps({"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8,
                           "temperature": 0}).encode()
        request = urllib.request.Request(daemon.url + "/v1/chat/completions", body,
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=900) as response:
            response.read()
        reply_s = time.perf_counter() - started
        while daemon.compiling() and time.perf_counter() - started < 900:
            time.sleep(0.1)
        compiled_s = time.perf_counter() - started if daemon.decode()["value"] == "compiled" else None
    finally:
        daemon.stop()
    return ready_s, reply_s, compiled_s
