"""`memrad bench contended`: prefill and decode with busy processes beside memrad.

    memrad bench contended [--busy 0 1] [--prompt 512] [--decode-s 12] [--peer LLAMA_BENCH --gguf GGUF]
                           [--busy-command 'python3 -m pytest -q tests/unit/test_rope.py']

Per load (0, 1, ... busy loops `python -c 'while 1: pass'`, or --busy-command run again and
again, started by this harness, so run it under freezebench: what it starts is its own), in one process on the model as served
(auto dtype and weights, the compiled one-row step): two engines, threads fixed at all cores
and adaptive (memrad.engine.team), each a cold prefill of --prompt tokens (tok/s: the prompt
over the time to the first token) and then greedy decode for --decode-s seconds (tok/s over
the last half of the tokens: the adaptive count needs a few seconds to move), and the thread
counts each ended at with why. llama-bench (-p, and -n 32 at a depth of --prompt tokens, where
memrad's decode runs) at its default threads and at 1 runs in the same load when given. Never run in CI: numbers go to docs/BENCHMARKS.md with the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from memrad.engine.engine import Engine, EngineOptions
from memrad.engine.model.loader import load_model, resolve_threads
from memrad.request import GenerationRequest, SamplingParams


def busy(count: int, command: str | None = None) -> list[subprocess.Popen]:
    """`count` busy processes: busy loops, or `command` run again and again (a real load: a test
    run, a build), each in its own process group; each ends when this process does, however it
    ends (a bench killed by a timeout left its loops spinning at the bench's priority)."""
    me = os.getpid()
    argv = (["sh", "-c", f"while kill -0 {me} 2>/dev/null; do {command}; done"] if command else
            [sys.executable, "-c", f"import os\nwhile os.getppid() == {me}: pass"])
    return [subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
            for _ in range(count)]


def stop(loops: list[subprocess.Popen]) -> None:
    for loop in loops:
        os.killpg(loop.pid, signal.SIGKILL)
        loop.wait()


def run_arm(engine: Engine, prompt: tuple[int, ...], decode_s: float) -> dict:
    times: list[float] = []
    started = time.perf_counter()
    never_eos = tuple((eos, -1e4) for eos in engine.loaded.eos_ids)  # decode for decode_s, whatever it says
    request = GenerationRequest(f"bench-{time.monotonic_ns()}", engine.model_id, prompt, "",
                                SamplingParams(temperature=0.0, max_tokens=2048, logit_bias=never_eos))
    engine.init_worker_thread()  # each arm from its own count (the arms share this thread)
    flight = engine.admit(request, lambda _: times.append(time.perf_counter()), lambda: bool(times) and
                          times[-1] - times[0] > decode_s)
    while flight.completion is None and flight.error is None:
        engine.step()
    if flight.error is not None:
        raise flight.error
    ttft_s = flight.completion.ttft_s
    half = times[len(times) // 2 :]
    decode = (len(half) - 1) / (half[-1] - half[0]) if len(half) > 1 else None
    return {"prefill_tok_s": len(prompt) / ttft_s, "decode_tok_s": decode, "tokens": len(times),
            "threads": engine.runtime_choices["threads"]}


def peer(llama_bench: Path, gguf: Path, prompt: int, threads: int | None) -> dict:
    """llama-bench's cold prefill of `prompt` tokens (depth 0) and its decode after `prompt`
    tokens of context (`-d`: memrad's decode runs there too)."""
    cmd = [str(llama_bench), "-m", str(gguf), "-p", str(prompt), "-n", "32", "-d", f"0,{prompt}", "-r", "2",
           "-o", "json"]
    if threads is not None:
        cmd += ["-t", str(threads)]
    rows = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
    out = {"threads": rows[0].get("n_threads")}
    for row in rows:
        if row.get("n_prompt") and not row.get("n_depth"):
            out["prefill_tok_s"] = row["avg_ts"]
        elif row.get("n_gen") and row.get("n_depth"):
            out["decode_tok_s"] = row["avg_ts"]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="memrad bench contended", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--busy", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--decode-s", type=float, default=12.0)
    parser.add_argument("--peer", type=Path, help="llama.cpp's llama-bench")
    parser.add_argument("--gguf", type=Path)
    parser.add_argument("--busy-command", help="a shell command each busy process runs again and again, in place "
                                               "of the busy loop (a real load: a test run)")
    args = parser.parse_args(argv)
    threads = resolve_threads(0)
    loaded = load_model(args.model, device="cpu", progress=lambda _: None)
    arms = {name: Engine(loaded, EngineOptions(256, threads, compile="auto", adapt_threads=adapt))
            for name, adapt in (("fixed", False), ("adaptive", True))}
    for engine in arms.values():
        engine.init_worker_thread()
        engine.start_background()
        engine.decoder.wait()
    prompt = tuple(range(1000, 1000 + args.prompt))
    results = []
    for count in args.busy:
        loops = busy(count, args.busy_command)
        try:
            time.sleep(1.0)
            for name, engine in arms.items():
                run_arm(engine, prompt[:64], 1.0)  # warm
                row = {"busy": count, "arm": name, **run_arm(engine, prompt, args.decode_s)}
                results.append(row)
                print(json.dumps(row), flush=True)
            if args.peer is not None:
                for t in (None, 1):
                    row = {"busy": count, "arm": f"llama.cpp -t {t or 'default'}",
                           **peer(args.peer, args.gguf, args.prompt, t)}
                    results.append(row)
                    print(json.dumps(row), flush=True)
        finally:
            stop(loops)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
