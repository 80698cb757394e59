"""Session affinity's first half: identity nominates at most one parked session.

- Explicit: the request names a conversation (body session_id, else user, else header
  x-session-id). It is nominated only to a parked session with the same name. A name is a
  set of conversations (a main agent, its sub-agents, side queries, compaction requests
  under one session), so within the name the bytes pick: the session whose verified
  prefix reuses the most tokens, fingerprint segments breaking ties, then recency. When
  none of them reuses anything, only a session sharing MIN_SHARED_SEGMENTS segments (the
  request's own conversation, rewritten) is nominated, to be declined with its divergence;
  a sibling never is.
- Implicit: the request names nothing. It is nominated to the unnamed session whose
  fingerprint shares the longest leading run of segments, and only if that run is at least
  MIN_SHARED_SEGMENTS long: a bare system prompt is identical across every fresh
  conversation from one client and must not cross-link them.

Named and unnamed never cross: affinity declines rather than guesses. Nomination is only
a claim; verification (planner.verify) decides whether the bytes allow a resume.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from memrad.loglines import quoted
from memrad.request import Identity, IdentitySource
from memrad.reuse.fingerprint import shared_segments
from memrad.reuse.pool import ParkedSession

MIN_SHARED_SEGMENTS = 3


@dataclass(frozen=True, slots=True)
class Nomination:
    session: ParkedSession
    kind: Literal["explicit", "implicit"]
    source: IdentitySource | None
    shared_segments: int

    def describe(self) -> str:
        if self.kind == "explicit":
            return f"explicit, {self.source} {quoted(self.session.identity.name)}, {self.shared_segments} shared segments"
        return f"implicit, {self.shared_segments} shared segments"


@dataclass(frozen=True, slots=True)
class Refusal:
    """Nothing nominated. `blocked` is the session a naming mismatch kept from nomination."""

    reason: str
    shared_segments: int
    blocked: ParkedSession | None = None
    reason_class: str = "below-bar"  # memrad.protocol.REASON_CLASSES


def _name(identity: Identity | None) -> str | None:
    return identity.name if identity is not None else None


def _best(chain: tuple[int, ...], sessions: list[ParkedSession]) -> tuple[ParkedSession | None, int]:
    best, best_shared = None, -1
    for s in sessions:
        shared = shared_segments(chain, s.fingerprint)
        if shared > best_shared or (shared == best_shared and best is not None
                                    and s.last_used_at >= best.last_used_at):
            best, best_shared = s, shared
    return best, max(best_shared, 0)


def _best_by_bytes(chain: tuple[int, ...], sessions: list[ParkedSession],
                   reusable: Callable[[ParkedSession], int]) -> tuple[ParkedSession, int, int]:
    """The session reusing the most verified tokens (segments, then recency break ties)."""
    scored = [(reusable(s), shared_segments(chain, s.fingerprint), s.last_used_at, s) for s in sessions]
    reused, shared, _, session = max(scored, key=lambda r: r[:3])
    return session, reused, shared


def _describe_parked(session: ParkedSession) -> str:
    # Never the other conversation's name: a decision reaches the client that asked.
    return "unnamed parked session" if session.identity is None else "another named session"


def nominate(identity: Identity | None, chain: tuple[int, ...], sessions: list[ParkedSession],
             reusable: Callable[[ParkedSession], int]) -> Nomination | Refusal:
    """Pick the candidate among `sessions` (one namespace); `reusable(s)` is how many of the
    request's tokens `s` would verifiably reuse (0: none). Pure; mutates nothing."""
    name = _name(identity)
    same_name = [s for s in sessions if _name(s.identity) == name]
    others = [s for s in sessions if _name(s.identity) != name]
    if name is not None and same_name:
        session, reused, shared = _best_by_bytes(chain, same_name, reusable)
        if reused == 0:
            session, shared = _best(chain, same_name)
        if reused > 0 or shared >= MIN_SHARED_SEGMENTS:
            return Nomination(session, "explicit", identity.source, shared)
        return Refusal(f'no parked session named "{name}" shares a resumable prefix or {MIN_SHARED_SEGMENTS} '
                       f"segments ({len(same_name)} under that name)", shared)
    if not chain:
        return Refusal("prompt has no message control tokens to fingerprint", 0, reason_class="no-control-tokens")
    session, shared = _best(chain, same_name)
    if session is not None and shared >= MIN_SHARED_SEGMENTS:
        return Nomination(session, "implicit", None, shared)
    blocked, blocked_shared = _best(chain, others)
    if blocked is not None and blocked_shared >= MIN_SHARED_SEGMENTS:
        asked = "unnamed request" if name is None else f"named {quoted(name)}"
        return Refusal(f"{asked} vs {_describe_parked(blocked)}", blocked_shared, blocked, "named-vs-unnamed")
    if name is not None:
        return Refusal(f"no parked session named {quoted(name)}", shared, reason_class="no-such-name")
    return Refusal(f"{shared} shared segments < {MIN_SHARED_SEGMENTS}", shared)
