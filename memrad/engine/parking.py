"""Reuse bookkeeping: what a request checks out of the pools, and what it parks back.

    Plan -> load (a disk session's state) -> check_out -> (cache, Prefilled)
         ... prefill and decode (memrad.engine.engine) ...
         -> park: replace the parent (same conversation) or park beside it (a fork)
                  -> the memory cap evicts LRU -> spill to the disk tier, else drop

`ParkingLike` is the interface the Engine uses. `Parking` owns the memory pool, the disk
tier and the retention policy (which snapshots a session keeps, up to where it is exact).
`NoParking` is the same interface when the pool is off (MEMRA_REUSE_POOL=0): every plan is
cold and nothing is kept. The disk tier is a `DiskLike`: memrad.engine.state.disk.DiskTier,
or `NoDisk` when it is off (evicted state is dropped). Neither parking knows the Engine:
they get values and callbacks (`new_cache`, `publish`), so the import graph stays acyclic.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol

from memrad.engine.events import Publisher
from memrad.engine.state.snapshot import ParkedState, Snapshot, is_croppable, state_bytes, thin_boundaries
from memrad.grid import cut_floor, is_cut
from memrad.protocol import Decision, EvictEvent, ParkEvent, PoolStats, SessionInfo
from memrad.request import GenerationRequest
from memrad.reuse.drafts import DraftIndex
from memrad.reuse.fingerprint import Segment, chain
from memrad.reuse.planner import Mode, Plan, RequestView, plan
from memrad.reuse.pool import NATIVE, Namespace, ParkedSession, PrefixMatch, ReusePool
from memrad.reuse.report import session_info

log = logging.getLogger("memrad.engine")


@dataclass(frozen=True, slots=True)
class Unsaved:
    """A parked session `memrad stop` could not write to the disk tier: it is lost."""

    session_id: str
    num_tokens: int
    why: str

    def render(self) -> str:
        return f"{self.session_id} ({self.num_tokens} tokens): {self.why}"


@dataclass
class Prefilled:
    """Bookkeeping of one request's prefill (mutated as prefill passes chunks)."""

    start: int
    primed_to: int
    snapshots: dict[int, Snapshot]
    anchors: tuple[int, ...] = ()  # reply anchors the prompt is cut at (exact mode; memrad.grid)
    copied_bytes: int | None = None  # what a fork copied out of its source's state (None: nothing)


class Snapshotter:
    """Called after each prefill chunk with its end: moves `primed_to`, and clones
    non-croppable state at the positions wanted (the essential ones, reply anchors below P,
    and a cut a request attached to this prefill forks at: memrad.engine.attaching)."""

    def __init__(self, cache: Any, pre: Prefilled, wanted: set[int]) -> None:
        self.cache, self.pre, self.wanted = cache, pre, wanted
        if pre.start in wanted and pre.start > 0:
            pre.snapshots[pre.start] = Snapshot.take(cache, pre.start)

    def want(self, position: int) -> None:
        self.wanted.add(position)

    def __call__(self, end: int) -> None:
        self.pre.primed_to = end
        if end in self.wanted:
            self.pre.snapshots[end] = Snapshot.take(self.cache, end)


def essential(prompt_len: int, chunk: int, anchors: tuple[int, ...], mode: Mode) -> set[int]:
    """Snapshot positions every non-croppable session keeps: the exact checkpoint (the last
    cut <= P) and, in fast mode, P itself."""
    wanted = {cut_floor(prompt_len, chunk, anchors)}
    if mode == "fast":
        wanted.add(prompt_len)
    return wanted


