"""Which parked session a request resumes from, and at which checkpoint. Pure policy.

Tiers nominate, in order: token-prefix (the prompt's token ids extend a session's
committed tokens), text-prefix (the prompt's text extends its committed text), then
affinity (identity: a name, or the structural fingerprint; see identity.py). Only sessions
of the request's namespace and with the same name (or both unnamed) are ever nominated.
Verification decides: the request resumes only from a checkpoint its own tokens reproduce
exactly, with at least one token left to prime; below a divergence it falls back to the
highest checkpoint that still matches.

Then the longest-prefix tier (needs no identity): among every parked session of the
namespace, the one whose highest usable checkpoint at or below the common token prefix
is highest. It wins when it reuses more than the nominated session would. Its reused
tokens are the request's own, so it cannot poison; it **forks** (the source stays parked,
the request gets a copy of its rows) unless the request continues that conversation: same
name (or both unnamed) and the session's whole prompt is part of the shared prefix, in
which case it replaces the session as the nominating tiers do.

Usable checkpoints of a session, by mode (C = prefill chunk, P = prompt checkpoint):

    exact:  0     C     2C    a     a+C   a' = P   len(tokens)
            |-----|-----|-----|-----|-----|--------|
                  ^     ^     ^     ^     ^ cuts <= exact_limit: C multiples counted from 0,
                                            then from each reply anchor a (memrad.grid).
                                            Their state came from canonical prefill chunks,
                                            so a resume there is bit-identical to cold,
                                            provided the request was cut alike below it
    fast:   any position <= len(tokens) (attention-only), or any snapshot (recurrent)
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from memrad.grid import cuts_up_to, is_cut
from memrad.protocol import Decision, Tier
from memrad.request import Identity
from memrad.reuse.identity import Nomination, Refusal, nominate
from memrad.reuse.pool import Namespace, ParkedSession, PrefixMatch
from memrad.reuse.prefix_index import common_prefix_len

Mode = Literal["exact", "fast"]


@dataclass(frozen=True, slots=True)
class RequestView:
    request_id: str
    prompt_ids: tuple[int, ...]
    prompt_text: str
    namespace: Namespace
    identity: Identity | None = None
    fingerprint: tuple[int, ...] = ()
    anchors: tuple[int, ...] | None = None  # reply anchors (exact mode); None: not checked


@dataclass(frozen=True, slots=True)
class Plan:
    decision: Decision
    session: ParkedSession | None = None  # resume from this one's state ...
    checkpoint: int = 0                   # ... at this position (0: cold)
    fork: bool = False                    # copy its rows and leave it parked (else: replace it)


def checkpoint_at_or_below(session: ParkedSession, limit: int, mode: Mode, chunk: int,
                           anchors: tuple[int, ...] | None = None) -> int | None:
    """The highest position <= limit whose state `session` can rebuild in `mode` (never 0).

    Exact mode with the request's `anchors`: also a cut of the request's prompt, with the
    same anchors below it as the session's, so both were chunked alike up to there.
    """
    if mode == "exact":
        limit = min(limit, session.exact_limit)
        if session.croppable:
            candidates = cuts_up_to(limit, chunk, session.anchors)
        else:
            candidates = [c for c in session.checkpoints if c <= limit and is_cut(c, chunk, session.anchors)]
        found = [c for c in candidates if anchors is None or _cut_alike(c, chunk, session.anchors, anchors)]
    else:
        limit = min(limit, session.num_tokens)
        if session.croppable:
            return limit if limit > 0 else None
        found = [c for c in session.checkpoints if c <= limit]
    return max(found, default=None)


def _cut_alike(position: int, chunk: int, parked: tuple[int, ...], request: tuple[int, ...]) -> bool:
    return (is_cut(position, chunk, request)
            and [a for a in parked if a < position] == [a for a in request if a < position])


@dataclass(frozen=True, slots=True)
class Verdict:
    checkpoint: int | None   # None: declined
    reason: str
    divergence: int | None   # first differing position, if the prompt diverges from the session
    reason_class: str | None = None  # why declined (memrad.protocol.REASON_CLASSES)


def verify(session: ParkedSession, prompt_ids: tuple[int, ...], mode: Mode, chunk: int,
           anchors: tuple[int, ...] | None = None) -> Verdict:
    """Resume only where the prompt reproduces the session's tokens, leaving a suffix to prime."""
    num_prompt = len(prompt_ids)
    shared = common_prefix_len(prompt_ids, session.token_ids)
    divergence = shared if shared < min(num_prompt, session.num_tokens) else None
    top = checkpoint_at_or_below(session, num_prompt - 1, mode, chunk)
    if top is None:
        at_end = checkpoint_at_or_below(session, num_prompt, mode, chunk)
        if at_end is not None and at_end == num_prompt and shared >= num_prompt:
            return Verdict(None, f"no suffix to prime (prompt {num_prompt} tokens, checkpoint {at_end})", divergence, "no-suffix")
        return Verdict(None, f"no {mode} checkpoint below the prompt's end "
                             f"(prompt {num_prompt} tokens, exact up to {session.exact_limit})", divergence,
                       "no-checkpoint")
    chosen = checkpoint_at_or_below(session, min(shared, num_prompt - 1), mode, chunk, anchors)
    if chosen is None:
        return Verdict(None, f"history diverged at {shared} of checkpoint {top}", divergence, "diverged")
    if chosen < top:
        return Verdict(chosen, f"history diverged at {shared} of checkpoint {top}; resumed from {chosen}; "
                               f"primed {num_prompt - chosen}", divergence)
    return Verdict(chosen, f"checkpoint {chosen}; primed {num_prompt - chosen}", divergence)


