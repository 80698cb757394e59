"""Parked sessions and requests as control-socket records (memrad.protocol), for the TUI.

Labels and divergence context need the tokenizer, hence the engine package; the records
themselves are plain data.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from memrad.protocol import Decision, DecisionEvent, SegmentInfo, SessionInfo
from memrad.request import GenerationRequest
from memrad.reuse.fingerprint import Segment, segments
from memrad.reuse.pool import ParkedSession

LABEL_TOKENS = 4
CONTEXT_TOKENS = 12


def _readable(text: str, limit: int) -> str:
    text = text.replace("\n", "\\n")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def segment_infos(tokenizer: Any, ids: Sequence[int], segs: Sequence[Segment]) -> tuple[SegmentInfo, ...]:
    """Each segment of `ids` with a short label: its first words past the control tokens (the role)."""
    out = []
    for seg in segs:
        head = tokenizer.decode(list(ids[seg.start : min(seg.end, seg.start + LABEL_TOKENS)]),
                                skip_special_tokens=True)
        label = head.strip().split("\n")[0] or "(control)"
        out.append(SegmentInfo(_readable(label, 24), seg.start, seg.end, f"{seg.hash:016x}"))
    return tuple(out)


def session_info(tokenizer: Any, session: ParkedSession, openers: frozenset[int],
                 prompt_segments: Sequence[Segment] | None = None) -> SessionInfo:
    """`prompt_segments` (of the session's prompt) saves splitting it again when known."""
    identity = session.identity
    if prompt_segments is None:
        prompt_segments = segments(session.token_ids[: session.prompt_checkpoint], openers)
    return SessionInfo(
        session_id=session.session_id,
        identity=identity.name if identity else None,
        identity_source=identity.source if identity else None,
        model=session.namespace.model,
        cache_salt=session.namespace.cache_salt,
        num_tokens=session.num_tokens,
        prompt_checkpoint=session.prompt_checkpoint,
        exact_limit=session.exact_limit,
        checkpoints=session.checkpoints,
        num_bytes=session.num_bytes,
        age_s=round(time.time() - session.created_at, 3),
        hits=session.hits,
        segments=segment_infos(tokenizer, session.token_ids, prompt_segments),
        on_disk=session.on_disk,
    )


def divergence_context(tokenizer: Any, prompt: Sequence[int], parked: Sequence[int],
                       at: int) -> tuple[str, str]:
    """The text around the first differing token: (what the request has, what was parked)."""
    lo = max(0, at - CONTEXT_TOKENS)

    def show(ids: Sequence[int]) -> str:
        before = tokenizer.decode(list(ids[lo:at]), skip_special_tokens=False)
        after = tokenizer.decode(list(ids[at : at + CONTEXT_TOKENS]), skip_special_tokens=False)
        return _readable(before, 80) + " ▸ " + _readable(after, 80)

    return show(prompt), show(parked)


def decision_event(tokenizer: Any, openers: frozenset[int], request: GenerationRequest, decision: Decision,
                   prompt_segments: Sequence[Segment], candidate: ParkedSession | None) -> DecisionEvent:
    """The decision as the TUI shows it: the prompt's segments beside the candidate's, and
    the text around a divergence. `candidate`: the nominated session, if still in memory."""
    context, candidate_segments = None, ()
    if candidate is not None:
        parked_prompt = candidate.token_ids[: candidate.prompt_checkpoint]
        candidate_segments = segment_infos(tokenizer, parked_prompt, segments(parked_prompt, openers))
        if decision.divergence is not None:
            context = divergence_context(tokenizer, request.prompt_ids, candidate.token_ids, decision.divergence)
    return DecisionEvent(
        at=time.time(), decision=decision, prompt_tokens=request.num_prompt_tokens,
        identity=request.identity.name if request.identity else None,
        segments=segment_infos(tokenizer, request.prompt_ids, prompt_segments),
        divergence_context=context, candidate_segments=candidate_segments)
