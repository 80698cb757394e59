"""Which parked session a request resumes from, and at which checkpoint. Pure policy.

Tiers nominate, in order: token-prefix (the prompt's token ids extend a session's
committed tokens), then text-prefix (the prompt's text extends its committed text).
Verification decides: the request resumes only from a checkpoint its own tokens reproduce
exactly, with at least one token left to prime.

Usable checkpoints of a session, by mode (C = prefill chunk, P = prompt checkpoint):

    exact:  0     C     2C   floor(P)  P        len(tokens)
            |-----|-----|-----|--------|--------|
                  ^     ^     ^ grid positions <= exact_limit: their state came from grid
                                prefill chunks, so a resume there is bit-identical to cold
    fast:   any position <= len(tokens) (attention-only), or any snapshot (recurrent)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from memrad.grid import grid_floor
from memrad.protocol import Decision, Tier
from memrad.reuse.pool import Namespace, ParkedSession

Mode = Literal["exact", "fast"]


@dataclass(frozen=True, slots=True)
class RequestView:
    request_id: str
    prompt_ids: tuple[int, ...]
    prompt_text: str
    namespace: Namespace


@dataclass(frozen=True, slots=True)
class Plan:
    decision: Decision
    session: ParkedSession | None = None  # resume from this one's state ...
    checkpoint: int = 0                   # ... at this position (0: cold)


def common_prefix_len(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def checkpoint_at_or_below(session: ParkedSession, limit: int, mode: Mode, chunk: int) -> int | None:
    """The highest position <= limit whose state `session` can rebuild in `mode` (never 0)."""
    if mode == "exact":
        limit = min(limit, session.exact_limit)
        if session.croppable:
            best = grid_floor(max(limit, 0), chunk)
            return best or None
        found = [c for c in session.checkpoints if c <= limit and c % chunk == 0]
    else:
        limit = min(limit, session.num_tokens)
        if session.croppable:
            return limit if limit > 0 else None
        found = [c for c in session.checkpoints if c <= limit]
    return max(found, default=None)


@dataclass(frozen=True, slots=True)
class Verdict:
    checkpoint: int | None  # None: declined
    reason: str


def verify(session: ParkedSession, prompt_ids: tuple[int, ...], mode: Mode, chunk: int) -> Verdict:
    """Resume only where the prompt reproduces the session's tokens, leaving a suffix to prime."""
    num_prompt = len(prompt_ids)
    shared = common_prefix_len(prompt_ids, session.token_ids)
    top = checkpoint_at_or_below(session, num_prompt - 1, mode, chunk)
    if top is None:
        at_end = checkpoint_at_or_below(session, num_prompt, mode, chunk)
        if at_end is not None and at_end == num_prompt:
            return Verdict(None, f"no suffix to prime (prompt {num_prompt} tokens, checkpoint {at_end})")
        return Verdict(None, f"no {mode} checkpoint below the prompt's end "
                             f"(prompt {num_prompt} tokens, exact up to {session.exact_limit})")
    chosen = checkpoint_at_or_below(session, min(shared, num_prompt - 1), mode, chunk)
    if chosen is None:
        return Verdict(None, f"history diverged at {shared} of checkpoint {top}")
    if chosen < top:
        return Verdict(chosen, f"session {session.session_id}; history diverged at {shared} of checkpoint "
                               f"{top}, resumed from earlier checkpoint {chosen}; primed {num_prompt - chosen}")
    return Verdict(chosen, f"session {session.session_id}; checkpoint {chosen}; primed {num_prompt - chosen}")


def _nominate(view: RequestView, sessions: list[ParkedSession]) -> tuple[Tier, ParkedSession] | None:
    by_tokens = [s for s in sessions if s.num_tokens <= len(view.prompt_ids)
                 and view.prompt_ids[: s.num_tokens] == s.token_ids]
    if by_tokens:
        return "token-prefix", max(by_tokens, key=lambda s: (s.num_tokens, s.last_used_at))
    by_text = [s for s in sessions if s.text and view.prompt_text.startswith(s.text)]
    if by_text:
        return "text-prefix", max(by_text, key=lambda s: (len(s.text), s.last_used_at))
    return None


def plan(view: RequestView, sessions: list[ParkedSession], mode: Mode, chunk: int) -> Plan:
    """Decide for one request; `sessions` are all parked sessions (any namespace)."""
    num_prompt = len(view.prompt_ids)

    def cold(reason: str) -> Plan:
        return Plan(Decision(view.request_id, "cold", reason, 0, num_prompt))

    mine = [s for s in sessions if s.namespace == view.namespace]
    if not mine:
        return cold("nothing parked for this model and cache_salt")
    nominated = _nominate(view, mine)
    if nominated is None:
        return cold(f"no nomination: no parked session's tokens or text prefix this prompt "
                    f"({len(mine)} parked)")
    tier, session = nominated
    verdict = verify(session, view.prompt_ids, mode, chunk)
    if verdict.checkpoint is None:
        return Plan(Decision(view.request_id, "declined", verdict.reason, 0, num_prompt,
                             tier=tier, candidate=session.session_id))
    decision = Decision(view.request_id, "resumed", verdict.reason, verdict.checkpoint,
                        num_prompt - verdict.checkpoint, tier=tier, candidate=session.session_id,
                        checkpoint=verdict.checkpoint)
    return Plan(decision, session, verdict.checkpoint)
