"""Which parked session a request resumes from, and at which checkpoint. Pure policy.

Every tier offers a candidate: token-prefix (the prompt's token ids extend a session's
committed tokens), text-prefix (the prompt's text extends its committed text), affinity
(identity: a name, or the structural fingerprint; see identity.py), and longest prefix
(needs no identity: among every parked session of the namespace, the one whose highest
usable checkpoint at or below the common token prefix is highest). The first three only
ever offer sessions of the request's namespace and with the same name (or both unnamed).
Each offer is verified: the request resumes only from a checkpoint its own tokens reproduce
exactly, with at least one token left to prime; below a divergence it falls back to the
highest checkpoint that still matches.

The most reuse wins, unless it costs more: of the verified offers, the cheapest to resume
(memrad.reuse.cost: the tokens it primes, plus the rows a fork copies, priced in tokens),
then the one at the highest checkpoint (ties: the request's own conversation, then the
most recently used, then the tier order above). More reuse of the same kind is always
cheaper, and a fork always beats priming from zero; the price only decides between a fork
that reuses a few more tokens and a replace that copies nothing (a session that ran the
same conversation before offers the request's next cut, a few tokens past its own session's
checkpoint, but copying every row below it costs more than priming those few tokens). A
nomination is one candidate among the tiers, never a veto on a longer exact match.
Reused tokens are always the request's own, so no winner can poison. The winner is
**replaced** only when the request continues its conversation (same name or both unnamed,
and the session's whole prompt is part of the shared prefix); otherwise the request
**forks** (the source stays parked, the request gets a copy of its rows): under one name
(a set of conversations) a sub-agent or a side query never replaces its siblings.

Usable checkpoints of a session, by mode (C = prefill chunk, P = prompt checkpoint):

    exact:  0     C     2C    a     a+C   a' = P   len(tokens)
            |-----|-----|-----|-----|-----|--------|
                  ^     ^     ^     ^     ^ cuts <= exact_limit: C multiples counted from 0,
                                            then from each reply anchor a (memrad.grid).
                                            Their state came from canonical prefill chunks,
                                            so a resume there is bit-identical to cold,
                                            provided the request was cut alike below it
    fast:   any position <= len(tokens) (attention-only), or any snapshot (recurrent)

Only state computed under the request's rope is resumed (memrad.engine.model.rope: a request
runs native where its prompt + reply fits the model's window, scaled past it). Where a
session of the other rope would have reused more than the winner, the decision says so, and
if nothing else is resumed it is declined with reason class "rescaled":

    token-prefix: declined (rescaled: 8,452 tokens (prompt 4,356 + reply 4,096) > native 8,192;
                            s3 was primed under the native rope, 4,352 tokens not reused)
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from memrad.grid import cuts_up_to, is_cut
from memrad.protocol import Alternative, Decision, Tier
from memrad.request import Identity
from memrad.reuse.cost import resume_cost
from memrad.reuse.identity import Nomination, Refusal, nominate
from memrad.reuse.pool import NATIVE, Namespace, ParkedSession, PrefixMatch
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
    rope: str = NATIVE  # the RoPE the request runs under; only sessions primed under it resume
    rope_reason: str = ""  # why that one, e.g. "8,301 tokens (prompt 4,205 + reply 4,096) > native 8,192"


@dataclass(frozen=True, slots=True)
class Plan:
    decision: Decision
    session: ParkedSession | None = None  # resume from this one's state ...
    checkpoint: int = 0                   # ... at this position (0: cold)
    fork: bool = False                    # copy its rows and leave it parked (else: replace it)


def copied_rows(session: ParkedSession, checkpoint: int, fork: bool) -> int | None:
    """Rows a resume copies before priming: a fork of a session in memory copies the rows it
    reuses (a replace hands them on; a disk session's state is read into fresh buffers)."""
    return checkpoint if fork and not session.on_disk else None


def _priced(decision: Decision, session: ParkedSession, checkpoint: int, fork: bool) -> Decision:
    """`decision` with what its resume costs: the rows it copies and its price in tokens."""
    rows = copied_rows(session, checkpoint, fork)
    return replace(decision, copied_rows=rows,
                   cost_tokens=resume_cost(checkpoint, decision.reused_tokens + decision.primed_tokens, rows or 0))


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


def _continues(view: RequestView, session: ParkedSession, shared_tokens: int) -> bool:
    """The request continues `session`'s conversation: same name (or both unnamed) and its
    tokens contain the session's whole prompt. Only then does it replace the session: its
    successor offers everything the session could (its whole prompt), so replacing loses
    nothing. A sibling under the same name (a sub-agent, a side query) or a client that
    compacted earlier history forks, and the session stays parked for whoever sends it."""
    return _same_name(session.identity, view.identity) and shared_tokens >= session.prompt_checkpoint


def _nominate_prefix(view: RequestView, sessions: list[ParkedSession]) -> list[tuple[Tier, ParkedSession]]:
    ids = view.prompt_ids
    offered: list[tuple[Tier, ParkedSession]] = []
    by_tokens = [s for s in sessions if 0 < s.num_tokens <= len(ids) and ids[s.num_tokens - 1] == s.token_ids[-1]
                 and common_prefix_len(ids, s.token_ids) == s.num_tokens]
    if by_tokens:
        offered.append(("token-prefix", max(by_tokens, key=lambda s: (s.num_tokens, s.last_used_at))))
    by_text = [s for s in sessions if s.text and view.prompt_text.startswith(s.text)]
    if by_text:
        offered.append(("text-prefix", max(by_text, key=lambda s: (len(s.text), s.last_used_at))))
    return offered


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
    fork = not _continues(view, session, common_prefix_len(view.prompt_ids, session.token_ids))
    resumed = replace(base, outcome="resumed", reason=f"{lead}; {verdict.reason}" + ("; forked" if fork else ""),
                      reused_tokens=verdict.checkpoint, primed_tokens=num_prompt - verdict.checkpoint,
                      checkpoint=verdict.checkpoint, reason_class=None)
    return Plan(_priced(resumed, session, verdict.checkpoint, fork), session, verdict.checkpoint, fork=fork)


def plan(view: RequestView, sessions: list[ParkedSession], mode: Mode, chunk: int,
         affinity: bool = True, longest_prefix: bool = True,
         matches: tuple[PrefixMatch, ...] | None = None) -> Plan:
    """Decide for one request; `sessions` are all parked sessions (any namespace), `matches`
    the pool index's prefix candidates for this prompt (None: compare with every session).

    Every tier offers its candidate, verified; the plan reusing the most tokens wins, among
    the sessions primed under the request's rope (a longer one under the other rope is said)."""
    mine = [s for s in sessions if s.namespace == view.namespace]
    if not mine:
        return Plan(Decision(view.request_id, "cold", "nothing parked for this model and cache_salt", 0,
                             len(view.prompt_ids), reason_class="nothing-parked"))
    if all(s.rope == view.rope for s in mine):
        return _plan_among(view, mine, mode, chunk, affinity, longest_prefix, matches)
    same = [s for s in mine if s.rope == view.rope]
    chosen = (_plan_among(view, same, mode, chunk, affinity, longest_prefix,
                          None if matches is None else tuple(m for m in matches if m.session.rope == view.rope))
              if same else Plan(Decision(view.request_id, "cold", f"nothing parked under the {view.rope} rope", 0,
                                         len(view.prompt_ids), reason_class="nothing-parked")))
    other = [s for s in mine if s.rope != view.rope]
    elsewhere = _plan_among(view, other, mode, chunk, affinity, longest_prefix,
                            None if matches is None else tuple(m for m in matches if m.session.rope != view.rope))
    return _other_rope(view, chosen, elsewhere)


def _other_rope(view: RequestView, chosen: Plan, elsewhere: Plan) -> Plan:
    """`chosen` (among the sessions of the request's rope), saying what `elsewhere` (the best
    plan among the other rope's) would have reused where that is more: declined "rescaled"
    when nothing of the request's rope is resumed."""
    if elsewhere.session is None or elsewhere.checkpoint <= chosen.checkpoint:
        return chosen
    session = elsewhere.session
    lead = "unscaled" if view.rope == NATIVE else "rescaled"
    note = (f"{lead}: {view.rope_reason or 'the request runs under the ' + view.rope + ' rope'}; "
            f"{session.session_id} was primed under the {session.rope} rope, {elsewhere.checkpoint:,} tokens not reused")
    if chosen.session is None:
        return Plan(Decision(view.request_id, "declined", note, 0, len(view.prompt_ids),
                             tier=elsewhere.decision.tier, candidate=session.session_id, reason_class="rescaled"))
    return replace(chosen, decision=replace(chosen.decision, reason=f"{chosen.decision.reason}; {note}"))


def _plan_among(view: RequestView, mine: list[ParkedSession], mode: Mode, chunk: int, affinity: bool,
                longest_prefix: bool, matches: tuple[PrefixMatch, ...] | None) -> Plan:
    """`plan` over `mine`, the namespace's sessions (non-empty)."""
    offered, fallback = _nominated(view, mine, mode, chunk, affinity)
    if longest_prefix:
        if matches is None:
            matches = tuple(PrefixMatch(s, common_prefix_len(view.prompt_ids, s.token_ids)) for s in mine)
        offered += _longest_prefix(view, [m for m in matches if m.session.namespace == view.namespace], mode, chunk)
    return _choose(offered, fallback)


TIER_ORDER: tuple[Tier, ...] = ("token-prefix", "text-prefix", "affinity", "prefix")


def _rank(p: Plan) -> tuple:
    """Cheapest, then most reuse, then the request's own conversation, then the most recent,
    then tier order."""
    return (-p.decision.cost_tokens, p.checkpoint, not p.fork, p.session.last_used_at,
            -TIER_ORDER.index(p.decision.tier))


CHEAPER = "cheaper resume"


def _won_by(winner: Plan, runner_up: Plan, longest: Plan) -> str:
    if longest.checkpoint > winner.checkpoint:
        return CHEAPER
    if winner.checkpoint > runner_up.checkpoint:
        return "most reuse"
    if winner.fork != runner_up.fork:
        return "tie: own conversation"
    if winner.session.last_used_at > runner_up.session.last_used_at:
        return "tie: most recent"
    return "tie: tier order"


def _choose(offered: list[Plan], fallback: Plan) -> Plan:
    """The resumable offer reusing the most tokens; else the first declined offer; else
    `fallback` (nothing nominated). The reason says what was weighed and why it won."""
    resumable = sorted((p for p in offered if p.session is not None), key=_rank, reverse=True)
    declined = [p.decision for p in offered if p.session is None]
    if not resumable:
        return Plan(declined[0]) if declined else fallback
    winner = resumable[0]
    d = winner.decision
    reason = d.reason + "".join(f"; {x.render()}" for x in declined)
    distinct = [p for i, p in enumerate(resumable)
                if all(q.session.session_id != p.session.session_id for q in resumable[:i])]
    won_by = None
    if len(distinct) > 1:
        longest = max(distinct, key=lambda p: p.checkpoint)
        won_by = _won_by(winner, distinct[1], longest)
        listed = ", ".join(f"{p.decision.tier} {p.session.session_id} at {p.checkpoint:,}"
                           for p in sorted(distinct, key=lambda p: TIER_ORDER.index(p.decision.tier)))
        reason += f"; weighed {listed}: {won_by}"
        if won_by == CHEAPER:
            reason += f" ({_why_cheaper(winner, longest)})"
    weighed = tuple(Alternative(p.decision.tier, p.decision.candidate, p.checkpoint if p.session else None,
                                p.decision.cost_tokens)
                    for p in sorted(offered, key=lambda p: TIER_ORDER.index(p.decision.tier)))
    segments = next((x.shared_segments for x in (d, *(p.decision for p in offered), fallback.decision)
                     if x.shared_segments is not None), None)
    return replace(winner, decision=replace(d, reason=reason, shared_segments=segments,
                                            weighed=weighed if won_by else (), won_by=won_by))


def _why_cheaper(winner: Plan, longer: Plan) -> str:
    """Why an offer reusing fewer tokens won: the longer one's copy costs more than it saves."""
    rows = longer.decision.copied_rows or 0
    return (f"forking {longer.session.session_id} at {longer.checkpoint:,} copies {rows:,} rows to prime "
            f"{longer.decision.primed_tokens:,}: {longer.decision.cost_tokens:,} tokens' worth against "
            f"{winner.decision.cost_tokens:,} priming {winner.decision.primed_tokens:,}")


def _longest_prefix(view: RequestView, matches: list[PrefixMatch], mode: Mode, chunk: int) -> list[Plan]:
    """The cheapest match to resume (at its highest usable checkpoint at or below the shared
    prefix), and the match reusing the most tokens when that is another (so the decision
    shows what the cheaper one was weighed against); [] when no match is usable."""
    num_prompt = len(view.prompt_ids)
    ranked = []
    for m in matches:
        found = checkpoint_at_or_below(m.session, min(m.shared_tokens, num_prompt - 1), mode, chunk, view.anchors)
        if found is not None:
            continues = _continues(view, m.session, m.shared_tokens)
            cost = resume_cost(found, num_prompt, copied_rows(m.session, found, not continues) or 0)
            ranked.append((-cost, found, continues, m.session.last_used_at, m))
    if not ranked:
        return []
    cheapest = max(ranked, key=lambda r: r[:4])
    longest = max(ranked, key=lambda r: r[1:4])
    picks = [cheapest] if longest[4] is cheapest[4] else [cheapest, longest]
    return [_prefix_plan(view, checkpoint, continues, m) for _, checkpoint, continues, _, m in picks]


def _prefix_plan(view: RequestView, checkpoint: int, continues: bool, m: PrefixMatch) -> Plan:
    num_prompt = len(view.prompt_ids)
    session = m.session
    how = "replaces it" if continues else "forked"
    diverged = m.shared_tokens if m.shared_tokens < min(num_prompt, session.num_tokens) else None
    decision = Decision(view.request_id, "resumed",
                        f"longest prefix with {session.session_id}, {checkpoint:,} of {num_prompt:,}; {how}",
                        checkpoint, num_prompt - checkpoint, tier="prefix", candidate=session.session_id,
                        checkpoint=checkpoint, divergence=diverged)
    return Plan(_priced(decision, session, checkpoint, not continues), session, checkpoint, fork=not continues)


def _nominated(view: RequestView, mine: list[ParkedSession], mode: Mode, chunk: int,
               affinity: bool) -> tuple[list[Plan], Plan]:
    """The nominating tiers (token-prefix, text-prefix, affinity), each offer verified; and
    the plan to take when none of them nominates anything."""
    num_prompt = len(view.prompt_ids)

    def cold(reason: str, reason_class: str, **fields) -> Plan:
        return Plan(Decision(view.request_id, "cold", reason, 0, num_prompt, reason_class=reason_class, **fields))

    eligible = [s for s in mine if _same_name(s.identity, view.identity)]
    offered = [_decide(view, tier, session, mode, chunk, f"session {session.session_id}")
               for tier, session in _nominate_prefix(view, eligible)]
    if not affinity:
        return offered, cold(f"no nomination: no parked session's tokens or text prefix this prompt "
                             f"({len(eligible)} eligible parked); affinity off", "no-prefix")

    def reusable(session: ParkedSession) -> int:
        return verify(session, view.prompt_ids, mode, chunk, view.anchors).checkpoint or 0

    chosen = nominate(view.identity, view.fingerprint, mine, reusable)
    if isinstance(chosen, Nomination):
        offered.append(_decide(view, "affinity", chosen.session, mode, chunk, chosen.describe(),
                               nomination=chosen.kind, source=chosen.source,
                               shared_segments=chosen.shared_segments))
        return offered, offered[-1]
    assert isinstance(chosen, Refusal)
    if chosen.blocked is not None:
        offered.append(Plan(Decision(view.request_id, "declined", chosen.reason, 0, num_prompt, tier="affinity",
                                     candidate=chosen.blocked.session_id, shared_segments=chosen.shared_segments,
                                     reason_class=chosen.reason_class)))
        return offered, offered[-1]
    return offered, cold(f"no nomination: {chosen.reason}", chosen.reason_class,
                         shared_segments=chosen.shared_segments)