def _same_name(a: Identity | None, b: Identity | None) -> bool:
    return (a.name if a else None) == (b.name if b else None)


def _nominate_prefix(view: RequestView, sessions: list[ParkedSession]) -> tuple[Tier, ParkedSession] | None:
    ids = view.prompt_ids
    by_tokens = [s for s in sessions if 0 < s.num_tokens <= len(ids) and ids[s.num_tokens - 1] == s.token_ids[-1]
                 and common_prefix_len(ids, s.token_ids) == s.num_tokens]
    if by_tokens:
        return "token-prefix", max(by_tokens, key=lambda s: (s.num_tokens, s.last_used_at))
    by_text = [s for s in sessions if s.text and view.prompt_text.startswith(s.text)]
    if by_text:
        return "text-prefix", max(by_text, key=lambda s: (len(s.text), s.last_used_at))
    return None


def _decide(view: RequestView, tier: Tier, session: ParkedSession, mode: Mode, chunk: int,
            lead: str, **fields) -> Plan:
    """Verify a nominated session and record the outcome; `lead` starts the reason."""
    num_prompt = len(view.prompt_ids)
    verdict = verify(session, view.prompt_ids, mode, chunk, view.anchors)
    base = Decision(view.request_id, "declined", verdict.reason, 0, num_prompt, tier=tier,
                    candidate=session.session_id, divergence=verdict.divergence,
                    reason_class=verdict.reason_class, **fields)
    if verdict.checkpoint is None:
        return Plan(base)
    resumed = replace(base, outcome="resumed", reason=f"{lead}; {verdict.reason}",
                      reused_tokens=verdict.checkpoint, primed_tokens=num_prompt - verdict.checkpoint,
                      checkpoint=verdict.checkpoint, reason_class=None)
    return Plan(resumed, session, verdict.checkpoint)


