"""The CPU decode-attention kernel: built once per machine, then loaded as `memra::decode_attention`.

torch's CPU attention for one query token parallelises over (batch, KV head) and tiles for
prefill: with 3 KV heads on 2 threads one thread idles and a long cache is read far below the
memory's bandwidth (most of a decode step at 4k). csrc/decode_attention.cpp scores the
query heads of each KV head together and spreads fixed row chunks over the threads, which
reads the cache several times faster (measured: docs/BENCHMARKS.md, Decode: the attention
kernel). It is built as every kernel is (memrad.engine.kernels.build); the decode steps
(memrad.engine.decode.steps.llama) call it by name, and the batched step
(memrad.engine.decode.batch) calls `decode_attention_rows` once a layer for all its rows: a call
cost ~17 µs of dispatch and thread wake-up against ~3 µs of arithmetic at short contexts, which
made an 8-row verify step pay 8 calls a layer (docs/BENCHMARKS.md, Speculation). `load()` never raises: without a compiler,
or when the build fails, it says why and the decode step keeps torch's attention.
"""

from __future__ import annotations

import threading

import torch

from memrad.engine.kernels.build import CSRC, library_path, load_library, unavailable

SOURCE = CSRC / "decode_attention.cpp"
OP_NAME = "memra::decode_attention"
ROWS_OP_NAME = "memra::decode_attention_rows"  # B rows, each over its own keys, in one call

_lock = threading.Lock()
_loaded = False  # the library is loaded into this process


def built(compiler: str) -> bool:
    """Whether an earlier build left this machine's library in the cache."""
    return library_path(compiler, SOURCE).exists()


def load(compiler: str | None, build_missing: bool = True) -> str | None:
    """Make `torch.ops.memra.decode_attention` callable; None if it is, else why not.
    `build_missing=False` only loads a library an earlier build left in the cache."""
    global _loaded
    why_not = unavailable(compiler, SOURCE, "the attention kernel", build_missing)
    if why_not is not None:
        return why_not
    with _lock:
        if _loaded:
            return None
        why_not = load_library(compiler, SOURCE)
        if why_not is None:
            torch.library.register_fake(OP_NAME)(_shape_of_output)
            torch.library.register_fake(ROWS_OP_NAME)(_shape_of_rows_output)
            _loaded = True
        return why_not


def _shape_of_output(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.empty_like(q)  # [1, H_kv, G, D]: what torch.compile traces the op as


def _shape_of_rows_output(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], lengths: list,
                          scale: float) -> torch.Tensor:
    return torch.empty_like(q)  # [B, H_kv, G, D]
