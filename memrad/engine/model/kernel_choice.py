"""Which kernel runs each kind of a GGUF's blocks for one token: memra's block kernel or torch's int4.

memra's block kernel (memrad.engine.kernels.block_gemv) reads Q8_0 / Q5_0 / Q4_0 / Q4_1 blocks and
Q4_K / Q5_K / Q6_K super-blocks as shipped; torch's int4 kernel runs the 4-bit ones directly
(Q4_K as unpacked int4 blocks) and the 8- and 5-bit ones as two 4-bit passes (hi|lo); Q5_K and
Q6_K have no int4 form, so their other kernel is the dense weight (torch's F.linear in the
model's dtype). Which is faster depends on the CPU:

    kernel ISA   head (Q8_0)                       layers (Q4_0/Q4_1)       layers (Q5_0, Q8_0)   layers (Q4_K, Q5_K, Q6_K)
    AVX512       block kernel (int16 activations,  block kernel, 16 rows    int4: measured once   measured here, per group
                 16 rows interleaved)              interleaved: measured    (docs/BENCHMARKS.md#memras-block-kernel)
                                                   once (memrad bench rows)
    AVX2         measured here, per group: interleaved, row-major blocks    measured here         measured here, per group
                 or torch int4 (hi|lo)             or torch int4

On AVX512 the Q4_0 / Q4_1 layers whose rows come in sixteens run the kernel's interleaved Q4_1
blocks, and a head in sixteens its interleaved Q8_0 blocks (memrad.engine.model.block_linear.interleave):
measured with `memrad bench rows` on SmolLM2-135M's layers, out of cache, on an Intel Xeon with
AMX (one row 0.77-0.95x torch int4's time) and on an AMD EPYC Zen 5 without AMX (one row
0.69-0.90x torch int4's over two runs, the head 0.23-0.31x its plain blocks'), and at every row count to 4 on both.

On AVX2 (int16 activations, integer multiply-adds as on AVX512) each group (the head; the layers of one
GGUF type; those of them whose rows are not in sixteens apart, `packable_groups`) is timed on this machine at one activation row in the model's dtype: one layer of
each distinct shape (the head: its first HEAD_ROWS rows) on each kernel (memra's row-major
blocks, its interleaved ones where the group's blocks are Q4_x / Q8_0 / Q5_0 in sixteens (Q5_0's as
Q8_0 x16: the same weights, 34 bytes a block where 22 are shipped, with no bits to unpack), torch's int4
or the dense weight), the kernels' calls interleaved (so a burst of other work falls on all),
the fastest of REPS calls each (the least disturbed), weighted by how many layers have that
shape. The group runs where the sum is lowest (a tie: interleaved, then row-major blocks). A verdict is kept in the kernel cache beside
the libraries, named by the kernel build, the group's shapes, dtype and thread count, so later
starts read it and never re-measure (a verdict never flips between starts of one build).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from memrad.durable import publish
from memrad.engine.kernels import block_gemv
from memrad.engine.model import block_linear
from memrad.engine.model.block_linear import BlockLinear
from memrad.engine.model.quant import Int4Blocks, Int4Linear, Int8Blocks, Q8Linear, SuperBlocks, unpack_q4_k

log = logging.getLogger("memrad.engine")

HEAD_ROWS = 32768  # the head is timed on this many of its rows: its cost per row, without packing it all
REPS = 25
CACHE_NAME = "block-choices.json"
MEASURED_ON = ("AVX2",)  # kernel ISAs whose choice is measured here; AVX512's was measured once, offline
# (the k-quants' super-blocks are measured here on every ISA: no offline measurement covers them)

Blocks = Int4Blocks | Int8Blocks | SuperBlocks
Timer = Callable[..., tuple[float, ...]]  # (call, call[, call]) -> seconds a call of each


@dataclass(frozen=True, slots=True)
class Verdict:
    """One group's kernel: `blocks` True for memra's block kernel, `interleaved` for its blocks laid
    out 16 rows side by side (block_linear.interleave); `reason` as `memrad status` says it."""

    group: str  # "head Q8_0", "layers Q4_1"
    blocks: bool
    reason: str
    interleaved: bool = False


def group_of(name: str, kind: str, head_name: str | None) -> str:
    return f"head {kind}" if name == head_name else f"layers {kind}"


def _other_name(blocks: Blocks, dtype: torch.dtype) -> str:
    """The kernel the blocks run on where memra's does not: torch's int4 (hi|lo), or the dense weight."""
    if isinstance(blocks, SuperBlocks) and blocks.kind != "Q4_K":
        return f"dense {str(dtype).removeprefix('torch.')}"
    return "torch int4 hi|lo" if isinstance(blocks, Int8Blocks) else "torch int4"


def _other(blocks: Blocks, linear: torch.nn.Linear, dtype: torch.dtype) -> torch.nn.Module:
    """The other kernel's layer for `blocks` on `linear` (of the model's dtype)."""
    kernel_dtype = torch.float16 if dtype == torch.float16 else torch.bfloat16
    if isinstance(blocks, SuperBlocks):
        if blocks.kind != "Q4_K":
            return linear
        return Int4Linear.from_blocks(linear, unpack_q4_k(blocks.raw.numpy()), kernel_dtype)
    return (Q8Linear if isinstance(blocks, Int8Blocks) else Int4Linear).from_blocks(linear, blocks, kernel_dtype)


def decide(group: str, block_s: float, int4_s: float, path: str, int4_name: str, x16_s: float | None = None) -> Verdict:
    """The verdict for measured times (seconds a token for the group on each kernel; `int4_s` and
    `int4_name`: the other kernel's, torch's int4 or the dense weight; `x16_s`: memra's interleaved
    blocks', where they were measured). The fastest wins; a tie goes to memra's kernel, interleaved."""
    if x16_s is not None and x16_s <= min(block_s, int4_s):
        widened = " as Q8_0 (34 B a block, 22 shipped)" if group.endswith("Q5_0") else ""
        return Verdict(group, True, f"memra block kernel, {path}, 16 rows interleaved{widened}, {int4_s / x16_s:.1f}x "
                                    f"{int4_name}, {block_s / x16_s:.1f}x row-major blocks (measured at load, one row)",
                       interleaved=True)
    versus = "" if x16_s is None else f", {x16_s / block_s:.1f}x interleaved"
    if block_s <= int4_s:
        return Verdict(group, True, f"memra block kernel, {path}, {int4_s / block_s:.1f}x {int4_name}{versus} "
                                    "(measured at load, one row)")
    fastest = block_s if x16_s is None else min(block_s, x16_s)
    return Verdict(group, False, f"{int4_name}, {fastest / int4_s:.1f}x memra block kernel ({path}; "
                                 "measured at load, one row)")


def choose(groups: dict[str, dict[str, Blocks]], modules: dict[str, torch.nn.Module], dtype: torch.dtype,
           cache: Path | None = None, timer: Timer | None = None) -> dict[str, Verdict]:
    """{group: Verdict} for {group: {module name: blocks}} (every group's blocks `packable`).
    Requires `block_gemv.why_not() is None`. On a kernel ISA not in MEASURED_ON: the head and the
    Q4_x layers in sixteens (`interleaved_4_bit`) on memra's kernel, the Q8_0 / Q5_0 layers on
    torch's int4, as measured offline; the
    k-quants' super-blocks are measured here on every ISA. `cache`: the verdicts file
    (default: beside the kernel libraries); `timer`: seconds a call of each call it is given (tests)."""
    isa, path = block_gemv.capability(), block_gemv.path()
    cache = cache or block_gemv.library().parent / CACHE_NAME
    kept = _read(cache)
    out: dict[str, Verdict] = {}
    for group, members in groups.items():
        first = next(iter(members.values()))
        if isa not in MEASURED_ON and not isinstance(first, SuperBlocks):
            on_blocks = group.startswith("head") or interleaved_4_bit(members)
            interleaved = on_blocks and _in_sixteens(members)
            out[group] = Verdict(group, on_blocks, _measured_once(path, interleaved) if on_blocks else "", interleaved)
            continue
        shapes = Counter((tuple(b.shape), type(b).__name__) for b in members.values())
        key = f"{block_gemv.library().name} {group} {sorted(shapes.items())} {dtype} threads {torch.get_num_threads()}"
        int4_name = _other_name(first, dtype)
        if int4_name.startswith("torch int4") and any(b.shape[0] % 16 for b in members.values()):
            out[group] = Verdict(group, True, f"memra block kernel, {path} (the int4 kernel packs rows in sixteens)")
            continue
        sixteens = _in_sixteens(members, widen=True)
        if key not in kept or (sixteens and "x16_s" not in kept[key]):  # (kept before Q5_0 had its x16 arm)
            kept[key] = _measure(members, modules, dtype, timer or _fastest, sixteens)
            _write(cache, kept)
        out[group] = decide(group, kept[key]["block_s"], kept[key]["int4_s"], path, int4_name, kept[key].get("x16_s"))
        log.info("%s: %s", group, out[group].reason)
    return out


def interleaved_4_bit(members: dict[str, Blocks]) -> bool:
    """Whether a group runs as the kernel's interleaved Q4_1 blocks: 4-bit blocks (Q4_0, Q4_1), every
    layer's rows in sixteens, on a kernel build that interleaves (AVX512, AVX2)."""
    return all(isinstance(b, Int4Blocks) for b in members.values()) and _in_sixteens(members)


def _in_sixteens(members: dict[str, Blocks], widen: bool = False) -> bool:
    """Whether BlockLinear.from_blocks can lay every member out interleaved: Q4_x / Q8_0 blocks (and,
    where `widen`, Q5_0's as Q8_0: timed where verdicts are measured, never taken on the offline
    ones), its rows in sixteens, on a kernel build that interleaves (AVX512, AVX2)."""
    def kind(b: Blocks) -> bool:
        return block_linear.interleaved_kind(b) is not None if widen else block_linear.kind_of(b) in block_linear.INTERLEAVED
    return block_gemv.interleaves() and all(b.shape[0] % 16 == 0 and kind(b) for b in members.values())


def _measured_once(path: str, interleaved: bool) -> str:
    """The reason of a group put on memra's kernel by the offline measurement."""
    layout = ", 16 rows interleaved" if interleaved else ""
    return f"memra block kernel, {path}{layout}; measured once: docs/BENCHMARKS.md#memras-block-kernel"


def _measure(members: dict[str, Blocks], modules: dict[str, torch.nn.Module], dtype: torch.dtype,
             timer: Timer, interleaved: bool) -> dict[str, float]:
    """Seconds a token for the group on each kernel, one layer per shape times its count: `block_s`
    memra's row-major blocks, `int4_s` the other kernel, `x16_s` memra's interleaved blocks
    (where `interleaved`)."""
    by_shape: dict[tuple, list[str]] = {}
    for name, blocks in members.items():
        by_shape.setdefault(tuple(blocks.shape), []).append(name)
    total = {"block_s": 0.0, "int4_s": 0.0, **({"x16_s": 0.0} if interleaved else {})}
    for shape, names in by_shape.items():
        blocks, scale = members[names[0]], len(names)
        if shape[0] > HEAD_ROWS:  # time the first rows, scale by the rest
            scale *= shape[0] / HEAD_ROWS
            blocks = _rows(blocks, HEAD_ROWS)
        n, k = blocks.shape
        linear = torch.nn.Linear(k, n, bias=False, dtype=dtype)
        arms = [BlockLinear.from_blocks(linear, blocks), _other(blocks, linear, dtype)]
        if interleaved:
            arms.append(BlockLinear.from_blocks(linear, blocks, interleaved=True))
        x = torch.randn(1, 1, k, dtype=dtype)  # [1, 1, K]: one token
        with torch.no_grad():
            seconds = timer(*[lambda arm=arm: arm(x) for arm in arms])
        for name, arm_s in zip(total, seconds):
            total[name] += scale * arm_s
    return total


def _rows(blocks: Blocks, rows: int) -> Blocks:
    if isinstance(blocks, SuperBlocks):
        return SuperBlocks(blocks.kind, blocks.raw[:rows].contiguous())
    if isinstance(blocks, Int8Blocks):
        return Int8Blocks(blocks.codes[:rows].contiguous(), blocks.scales[:rows].contiguous())
    mins = None if blocks.mins is None else blocks.mins[:rows].contiguous()
    return Int4Blocks(blocks.codes[:rows].contiguous(), blocks.scales[:rows].contiguous(), mins)


def _fastest(*calls: Callable[[], object]) -> tuple[float, ...]:
    """The fastest of REPS calls of each, their calls interleaved."""
    for _ in range(3):
        for fn in calls:
            fn()
    best = [float("inf")] * len(calls)
    for _ in range(REPS):
        for i, fn in enumerate(calls):
            started = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - started)
    return tuple(best)


def _read(cache: Path) -> dict:
    try:
        return json.loads(cache.read_text())
    except (OSError, ValueError):
        return {}


def _write(cache: Path, kept: dict) -> None:
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        staging = cache.with_name(f"{cache.name}.{os.getpid()}.partial")
        staging.write_text(json.dumps(kept, indent=1, sort_keys=True))
        publish(staging, cache)
    except OSError as exc:  # a read-only cache: the next start measures again
        log.warning("could not keep the block kernel's verdicts in %s: %s", cache, exc)


def packable_groups(named: dict[str, Blocks], kinds: dict[str, str], head_name: str | None,
                    fits: Callable[[str, Blocks], bool]) -> dict[str, dict[str, Blocks]]:
    """{group: {module name: blocks}} of the blocks memra's kernel can run as shipped. Layers whose
    rows are not in sixteens are a group of their own: torch's int4 packer cannot take them, and
    in one group with the rest they would keep every layer of their type off the measurement
    (Gemma 4's per-layer input gate: as many rows as the per-layer input width, 8 in the tiny model)."""
    out: dict[str, dict[str, Blocks]] = {}
    for name, blocks in named.items():
        if fits(name, blocks) and block_linear.packable(blocks):
            kind = kinds.get(name) or block_linear.FORMATS[block_linear.kind_of(blocks)]
            apart = ", rows not in sixteens" if blocks.shape[0] % 16 else ""
            out.setdefault(group_of(name, kind, head_name) + apart, {})[name] = blocks
    return out
