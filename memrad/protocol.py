"""Records shared by the daemon and its clients (log, API debug field, TUI). Stdlib only.

A decision is one record rendered by one function, so the log line, the response header
and the TUI row say the same words.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Outcome = Literal["resumed", "declined", "cold"]
Tier = Literal["token-prefix", "text-prefix", "affinity"]


@dataclass(frozen=True, slots=True)
class Decision:
    """What the reuse tiers decided for one request, and why.

    `tier` is the tier that nominated a parked session (None: nothing was nominated);
    `nomination` is how affinity nominated it (explicit by name, or implicit by
    fingerprint) and `source` the field that carried the name; `checkpoint` is the position
    resumed from (None unless resumed); `divergence` is the first position where the
    prompt's tokens differ from the candidate's (None when they never do);
    `reused_tokens` + `primed_tokens` always equal the prompt length.
    """

    request_id: str
    outcome: Outcome
    reason: str
    reused_tokens: int
    primed_tokens: int
    tier: Tier | None = None
    candidate: str | None = None
    checkpoint: int | None = None
    nomination: Literal["explicit", "implicit"] | None = None
    source: str | None = None
    shared_segments: int | None = None
    divergence: int | None = None
    ttft_s: float | None = None

    def render(self) -> str:
        head = f"{self.tier}: {self.outcome}" if self.tier else self.outcome
        return f"{head} ({self.reason})"