def plan(view: RequestView, sessions: list[ParkedSession], mode: Mode, chunk: int,
         affinity: bool = True, longest_prefix: bool = True,
         matches: tuple[PrefixMatch, ...] | None = None) -> Plan:
    """Decide for one request; `sessions` are all parked sessions (any namespace), `matches`
    the pool index's prefix candidates for this prompt (None: compare with every session)."""
    mine = [s for s in sessions if s.namespace == view.namespace]
    if not mine:
        return Plan(Decision(view.request_id, "cold", "nothing parked for this model and cache_salt", 0,
                             len(view.prompt_ids), reason_class="nothing-parked"))
    nominated = _nominated(view, mine, mode, chunk, affinity)
    if not longest_prefix:
        return nominated
    if matches is None:
        matches = tuple(PrefixMatch(s, common_prefix_len(view.prompt_ids, s.token_ids)) for s in mine)
    best = _longest_prefix(view, [m for m in matches if m.session.namespace == view.namespace], mode, chunk)
    if best is None or (nominated.session is not None and nominated.checkpoint >= best.checkpoint):
        return nominated
    d = nominated.decision
    if d.outcome == "declined":
        best = replace(best, decision=replace(best.decision, reason=f"{best.decision.reason}; {d.render()}"))
    elif nominated.session is not None:
        best = replace(best, decision=replace(
            best.decision, reason=f"{best.decision.reason}; {d.tier} offered {d.candidate} at {d.checkpoint:,}"))
    return replace(best, decision=replace(best.decision, shared_segments=d.shared_segments))


def _longest_prefix(view: RequestView, matches: list[PrefixMatch], mode: Mode, chunk: int) -> Plan | None:
    """The match whose usable checkpoint at or below the shared prefix is highest."""
    num_prompt = len(view.prompt_ids)
    ranked = []
    for m in matches:
        found = checkpoint_at_or_below(m.session, min(m.shared_tokens, num_prompt - 1), mode, chunk, view.anchors)
        if found is not None:
            continues = _same_name(m.session.identity, view.identity) and m.shared_tokens >= m.session.prompt_checkpoint
            ranked.append((found, continues, m.session.last_used_at, m))
    if not ranked:
        return None
    checkpoint, continues, _, m = max(ranked, key=lambda r: r[:3])
    session = m.session
    how = "replaces it" if continues else "forked"
    diverged = m.shared_tokens if m.shared_tokens < min(num_prompt, session.num_tokens) else None
    decision = Decision(view.request_id, "resumed",
                        f"longest prefix with {session.session_id}, {checkpoint:,} of {num_prompt:,}; {how}",
                        checkpoint, num_prompt - checkpoint, tier="prefix", candidate=session.session_id,
                        checkpoint=checkpoint, divergence=diverged)
    return Plan(decision, session, checkpoint, fork=not continues)


def _nominated(view: RequestView, mine: list[ParkedSession], mode: Mode, chunk: int, affinity: bool) -> Plan:
    """The nominating tiers (token-prefix, text-prefix, affinity) and verification."""
    num_prompt = len(view.prompt_ids)

    def cold(reason: str, reason_class: str, **fields) -> Plan:
        return Plan(Decision(view.request_id, "cold", reason, 0, num_prompt, reason_class=reason_class, **fields))

    eligible = [s for s in mine if _same_name(s.identity, view.identity)]
    prefixed = _nominate_prefix(view, eligible)
    if prefixed is not None:
        tier, session = prefixed
        return _decide(view, tier, session, mode, chunk, f"session {session.session_id}")
    if not affinity:
        return cold(f"no nomination: no parked session's tokens or text prefix this prompt "
                    f"({len(eligible)} eligible parked); affinity off", "no-prefix")
    chosen = nominate(view.identity, view.fingerprint, mine)
    if isinstance(chosen, Nomination):
        return _decide(view, "affinity", chosen.session, mode, chunk, chosen.describe(),
                       nomination=chosen.kind, source=chosen.source, shared_segments=chosen.shared_segments)
    assert isinstance(chosen, Refusal)
    if chosen.blocked is not None:
        return Plan(Decision(view.request_id, "declined", chosen.reason, 0, num_prompt, tier="affinity",
                             candidate=chosen.blocked.session_id, shared_segments=chosen.shared_segments,
                             reason_class=chosen.reason_class))
    return cold(f"no nomination: {chosen.reason}", chosen.reason_class, shared_segments=chosen.shared_segments)