class ParkingLike(Protocol):
    """What the Engine asks of reuse bookkeeping (`Parking`, or `NoParking` when the pool is
    off). Call every method from the engine thread."""

    def plan(self, view: RequestView, affinity: bool, longest_prefix: bool) -> Plan:
        """Decide reuse among the parked sessions (pure: the pools are only read)."""
        ...

    def load(self, decided: Plan, replan: Callable[[], Plan]) -> Plan:
        """The plan with a chosen disk session's state loaded (mutates: a file that fails its
        checks is deleted and the request planned again without it)."""
        ...

    def get(self, session_id: str | None) -> ParkedSession | None:
        """A session parked in memory (does not mutate)."""
        ...

    def check_out(self, decided: Plan, anchors: tuple[int, ...]) -> tuple[Any, Prefilled]:
        """The cache a request prefills into (mutates: a parent it replaces leaves the pools)."""
        ...

    def resume_failed(self, decided: Plan) -> None:
        """A checked-out parent that nothing will replace is dropped (mutates)."""
        ...

    def park(self, request: GenerationRequest, namespace: Namespace, decided: Plan, cache: Any, pre: Prefilled,
             fed: tuple[int, ...], text: str, prompt_segments: tuple[Segment, ...],
             drafts: DraftIndex | None = None) -> ParkedSession | None:
        """Park what a finished request left (mutates); the session parked, if any. `drafts`:
        its drafts' index over exactly the tokens parked (memrad.reuse.drafts), kept with it."""
        ...

    def spill_all(self) -> list[Unsaved]:
        """At `memrad stop`: write what is parked to the disk tier (mutates); what was lost."""
        ...

    def infos(self) -> list[SessionInfo]:
        """Every parked session as a SessionInfo record (does not mutate)."""
        ...

    def stats(self) -> PoolStats:
        """The pools' figures, zeros for a tier that is off (does not mutate)."""
        ...


class DiskLike(Protocol):
    """What parking asks of the disk tier (memrad.engine.state.disk.DiskTier, or `NoDisk`).
    `pool` holds its sessions' records (state None, on_disk True); the planner reads it."""

    pool: ReusePool
    eviction: str  # what becomes of a session the memory cap evicts, for its log line

    def load(self, session: ParkedSession, new_cache: Callable[[], Any]) -> ParkedState | None:
        """A disk session's state, or None when its file fails its checks (deleted: mutates)."""
        ...

    def forget(self, session_id: str, why: str = ...) -> None:
        """Drop one session and its file (mutates; no-op if it is not on disk)."""
        ...

    def spill_later(self, session: ParkedSession, on_evicted: Callable[[ParkedSession], None],
                    on_done: Callable[[ParkedSession, str | None], None]) -> None:
        """Take a session the memory cap evicted (mutates, on the tier's writer thread)."""
        ...

    def spill_all(self, sessions: list[ParkedSession],
                  on_evicted: Callable[[ParkedSession], None]) -> list[tuple[ParkedSession, str]]:
        """At `memrad stop`: write `sessions` (mutates); those not written, and why."""
        ...


class NoDisk:
    """The disk tier is off: nothing is on disk, and an evicted session is dropped."""

    eviction = "dropped (no disk tier)"

    def __init__(self) -> None:
        self.pool = ReusePool(max_sessions=0, max_bytes=0)  # always empty

    def load(self, session: ParkedSession, new_cache: Callable[[], Any]) -> ParkedState | None:
        return None

    def forget(self, session_id: str, why: str = "") -> None:
        pass

    def spill_later(self, session: ParkedSession, on_evicted: Callable[[ParkedSession], None],
                    on_done: Callable[[ParkedSession, str | None], None]) -> None:
        on_evicted(session)

    def spill_all(self, sessions: list[ParkedSession],
                  on_evicted: Callable[[ParkedSession], None]) -> list[tuple[ParkedSession, str]]:
        return []


class NoParking:
    """The pool is off: plans are cold, nothing is checked out, parked or counted."""

    def __init__(self, new_cache: Callable[[], Any]) -> None:
        self.new_cache = new_cache

    def plan(self, view: RequestView, affinity: bool, longest_prefix: bool) -> Plan:
        return Plan(Decision(view.request_id, "cold", "reuse pool disabled", 0, len(view.prompt_ids)))

    def load(self, decided: Plan, replan: Callable[[], Plan]) -> Plan:
        return decided

    def get(self, session_id: str | None) -> ParkedSession | None:
        return None

    def check_out(self, decided: Plan, anchors: tuple[int, ...]) -> tuple[Any, Prefilled]:
        return self.new_cache(), Prefilled(0, 0, {}, anchors)

    def resume_failed(self, decided: Plan) -> None:
        pass

    def park(self, request: GenerationRequest, namespace: Namespace, decided: Plan, cache: Any, pre: Prefilled,
             fed: tuple[int, ...], text: str, prompt_segments: tuple[Segment, ...],
             drafts: DraftIndex | None = None) -> ParkedSession | None:
        return None

    def spill_all(self) -> list[Unsaved]:
        return []

    def infos(self) -> list[SessionInfo]:
        return []

    def stats(self) -> PoolStats:
        return PoolStats(0, 0, 0, 0)


