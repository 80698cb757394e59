"""Session affinity's first half: identity nominates at most one parked session.

- Explicit: the request names a conversation (body session_id, else user, else header
  x-session-id). It is nominated only to a parked session with the same name.
- Implicit: the request names nothing. It is nominated to the unnamed session whose
  fingerprint shares the longest leading run of segments, and only if that run is at least
  MIN_SHARED_SEGMENTS long: a bare system prompt is identical across every fresh
  conversation from one client and must not cross-link them.

Named and unnamed never cross: affinity declines rather than guesses. Nomination is only
a claim; verification (planner.verify) decides whether the bytes allow a resume.
"""

from __future__ import annotations

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


def _describe_parked(session: ParkedSession) -> str:
    # Never the other conversation's name: a decision reaches the client that asked.
    return "unnamed parked session" if session.identity is None else "another named session"


def nominate(identity: Identity | None, chain: tuple[int, ...],
             sessions: list[ParkedSession]) -> Nomination | Refusal:
    """Pick the candidate among `sessions` (one namespace). Pure; mutates nothing."""
    name = _name(identity)
    same_name = [s for s in sessions if _name(s.identity) == name]
    others = [s for s in sessions if _name(s.identity) != name]
    if name is not None and same_name:
        session, shared = _best(chain, same_name)
        return Nomination(session, "explicit", identity.source, shared)
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
