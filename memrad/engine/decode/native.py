"""The decode steps under the native rope, beside the served (scaled) ones.

A model served past its native length runs each request under one rope (memrad.engine.model.rope).
The llama-shaped step reads its rope only through its cos/sin tables [P, D] (YaRN's attention
factor folded in), so the native step is a twin: the same modules and weights, other tables
and its own `owner`. Its compiled form is the served step's package opened a second time with
the twin's tensors (the package holds no weights or tables: a start hands them by reference,
memrad.engine.decode.package), so nothing is built twice and the package's key is unchanged.

    served request   step (eager / package)        batched: BatchStep over step
    native request   twin (eager / package again)  batched: BatchStep over twin, a batch of its own

The batched step gathers one table for all its rows, so rows of the two ropes never share a
batch: the engine groups flights by their step (one BatchStep per rope), and an iteration
with both decodes two batches. A twin's `alone` (whether a lone request may run the one-row
step) is its served step's: the check compares matmul rows at M = 1 and M = B, which the
tables' values do not change. Every native feed runs inside `under("native")`, so where the
step falls back to transformers' forward (a cache that is not slabs) that reads the native
rope too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from memrad.engine.decode import package as step_package
from memrad.engine.decode.batch import BatchGraph, BatchStep
from memrad.engine.decode.steps.llama import DecodeStep, rope_tables
from memrad.engine.model.rope import NATIVE, RopeSwitch


def switch_of(model: Any) -> RopeSwitch | None:
    """The model's RopeSwitch (memrad.engine.model.rope.install), or None: one rope."""
    rotary = getattr(getattr(model, "model", None), "rotary_emb", None)
    return rotary if isinstance(rotary, RopeSwitch) else None


def retabled(step: DecodeStep, model: Any, switch: RopeSwitch, max_positions: int) -> DecodeStep:
    """A DecodeStep over `step`'s modules (shared, not copied) with the native rope's tables."""
    twin = DecodeStep.__new__(DecodeStep)
    nn.Module.__init__(twin)
    twin.owner = f"{step.owner}-native"
    twin.embed, twin.norm, twin.head, twin.layers = step.embed, step.norm, step.head, step.layers
    with switch.under(NATIVE):
        cos, sin = rope_tables(model, max_positions)  # [P, D]
    twin.register_buffer("cos", cos, persistent=False)
    twin.register_buffer("sin", sin, persistent=False)
    return twin


class NativeSteps:
    """The native twins of one Decoder's steps, made on first use and kept (engine thread)."""

    def __init__(self, switch: RopeSwitch, model: Any, eager: DecodeStep, max_positions: int, capacity: int) -> None:
        self.switch, self.capacity = switch, capacity
        self.eager = retabled(eager, model, switch, max_positions)
        self._packages: dict[Path, step_package.PackagedStep] = {}
        self._batch_packages: dict[Path, step_package.PackagedBatch] = {}
        # id(the served BatchStep) -> (that step, its twin): the step is held so that its id is
        # never reused by another one's (a verify step found inexact is dropped)
        self._batches: dict[int, tuple[BatchStep, BatchStep]] = {}

    def one_row(self, step: Any, kernel: bool, path: Path) -> Any:
        """The native twin of a one-row step: the twin for the eager step, the package at
        `path` opened over the twin for a packaged one; torch.compile's fallback (traced for the
        served step's owner) is not retraced: native requests decode eager there."""
        if isinstance(step, step_package.PackagedStep):
            if path not in self._packages:
                self._packages[path] = step_package.load(self.eager, self.capacity, kernel, path)
            return self._packages[path]
        return self.eager

    def batch(self, batched: BatchStep, path_for: Any, alone: Any) -> BatchStep:
        """The native twin of a served BatchStep (and of its smaller twins); `path_for(rows)`: its
        package's path; `alone`: the native one-row feed, used where the served step's is."""
        key = id(batched)
        if key not in self._batches or self._batches[key][0] is not batched:
            graph: Any = BatchGraph(self.eager, batched.kernel)
            if batched.compiled:
                path = path_for(batched.rows)
                if path not in self._batch_packages:
                    self._batch_packages[path] = step_package.load_batch(self.eager, self.capacity, batched.rows, path)
                graph = self._batch_packages[path]
            twin = BatchStep(graph, batched.rows, batched.kernel, batched.scratch,
                             BatchGraph(self.eager, batched.kernel), batched.compiled)
            twin.alone = alone if batched.alone is not None else None
            twin.smaller = [self.batch(smaller, path_for, None) for smaller in batched.smaller]
            self._batches[key] = (batched, twin)
        return self._batches[key][1]


def under_native(switch: RopeSwitch, run: Any) -> Any:
    """`run` (cache, token id, position) -> logits, called with the native rope in force."""

    @torch.inference_mode()
    def feed(cache: Any, token_id: int, position: int) -> torch.Tensor:
        with switch.under(NATIVE):
            return run(cache, token_id, position)

    return feed
