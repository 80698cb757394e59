"""Timing primitives shared by the speed harness (memrad.bench.speed): one loaded arm's
prefill, decode and resumed-suffix times, the floor of a resumed turn, operator shares.

Every measurement runs the serving code (memrad.engine.forward on in-place KV slabs, the
canonical grid), so a number here is what a request pays minus HTTP and sampling.

    prefill on the grid:  [0 ........ 512 ........ 2048 .................. 4096]
                           time to each mark = the cold prefill of that many tokens
    resume:               crop to 4096, prime the suffix after it (one resumed turn's TTFT)
    decode:               crop to C, feed `steps` tokens one at a time, crop back
"""

from __future__ import annotations

import resource
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from memrad.engine.decode.steps.llama import attention_shape
from memrad.engine.engine import Engine, EngineOptions
from memrad.engine.forward import cache_length, crop_to, decode_one_token, prefill
from memrad.engine.model.loader import LoadedModel
from memrad.engine.state.snapshot import ParkedState, Snapshot, is_croppable


def median_s(fn: Callable[[], object], reps: int) -> float:
    """Median wall time of `reps` calls of `fn`."""
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def peak_rss_bytes() -> int:
    """This process's peak resident set size (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def current_rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


def model_bytes(loaded: LoadedModel) -> int:
    """Bytes of the model's parameters and buffers (float weights + packed codes)."""
    model = loaded.model
    seen: dict[int, int] = {}
    for t in (*model.parameters(), *model.buffers()):
        seen[t.data_ptr()] = t.nbytes
    return sum(seen.values())


DECODES = ("compiled", "eager", "transformers")


class Arm:
    """One loaded configuration (weights x dtype x decode step) and its warm cache of `ids`.

    `decode`: the step compiled (compile = on, built here), eager (compile = off), or
    transformers' own forward (the engine before the step: the baseline)."""

    def __init__(self, name: str, loaded: LoadedModel, chunk: int, threads: int, decode: str = "eager") -> None:
        assert decode in DECODES, decode
        self.name, self.loaded = name, loaded
        self.engine = Engine(loaded, EngineOptions(chunk, threads, compile={"compiled": "on"}.get(decode, "off")))
        self.engine.init_worker_thread()  # fixes torch's intra-op threads before compiling
        self.engine.decoder.start()
        self.compile_s = self.engine.decoder.compile_s
        self.feed = (self.engine.decoder.feeder() if decode != "transformers"
                     else lambda cache, token, position: decode_one_token(loaded.model, cache, token, position))
        self.chunk = chunk
        self._snapshots: dict[int, Snapshot] = {}  # where a cache that cannot be cropped rewinds to

    def prefill_marks(self, ids: Sequence[int], marks: Sequence[int], keep: Sequence[int] = ()
                      ) -> tuple[object, dict[int, float]]:
        """Prime `ids` cold on the grid; seconds from the start to each position in `marks`
        (each a multiple of the chunk). Returns the cache and {mark: seconds}. A cache that
        cannot be cropped (sliding-window, recurrent state) is snapshotted at the end and at
        the positions in `keep`, the ones it is rewound to later (`_rewind`), as the engine
        snapshots boundaries."""
        cache = self.engine.new_cache()
        wanted, kept = set(marks), {*keep, len(ids)}
        snapshot = not is_croppable(cache)
        self._snapshots = {}
        seen: dict[int, float] = {}
        started = time.perf_counter()

        def after_chunk(end: int) -> None:
            if end in wanted:
                seen[end] = time.perf_counter() - started
            if snapshot and end in kept:
                self._snapshots[end] = Snapshot.take(cache, end)

        prefill(self.loaded.model, cache, ids, 0, self.chunk, after_chunk=after_chunk,
                anchors=tuple(sorted(kept)) if snapshot else ())
        return cache, seen

    def _rewind(self, cache: Any, at: int) -> None:
        """`cache` back at `at` tokens: cropped, or rebuilt from the snapshot taken there."""
        if is_croppable(cache):
            crop_to(cache, at)
            return
        if cache_length(cache) == at and at in self._snapshots:
            return
        if at not in self._snapshots:
            raise SystemExit(f"{type(self.loaded.model).__name__}'s cache cannot be cut back: measure at a "
                             f"--prefill length or the end (here {sorted(self._snapshots)}), not {at}")
        parked = ParkedState(self._snapshots[at], dict(self._snapshots), croppable=False)
        cache.layers = parked.rebuild(self.loaded.model.config, at).layers

    def resume_s(self, cache: object, ids: Sequence[int], at: int) -> float:
        """Seconds to prime ids[at:] after a cache rewound to `at` (a resumed turn's prefill)."""
        self._rewind(cache, at)
        started = time.perf_counter()
        prefill(self.loaded.model, cache, ids[at:], at, self.chunk)
        return time.perf_counter() - started

    def decode_rate(self, cache: object, at: int, steps: int) -> float:
        """Tokens per second of `steps` one-token decode steps after a cache rewound to `at`."""
        self._rewind(cache, at)
        started = time.perf_counter()
        for i in range(steps):
            self.feed(cache, 5, at + i)
        rate = steps / (time.perf_counter() - started)
        self._rewind(cache, at)
        return rate


