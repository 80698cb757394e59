"""`memrad bench spill-ttft`: what an eviction's spill to the disk tier costs the requests
around it, with the write on the engine thread (`--sync`, the old way) and on the disk
tier's writer thread (the default), alternating arms in one process.

A pool of one session: request B's park evicts A, whose state is spilled; C is sent the
moment B's generate returns, as the scheduler does. Reported per run: B's TTFT, B's last
token -> its generate returning (the time the engine thread spends on the eviction), C's
TTFT, and B's last token -> C's first token.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from memrad.engine.engine import Engine, EngineOptions
from memrad.engine.model.loader import load_model, resolve_threads
from memrad.engine.state.disk import DiskTier, state_format
from memrad.request import GenerationRequest, SamplingParams
from memrad.reuse.pool import ReusePool

CHUNK = 64


def _request(engine: Engine, rid: str, salt: str, lines: int) -> GenerationRequest:
    body = " ".join(f"file_{i}.py holds helper {i} for parsing and checking input." for i in range(lines))
    text, ids = engine.chat.render([{"role": "user", "content": f"{salt}: {body}"}], None)
    return GenerationRequest(rid, engine.model_id, tuple(ids), text, SamplingParams(temperature=0.0, max_tokens=8),
                             cache_salt=salt)


def run(loaded, threads: int, sync: bool, rep: int, lines: int = 45) -> tuple[float, float, float, float, int]:
    disk = DiskTier(Path(tempfile.mkdtemp(prefix="memra-spill-ttft-")), 2**33, state_format(loaded, CHUNK, "exact"),
                    loaded.rope_keys)
    if sync:  # the write inside the evicting request, on the engine thread
        disk.spill_later = lambda s, evicted, done: done(s, disk.spill(s, evicted))
    engine = Engine(loaded, EngineOptions(CHUNK, threads, "exact"), ReusePool(1, 2**33), disk)
    engine.generate(_request(engine, "a", f"a{rep}", lines), lambda _: None, lambda: False)
    last, first = [0.0], [None]

    def on_b(_: str) -> None:
        last[0] = time.perf_counter()

    def on_c(_: str) -> None:
        first[0] = first[0] or time.perf_counter()

    b = engine.generate(_request(engine, "b", f"b{rep}", lines), on_b, lambda: False)  # evicts A at its end
    b_done = time.perf_counter()
    c = engine.generate(_request(engine, "c", f"c{rep}", lines), on_c, lambda: False)
    engine.parking.disk.drain()
    return b.ttft_s, b_done - last[0], c.ttft_s, first[0] - last[0], b.prompt_tokens


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="memrad bench spill-ttft", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--dtype", default="float32", choices=("auto", "float32", "bfloat16"))
    args = parser.parse_args(argv)
    loaded = load_model(args.model, "auto", args.dtype)
    threads = resolve_threads(args.threads)
    rows: dict[bool, list] = {True: [], False: []}
    print("arm | B TTFT s | B last token -> done s | C TTFT s | B last token -> C first token s | prompt tokens")
    for rep in range(args.reps):
        for sync in (True, False):
            row = run(loaded, threads, sync, rep)
            rows[sync].append(row)
            print(f"{'engine thread' if sync else 'writer thread'} | " + " | ".join(f"{x:.3f}" for x in row[:4])
                  + f" | {row[4]}", flush=True)
    for sync, found in rows.items():
        medians = [statistics.median(r[i] for r in found) for i in range(4)]
        print(f"median, {'engine thread' if sync else 'writer thread'}: " + " | ".join(f"{m:.3f}" for m in medians))
    return 0