class Parking:
    """The memory pool and the disk tier behind it (`NoDisk` when off). Every method but
    `plan`, `get`, `infos` and `stats` mutates the pools; call them from the engine thread."""

    def __init__(self, pool: ReusePool, disk: DiskLike, tokenizer: Any, openers: frozenset[int],
                 model_config: Any, chunk: int, mode: Mode, new_cache: Callable[[], Any],
                 publish: Publisher) -> None:
        self.new_cache = new_cache
        self.pool = pool
        self.disk = disk  # memrad.engine.state.disk.DiskTier, or NoDisk
        self.tokenizer, self.openers, self.model_config = tokenizer, openers, model_config
        self.chunk, self.mode = chunk, mode
        self.publish = publish

    def plan(self, view: RequestView, affinity: bool, longest_prefix: bool) -> Plan:
        """Decide reuse among the parked sessions of both tiers (pure; the pools are only read)."""
        sessions = self.pool.sessions() + self.disk.pool.sessions()
        matches: tuple[PrefixMatch, ...] = (self.pool.prefix_matches(view.namespace, view.prompt_ids)
                                            + self.disk.pool.prefix_matches(view.namespace, view.prompt_ids))
        return plan(view, sessions, self.mode, self.chunk, affinity, longest_prefix, matches)

    def load(self, decided: Plan, replan: Callable[[], Plan]) -> Plan:
        """Load a chosen disk session's state; a file that fails its checks is deleted (by the
        disk tier, with a log line) and the request is planned again without it."""
        while decided.session is not None and decided.session.on_disk:
            state = self.disk.load(decided.session, self.new_cache)
            if state is not None:
                return replace(decided, session=replace(decided.session, state=state))
            self._evicted_from_disk(decided.session)
            decided = replan()
        return decided

    def get(self, session_id: str | None) -> ParkedSession | None:
        """A session parked in memory (does not mutate)."""
        return self.pool.get(session_id) if session_id is not None else None

    def check_out(self, decided: Plan, anchors: tuple[int, ...]) -> tuple[Any, Prefilled]:
        """The cache a request prefills into: empty, a fork's copy, or its parent's own."""
        if decided.session is None:
            return self.new_cache(), Prefilled(0, 0, {}, anchors)
        parent = decided.session
        if decided.fork:
            # Another conversation's state: copy its rows, leave it parked and unchanged.
            # A disk session's state was just read into buffers of its own: nothing to copy.
            (self.disk.pool if parent.on_disk else self.pool).touch(parent.session_id)
            copy = not parent.on_disk
            cache = parent.state.rebuild(self.model_config, decided.checkpoint, copy=copy)
            copied = state_bytes([Snapshot.adopt(cache, decided.checkpoint)]) if copy else None
            return cache, Prefilled(decided.checkpoint, decided.checkpoint, {}, anchors, copied)
        # A resume that replaces its parent hands the parent's buffers on (the new rows
        # overwrite the parent's rows past the checkpoint): check it out first, so the pool
        # never lists a state that is being written. Its boundary snapshots below the
        # checkpoint stay exact and pass to the successor.
        self.pool.remove(parent.session_id)
        self.disk.forget(parent.session_id)
        cache = parent.state.rebuild(self.model_config, decided.checkpoint)
        return cache, Prefilled(decided.checkpoint, decided.checkpoint, parent.state.below(decided.checkpoint),
                                anchors)

    def resume_failed(self, decided: Plan) -> None:
        if decided.session is not None and not decided.fork:
            self._drop_parent(decided.session, "its resume failed")

    def _exact_limit(self, decided: Plan, primed_to: int) -> int:
        """Cuts <= the result came from canonical prefill chunks (see DESIGN: Exactness)."""
        start, parent = decided.checkpoint, decided.session
        if parent is None or (start <= parent.exact_limit and is_cut(start, self.chunk, parent.anchors)):
            return primed_to
        return min(start, parent.exact_limit)

    def park(self, request: GenerationRequest, namespace: Namespace, decided: Plan, cache: Any, pre: Prefilled,
             fed: tuple[int, ...], text: str, prompt_segments: tuple[Segment, ...],
             drafts: DraftIndex | None = None) -> ParkedSession | None:
        """Park what the request left: its prompt up to where prefill got, plus `fed` (and
        `drafts`, the index over those tokens, where the reply speculated)."""
        if pre.primed_to == 0:
            return None
        token_ids = tuple(request.prompt_ids[: pre.primed_to]) + fed
        whole_prompt = pre.primed_to == len(request.prompt_ids)  # else cancelled mid-prompt
        croppable = is_croppable(cache)
        keep = (essential(len(request.prompt_ids), self.chunk, pre.anchors, self.mode)
                | thin_boundaries(pre.snapshots, pre.anchors))
        snapshots = {pos: snap for pos, snap in pre.snapshots.items() if pos < len(token_ids) and pos in keep}
        state = ParkedState(final=Snapshot.adopt(cache, len(token_ids)), snapshots=snapshots,
                            croppable=croppable)
        now = time.time()
        parent = decided.session
        succeeds = parent is not None and not decided.fork
        session = ParkedSession(
            session_id=self.pool.new_id(),
            namespace=namespace,
            identity=request.identity,
            token_ids=token_ids,
            text=request.prompt_text + text,
            prompt_checkpoint=pre.primed_to,
            checkpoints=() if croppable else tuple(sorted({*snapshots, len(token_ids)})),
            croppable=croppable,
            exact_limit=self._exact_limit(decided, pre.primed_to),
            fingerprint=tuple(seg.hash for seg in prompt_segments) if whole_prompt
            else chain(token_ids[: pre.primed_to], self.openers),
            num_bytes=state.num_bytes,
            created_at=parent.created_at if succeeds else now,
            last_used_at=now,
            hits=parent.hits + 1 if succeeds else 0,
            anchors=tuple(a for a in pre.anchors if a <= pre.primed_to),
            state=state,
            rope=decided.decision.rope or NATIVE,
            drafts=drafts,
        )
        if not self.pool.can_park(session.num_bytes):
            log.info("%s not parked: %d bytes exceed the pool's cap of %d bytes", request.request_id,
                     session.num_bytes, self.pool.max_bytes)
            if succeeds:
                self._drop_parent(parent, "its successor exceeds the pool's byte cap")
            return None
        replaced = parent.session_id if succeeds else None
        for old in self.pool.park(session, replaces=replaced):
            self._evicted(old)
        self.publish(lambda: ParkEvent(now, session_info(self.tokenizer, session, self.openers,
                                                         prompt_segments if whole_prompt else None), replaced))
        return session

    def _evicted(self, old: ParkedSession) -> None:
        """The memory cap pushed `old` out: the disk tier spills it (on its writer thread, so
        the request that evicted it does not wait for the write); `NoDisk` drops it."""
        log.info("evicted %s (%d tokens, %d bytes); %s", old.session_id, old.num_tokens, old.num_bytes,
                 self.disk.eviction)
        self.disk.spill_later(old, self._evicted_from_disk, self._spilled)

    def _spilled(self, old: ParkedSession, failed: str | None) -> None:
        """A spill finished (on the disk tier's writer thread): say where the session went."""
        written = self.disk.pool.get(old.session_id) if failed is None else None
        if written is not None:  # the same session, now on disk
            self.publish(lambda: ParkEvent(time.time(), session_info(self.tokenizer, written, self.openers),
                                           old.session_id))
        else:  # not written (the disk tier logged why), or already pushed out by the cap
            self.publish(lambda: EvictEvent(time.time(), old.session_id, old.num_tokens, old.num_bytes, failed))

    def _evicted_from_disk(self, old: ParkedSession) -> None:
        self.publish(lambda: EvictEvent(time.time(), old.session_id, old.num_tokens, old.num_bytes))

    def _drop_parent(self, parent: ParkedSession, why: str) -> None:
        """A checked-out parent that nothing replaces is gone: say so (log, control socket)."""
        log.info("dropped %s (%d tokens): %s", parent.session_id, parent.num_tokens, why)
        self.publish(lambda: EvictEvent(time.time(), parent.session_id, parent.num_tokens, parent.num_bytes))

    def spill_all(self) -> list[Unsaved]:
        """At `memrad stop`: write every parked session to the disk tier (most recent last, so
        the disk's LRU keeps the freshest); the sessions that could not be written, and why.
        Call once nothing runs on the engine."""
        return [Unsaved(s.session_id, s.num_tokens, why)
                for s, why in self.disk.spill_all(self.pool.sessions(), self._evicted_from_disk)]

    def infos(self) -> list[SessionInfo]:
        """Every parked session as a SessionInfo record (disk first, each least recently used first)."""
        return [session_info(self.tokenizer, s, self.openers) for s in self.disk.pool.sessions() + self.pool.sessions()]

    def stats(self) -> PoolStats:
        pool, disk = self.pool, self.disk.pool
        return PoolStats(len(pool.sessions()), pool.bytes_parked, pool.max_sessions, pool.max_bytes,
                         len(disk.sessions()), disk.bytes_parked)