class Turn:
    """The floor of a resumed turn: a cache holding `context` tokens, and the suffix primed
    after them as one chunk run (what a resumed turn pays besides HTTP)."""

    def __init__(self, engine: Engine, ids: list[int], context: int) -> None:
        self.model, self.chunk, self.ids, self.context = engine.loaded.model, engine.prefill_chunk, ids, context
        self.cache = engine.new_cache()
        if context:
            prefill(self.model, self.cache, ids[:context], 0, self.chunk)

    def run(self) -> float:
        crop_to(self.cache, self.context)
        began = time.perf_counter()
        prefill(self.model, self.cache, self.ids[self.context:], self.context, self.chunk, on_grid=False)
        return time.perf_counter() - began

    def attention_share(self) -> float:
        """Fraction of one forward's operator time spent in scaled-dot-product attention."""
        return operator_share(self.run, "scaled_dot_product")


def operator_share(fn: Callable[[], object], name_contains: str) -> float:
    """Run `fn` once under the profiler; the fraction of its operators' self CPU time spent in
    operators whose name contains `name_contains`. CPU time only: on a GPU it measures launches."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    return sum(e.self_cpu_time_total for e in events if name_contains in e.key) / total if total else 0.0


def memory_bandwidth_bytes_s(num_bytes: int = 256 * 2**20, reps: int = 5) -> float:
    """Measured read+write bandwidth of a large copy (the floor decode is held to)."""
    src = torch.ones(num_bytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    return 2 * num_bytes / median_s(lambda: dst.copy_(src), reps)


def decode_bytes_per_token(loaded: LoadedModel) -> int:
    """Weight bytes one decode step reads: packed codes where a layer has them, else the float
    weight (the embedding row gather is left out)."""
    from memrad.engine.model.block_linear import BlockLinear
    from memrad.engine.model.quant import Int4Linear, Int8Linear

    total = 0
    for module in loaded.model.modules():
        if isinstance(module, (Int4Linear, Int8Linear, BlockLinear)):
            total += sum(b.nbytes for b in module.buffers())
        elif isinstance(module, torch.nn.Linear):
            total += module.weight.nbytes
    return total


def kv_bytes_per_token(loaded: LoadedModel) -> int:
    """Bytes of K and V one position holds over all layers, in the rows' dtype
    (memrad.engine.model.kv_dtype): what attention reads per row."""
    from memrad.engine.model import kv_dtype

    config = loaded.model.config
    _, kv_heads, head_dim = attention_shape(config)
    return 2 * config.num_hidden_layers * kv_heads * head_dim * kv_dtype.of(loaded.model).itemsize
