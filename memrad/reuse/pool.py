"""Parked sessions: the state finished requests left behind, under count and byte caps.

Mechanism only: the pool stores, looks up, replaces and evicts (least recently used
first). Which session a request may resume from is the planner's business. Admission is
check-then-act: `park` evicts first and never leaves the pool over a cap. A prefix index
(memrad.reuse.prefix_index) follows every park and removal, so `prefix_matches` finds the
sessions sharing the longest token prefix with a prompt without scanning them all.

The same class holds the disk tier's records (memrad.engine.state.disk): there `state` is None,
`on_disk` is True and `num_bytes` is the file's size; the caps are the disk's.

Invariants, checked on park:
  - a session's prompt checkpoint is never past its committed tokens;
  - every listed checkpoint lies within the committed tokens;
  - a drafts' index, where kept, covers exactly the committed tokens;
  - bytes_parked <= max_bytes and len(sessions) <= max_sessions;
  - a name (within a namespace) holds at most sessions_per_name sessions: a name is a set
    of conversations (a main agent, its sub-agents, side queries), and one busy name must
    not push every other conversation out. Unnamed sessions have no such cap.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from memrad.request import Identity
from memrad.reuse.drafts import DraftIndex
from memrad.reuse.prefix_index import BLOCK, PrefixIndex, common_prefix_len


NATIVE = "native"  # the rope as the model shipped it (memrad.engine.model.rope.NATIVE)


@dataclass(frozen=True, slots=True)
class Namespace:
    """Reuse never crosses a namespace: a different model or cache_salt shares nothing."""

    model: str
    cache_salt: str | None


@dataclass(frozen=True, slots=True)
class ParkedSession:
    session_id: str
    namespace: Namespace
    identity: Identity | None
    token_ids: tuple[int, ...]  # exactly the tokens the parked state covers
    text: str                   # prompt text + the reply as the client was sent it
    prompt_checkpoint: int      # the prompt length: state before the first generated token was fed
    checkpoints: tuple[int, ...]  # positions with a snapshot of non-croppable (recurrent) state
    croppable: bool             # attention-only state: any position <= len(token_ids) can be rebuilt
    exact_limit: int            # positions <= this were produced by canonical prefill chunks
    fingerprint: tuple[int, ...]  # segment hash chain of the prompt (memrad.reuse.fingerprint)
    num_bytes: int
    created_at: float
    last_used_at: float
    hits: int = 0
    anchors: tuple[int, ...] = ()  # reply anchors its prompt was also cut at (memrad.grid)
    state: Any = field(default=None, compare=False, repr=False)  # engine-owned tensors
    on_disk: bool = False          # the state is in the disk tier's file, loaded when chosen
    # The RoPE its state was computed under: "native" or the served scaling ("yarn x4",
    # memrad.engine.model.rope). The planner resumes it only for a request under the same.
    rope: str = "native"
    # Drafts' index over exactly token_ids (memrad.reuse.drafts), kept in memory only: None where
    # the reply did not speculate, and on the disk tier (a resume from disk indexes its prompt anew).
    drafts: DraftIndex | None = field(default=None, compare=False, repr=False)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """A parked session and the common token prefix it shares with a prompt (compared)."""

    session: ParkedSession
    shared_tokens: int


class PoolFull(Exception):
    """A single session is larger than the whole byte cap."""


class ReusePool:
    def __init__(self, max_sessions: int, max_bytes: int, sessions_per_name: int | None = None) -> None:
        self.max_sessions = max_sessions
        self.max_bytes = max_bytes
        self.sessions_per_name = sessions_per_name  # None: no cap per name
        self._sessions: OrderedDict[str, ParkedSession] = OrderedDict()  # LRU first
        self._lock = threading.Lock()
        self._index = PrefixIndex()
        self._next_id = 1

    def new_id(self) -> str:
        with self._lock:
            session_id = f"s{self._next_id}"
            self._next_id += 1
            return session_id

    def skip_ids_up_to(self, session_ids: list[str]) -> None:
        """Never hand out these ids again (sessions restored from disk keep theirs)."""
        numbers = [int(sid[1:]) for sid in session_ids if sid[:1] == "s" and sid[1:].isdigit()]
        with self._lock:
            self._next_id = max([self._next_id, *(n + 1 for n in numbers)])

    @property
    def bytes_parked(self) -> int:
        with self._lock:
            return sum(s.num_bytes for s in self._sessions.values())

    def sessions(self, namespace: Namespace | None = None) -> list[ParkedSession]:
        """A snapshot list, least recently used first. Does not mutate."""
        with self._lock:
            return [s for s in self._sessions.values() if namespace is None or s.namespace == namespace]

    def get(self, session_id: str) -> ParkedSession | None:
        with self._lock:
            return self._sessions.get(session_id)

    def prefix_matches(self, namespace: Namespace, prompt_ids: tuple[int, ...]) -> tuple[PrefixMatch, ...]:
        """Sessions of `namespace` sharing at least one index block with the prompt, each with
        its common prefix length compared token by token. Does not mutate."""
        with self._lock:
            found = self._index.lookup(namespace, prompt_ids)
            sessions = [(self._sessions[sid], blocks) for sid, blocks in found.items() if sid in self._sessions]
        out = []
        for session, blocks in sessions:
            shared = common_prefix_len(prompt_ids, session.token_ids)
            if shared >= blocks * BLOCK:  # else a hash collision: the bytes decide
                out.append(PrefixMatch(session, shared))
        return tuple(out)

    def touch(self, session_id: str) -> None:
        """Mark a session most recently used (a fork source stays parked and was just used)."""
        with self._lock:
            if session_id in self._sessions:
                self._sessions.move_to_end(session_id)

    def can_park(self, num_bytes: int) -> bool:
        return self.max_sessions >= 1 and num_bytes <= self.max_bytes

    def park(self, session: ParkedSession, replaces: str | None = None) -> list[ParkedSession]:
        """Add `session` (dropping `replaces` first); evict LRU sessions until it fits: first
        within its name (sessions_per_name), then across the pool (count and byte caps).

        Returns the evicted sessions (not counting the replaced one).
        """
        if not self.can_park(session.num_bytes):
            raise PoolFull(f"session of {session.num_bytes} bytes exceeds the pool's cap of {self.max_bytes}")
        assert session.prompt_checkpoint <= session.num_tokens, "prompt checkpoint past the committed tokens"
        assert all(0 < c <= session.num_tokens for c in session.checkpoints), "checkpoint outside the tokens"
        assert session.drafts is None or len(session.drafts) == session.num_tokens, "drafts' index off its tokens"
        evicted = []
        with self._lock:
            if replaces is not None:
                self._drop(replaces)
            evicted += self._evict_within_name(session)
            used = sum(s.num_bytes for s in self._sessions.values())
            while self._sessions and (len(self._sessions) >= self.max_sessions
                                      or used + session.num_bytes > self.max_bytes):
                old = self._drop(next(iter(self._sessions)))
                used -= old.num_bytes
                evicted.append(old)
            self._sessions[session.session_id] = session
            self._index.add(session.session_id, session.namespace, session.token_ids)
        return evicted

    def _evict_within_name(self, session: ParkedSession) -> list[ParkedSession]:
        """Drop the name's least recently used sessions until `session` fits its name's cap;
        the caller holds the lock."""
        name = session.identity.name if session.identity is not None else None
        if name is None or self.sessions_per_name is None:
            return []
        same = [sid for sid, s in self._sessions.items()  # LRU first
                if s.namespace == session.namespace and s.identity is not None and s.identity.name == name]
        excess = len(same) - max(self.sessions_per_name - 1, 0)
        return [self._drop(sid) for sid in same[:max(excess, 0)]]

    def remove(self, session_id: str) -> ParkedSession | None:
        with self._lock:
            return self._drop(session_id)

    def _drop(self, session_id: str) -> ParkedSession | None:
        """Remove a session and its index entries; the caller holds the lock."""
        self._index.remove(session_id)
        return self._sessions.pop(session_id, None)
