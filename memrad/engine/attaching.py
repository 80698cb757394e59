"""Forking the live state of a request still on the model (the policy: memrad.reuse.attach).

    holds(B)  B's prompt extends A's; A is prefilling below the cut B forks at (target)
              -> B stays queued (nothing computed twice; a non-croppable A is asked to
                 snapshot target as it passes it)
    admit(B)  A has passed target -> B gets a copy of A's rows :target (A goes on
              untouched) and primes [target, len(B)) on the grid
              A ended first (its client gone: its cancel parked the prefix) -> B is planned
              against the pool as any request, and its reason says it waited

Mutates nothing it is handed but a source flight's wanted snapshots; call on the engine thread.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from memrad.engine.flight import Flight
from memrad.engine.state.snapshot import ParkedState, Snapshot
from memrad.request import GenerationRequest
from memrad.reuse.attach import Attachment, fork_point
from memrad.reuse.planner import Mode

MAX_HOLDS = 64  # held requests remembered (a cancelled one is never admitted, so never taken)


@dataclass(frozen=True, slots=True)
class Hold:
    source: Flight
    attachment: Attachment


class Attacher:
    """Finds the flight a request can fork, holds the request until it can, forks it."""

    def __init__(self, chunk: int, mode: Mode, model_config: Any) -> None:
        self.chunk, self.mode, self.model_config = chunk, mode, model_config
        self._holds: OrderedDict[str, Hold] = OrderedDict()

    def source(self, request: GenerationRequest, anchors: tuple[int, ...],
               flights: list[Flight], rope: str | None = None) -> tuple[Flight, int] | None:
        """The flight whose prompt `request` extends with the highest cut to fork at, now or
        once its prefill gets there, and that cut (pure). Only a flight running under the same
        `rope` (memrad.engine.model.rope): its rows were rotated by it."""
        best = None
        for flight in flights:
            if (flight.phase == "done" or flight.request.cache_salt != request.cache_salt
                    or flight.decided.decision.rope != rope):
                continue
            target = fork_point(request.prompt_ids, anchors, flight.request.prompt_ids, self.chunk)
            if target is not None and self._forkable(flight, target) and (best is None or target > best[1]):
                best = (flight, target)
        return best

    def ready(self, flight: Flight, target: int) -> bool:
        """Whether `flight` holds the state after `target` tokens now."""
        if flight.croppable:
            return flight.pre.primed_to >= target
        return target in flight.pre.snapshots or (flight.phase == "prefill" and flight.pre.primed_to == target)

    def hold(self, request: GenerationRequest, source: Flight, target: int) -> Hold:
        """Remember that `request` waits for `source` to pass `target`."""
        hold = Hold(source, Attachment(source.request.request_id, len(source.request.prompt_ids),
                                       source.pre.primed_to, target))
        if not source.croppable:
            source.after_chunk.want(target)
        self._holds[request.request_id] = hold
        while len(self._holds) > MAX_HOLDS:
            self._holds.popitem(last=False)
        return hold

    def held(self, request: GenerationRequest) -> Hold | None:
        return self._holds.get(request.request_id)

    def take(self, request: GenerationRequest) -> Hold | None:
        """The request is being admitted: its hold, if any, is over."""
        return self._holds.pop(request.request_id, None)

    def waits(self, hold: Hold, flights: list[Flight]) -> bool:
        """Whether the held request should still wait: its source is on the model, prefilling,
        and not yet at the cut."""
        source = hold.source
        return any(f is source for f in flights) and source.phase == "prefill" and not self.ready(
            source, hold.attachment.target)

    def fork(self, flight: Flight, target: int) -> Any:
        """A cache holding a copy of `flight`'s state after `target` tokens (`ready` first)."""
        length = flight.position if flight.phase == "decode" else flight.pre.primed_to
        live = ParkedState(Snapshot.adopt(flight.cache, length), dict(flight.pre.snapshots), flight.croppable)
        return live.rebuild(self.model_config, target, copy=True)

    def _forkable(self, flight: Flight, target: int) -> bool:
        """Attention-only state can be cut anywhere; recurrent state only where a snapshot is
        (or, in exact mode, will be: prefill passes every cut as a chunk end)."""
        if flight.croppable:
            return True
        return self.ready(flight, target) or (self.mode == "exact" and flight.phase == "prefill"
                                              and flight.pre.primed_to < target)
