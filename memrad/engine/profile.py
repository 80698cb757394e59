"""Where a forward's CPU time goes, from torch's profiler (for the benchmark harnesses)."""

from __future__ import annotations

from collections.abc import Callable

import torch


def operator_share(fn: Callable[[], object], name_contains: str) -> float:
    """Run `fn` once under the profiler; the fraction of its operators' self CPU time spent in
    operators whose name contains `name_contains`. CPU time only: on a GPU it measures launches."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    return sum(e.self_cpu_time_total for e in events if name_contains in e.key) / total if total else 0.0
