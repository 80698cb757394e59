"""How many intra-op threads each phase of the engine runs on. Pure policy: no torch here.

A thread team sized to every core waits, at every barrier of every parallel region, for the
thread the kernel descheduled: with one busy process beside it a 2-thread step runs 4-5x slower
than its quiet time, slower than one thread would (docs/BENCHMARKS.md, Shared machine). So
each phase (prefill, one-row decode, batched decode) keeps its own count, within a ceiling
of what the process may run at all, and moves it by one on what its steps say:

    ceiling   the CPUs in the affinity mask, lowered to the cgroup quota (cpu.max) rounded
              up, at least 1; a fixed model.threads replaces it and nothing adapts
    shrink    every step at the current count took >= SLOW_RATIO x its quiet time (the
              fastest step per unit of work at that count in the last QUIET_WINDOW_S) for
              SLOW_FOR_S and at least SLOW_STEPS steps: the machine got busy
    probe     every probe interval (PROBE_FIRST_S after a change, doubling up to PROBE_MAX_S
              while probes confirm the count) PROBE_STEPS steps run at the count one above
              (when below the ceiling) or one below (at the ceiling: a machine busy since
              the start has no quiet time to compare with); the probe count wins when its
              steps take < BETTER x the current count's recent steps
    after idle  a phase that ran no step for IDLE_S forgets its recent steps (the machine
              may have changed meanwhile: an agent's build started) and probes once
              PROBE_STEPS steps at its count are in, not at the backed-off interval (a reply
              after a busy idle stretch had run whole at the slow count: its quiet time had
              left the window and the next probe was up to PROBE_MAX_S away)

                 quiet       busy      (2 cores, one busy process beside)
    2 threads    1.0         4.5
    1 thread     1.8         1.9       -> 2 is right when quiet, 1 when busy

A phase adapts only where its steps give the same bits at any count, so a change never
changes what a request computes, only how fast: the one-row and batched decode steps, eager
and compiled, and prefill where its dense products run in fixed spans (memrad.engine.model
.products; tests/integration/test_threads_default_model.py). Where they cannot (no compiler
for the sliced product, a hybrid model), oneDNN's bf16 GEMMs reduce in another order at
another count, and in exact mode a resumed prefill must be a cold one's bits, so there
prefill keeps the count it started with (`steady`).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Literal

from memrad.protocol import ThreadsEvent

Phase = Literal["prefill", "decode", "batch"]
PHASES: tuple[Phase, ...] = ("prefill", "decode", "batch")

SLOW_RATIO = 2.5
SLOW_FOR_S = 3.0
SLOW_STEPS = 2
QUIET_WINDOW_S = 30.0
PROBE_FIRST_S = 5.0
PROBE_MAX_S = 120.0
PROBE_STEPS = 2
BETTER = 0.85
RECENT_STEPS = 8  # the current count's steps a probe is compared with
IDLE_S = 5.0  # a phase with no step for this long probes again soon


@dataclass(frozen=True, slots=True)
class Ceiling:
    """The most threads the process may run on, and why."""

    cpus: int
    reason: str


def parse_cpu_max(text: str) -> float | None:
    """CPUs a cgroup v2 `cpu.max` ("150000 100000", "max 100000") allows; None: no quota."""
    parts = text.split()
    if len(parts) != 2 or parts[0] == "max":
        return None
    quota_us, period_us = int(parts[0]), int(parts[1])
    return quota_us / period_us if period_us > 0 else None


def ceiling_of(affinity_cpus: int, quota_cpus: float | None) -> Ceiling:
    """What a process with `affinity_cpus` in its mask and a cgroup quota of `quota_cpus`
    (None: none) may run: the quota rounded up, at least 1. The quota throttles per period
    (100 ms), not per barrier: under 1.5 CPUs a team of 2 ran 1.5 CPUs' work, prefill 885 and
    decode 43.8 tok/s, where 1 thread ran 705 and 34.9 (docs/BENCHMARKS.md, Shared machine);
    the probe still finds a smaller team where the steps say so."""
    cpus, reason = affinity_cpus, f"{affinity_cpus} CPUs in the affinity mask"
    if quota_cpus is not None and math.ceil(quota_cpus) < cpus:
        cpus, reason = max(1, math.ceil(quota_cpus)), f"the cgroup quota allows {quota_cpus:g} CPUs"
    return Ceiling(max(1, cpus), reason)


@dataclass
class _Probe:
    count: int
    seconds_per_work: list[float] = field(default_factory=list)


@dataclass
class _PhaseTeam:
    count: int
    reason: str
    # per count: [second, fastest s per unit of work in it] over the last QUIET_WINDOW_S, and
    # the last RECENT_STEPS steps' s per unit of work
    fastest: dict[int, deque] = field(default_factory=dict)
    recent: dict[int, deque] = field(default_factory=dict)
    slow_since_s: float | None = None
    slow_steps: int = 0
    slow_ratios: list[float] = field(default_factory=list)
    probe: _Probe | None = None
    probe_gap_s: float = PROBE_FIRST_S
    next_probe_s: float = PROBE_FIRST_S
    probe_up: bool = True
    last_step_s: float | None = None
    probe_soon: bool = False  # back from idle: probe once PROBE_STEPS steps at the count are in


class TeamPolicy:
    """Per phase: the count its next step runs at (`threads_for`), and what its step times
    change (`observe`: a ThreadsEvent stamped with the policy's clock, every phase's count
    in its summary). Mutates only itself; the caller applies the counts
    (memrad.engine.threads.Team)."""

    def __init__(self, ceiling: Ceiling, fixed: int | None = None, now_s: float = 0.0,
                 steady: dict[Phase, str] | None = None) -> None:
        """`fixed`: one count for every phase, never moved (model.threads); `steady`: phases
        that keep the starting count, each with why."""
        self.ceiling = ceiling
        self.fixed = fixed
        self.steady = dict(steady or {})
        start, why = (fixed, "set by model.threads") if fixed else (ceiling.cpus, ceiling.reason)
        self._teams = {phase: _PhaseTeam(start, self.steady.get(phase, why), next_probe_s=now_s + PROBE_FIRST_S)
                       for phase in PHASES}

    def count(self, phase: Phase) -> int:
        return self._teams[phase].count

    def reason(self, phase: Phase) -> str:
        return self._teams[phase].reason

    def threads_for(self, phase: Phase, now_s: float) -> int:
        """The count the next step of `phase` runs at: its count, or a probe's."""
        team = self._teams[phase]
        if self.fixed or phase in self.steady or self.ceiling.cpus == 1:
            return team.count
        if team.last_step_s is not None and now_s - team.last_step_s >= IDLE_S:
            team.recent.clear()
            team.probe, team.probe_soon, team.last_step_s = None, True, None
        # back from idle: once steps at the count are in to compare with (the interval's may be past)
        due = (len(team.recent.get(team.count, ())) >= PROBE_STEPS if team.probe_soon
               else now_s >= team.next_probe_s)
        if team.probe is None and due:
            up_ok, down_ok = team.count < self.ceiling.cpus, team.count > 1
            up = up_ok and (team.probe_up or not down_ok)
            team.probe_up = not up  # alternate where both directions are open
            team.probe = _Probe(team.count + 1 if up else team.count - 1)
        return team.probe.count if team.probe is not None else team.count

    def observe(self, phase: Phase, threads: int, work: int, seconds: float, now_s: float) -> ThreadsEvent | None:
        """A step of `phase` ran `work` units (tokens, rows) in `seconds` at `threads`."""
        team = self._teams[phase]
        per = seconds / max(1, work)
        if self.fixed or phase in self.steady:
            return None
        team.last_step_s = now_s
        probe = team.probe
        if probe is not None and threads == probe.count:
            _record(team, threads, per, now_s)
            probe.seconds_per_work.append(per)
            return self._probed(phase, team, probe, now_s) if len(probe.seconds_per_work) >= PROBE_STEPS else None
        if threads != team.count:
            return None
        quiet = _quiet(team, threads, now_s)
        _record(team, threads, per, now_s)
        if quiet is None or per < SLOW_RATIO * quiet:
            team.slow_since_s, team.slow_steps, team.slow_ratios = None, 0, []
            return None
        if team.slow_since_s is None:
            team.slow_since_s = now_s - seconds
        team.slow_steps += 1
        team.slow_ratios.append(per / quiet)
        slow_for_s = now_s - team.slow_since_s
        if team.count > 1 and slow_for_s >= SLOW_FOR_S and team.slow_steps >= SLOW_STEPS:
            ratio = statistics.median(team.slow_ratios)
            return self._change(phase, team, team.count - 1,
                                f"steps {ratio:.1f}x their quiet time for {slow_for_s:.0f} s", now_s)
        return None

    def set_ceiling(self, ceiling: Ceiling, now_s: float) -> list[ThreadsEvent]:
        """The affinity mask or the quota changed: every count above it comes down to it."""
        self.ceiling = ceiling
        if self.fixed:
            return []
        return [self._change(phase, team, ceiling.cpus, ceiling.reason, now_s)
                for phase, team in self._teams.items() if team.count > ceiling.cpus and phase not in self.steady]

    def _probed(self, phase: Phase, team: _PhaseTeam, probe: _Probe, now_s: float) -> ThreadsEvent | None:
        team.probe, team.probe_soon = None, False
        recent = team.recent.get(team.count)
        if recent:
            ratio = statistics.median(probe.seconds_per_work) / statistics.median(recent)
            if ratio < BETTER:
                return self._change(phase, team, probe.count,
                                    f"a probe at {probe.count} ran {ratio:.2f}x the time of the steps at "
                                    f"{team.count}", now_s)
        team.probe_gap_s = min(PROBE_MAX_S, 2 * team.probe_gap_s)
        team.next_probe_s = now_s + team.probe_gap_s
        return None

    def _change(self, phase: Phase, team: _PhaseTeam, after: int, reason: str, now_s: float) -> ThreadsEvent:
        before = team.count
        team.count, team.reason = after, f"{before} → {after}: {reason}"
        change = ThreadsEvent(now_s, phase, before, after, reason,
                              ", ".join(f"{p} {t.count}" for p, t in self._teams.items()))
        team.slow_since_s, team.slow_steps, team.slow_ratios, team.probe = None, 0, [], None
        team.probe_soon = False
        team.probe_gap_s = PROBE_FIRST_S
        team.next_probe_s = now_s + PROBE_FIRST_S
        return change


def _record(team: _PhaseTeam, count: int, per: float, now_s: float) -> None:
    second = math.floor(now_s)
    fastest = team.fastest.setdefault(count, deque())
    if fastest and fastest[-1][0] == second:
        fastest[-1][1] = min(fastest[-1][1], per)
    else:
        fastest.append([second, per])
    while fastest[0][0] < now_s - QUIET_WINDOW_S:
        fastest.popleft()
    team.recent.setdefault(count, deque(maxlen=RECENT_STEPS)).append(per)


def _quiet(team: _PhaseTeam, count: int, now_s: float) -> float | None:
    """The count's quiet time: its fastest step per unit of work in the last QUIET_WINDOW_S."""
    times = [per for second, per in team.fastest.get(count, ()) if second >= now_s - QUIET_WINDOW_S]
    return min(times) if times else None
